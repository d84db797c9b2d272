"""Validation bounds (gpu_worker/core/sampling_params.py): every numeric sampling and beam field
is held to a range whose arithmetic cannot overflow (len ** length_penalty, logits / temperature,
seed + n), the error names the field and the bound, and the values people use pass."""
from __future__ import annotations

import pytest

from pagoda.gpu_worker.core.sampling_params import SamplingParams


@pytest.mark.parametrize("field,value,bound", [
    ("length_penalty", 1e38, "[-10, 10]"), ("length_penalty", 400.0, "[-10, 10]"),
    ("length_penalty", -11.0, "[-10, 10]"),
    ("temperature", 1e-30, "[0.0001, 100]"), ("temperature", 101.0, "[0.0001, 100]"),
    ("repetition_penalty", 1e-30, "[0.01, 100]"), ("repetition_penalty", 1e6, "[0.01, 100]"),
    ("presence_penalty", 2.5, "[-2, 2]"), ("frequency_penalty", -3.0, "[-2, 2]"),
    ("top_p", 1.5, "(0, 1]"), ("min_p", -0.1, "[0, 1]"), ("top_k", 1 << 40, "1048576"),
    ("logit_bias", {5: 1e30}, "[-100, 100]"), ("logit_bias", {5: -101}, "[-100, 100]"),
    ("n", 5000, "[1, 1024]"), ("best_of", 5000, "1024]"),
    ("seed", 2 ** 63 - 1, "seed + n stays an int64"), ("seed", -2 ** 63 - 1, "seed + n stays an int64"),
])
def test_every_numeric_field_is_bounded_and_the_bound_is_named(field, value, bound):
    with pytest.raises(ValueError) as e:
        SamplingParams(**{field: value}).validate(1000)
    assert str(e.value).startswith(f"{field}:") and bound in str(e.value)


@pytest.mark.parametrize("kw", [
    dict(length_penalty=10.0, use_beam_search=True, temperature=0.0), dict(length_penalty=1.0),
    dict(length_penalty=-10.0, use_beam_search=True, temperature=0.0), dict(temperature=100.0), dict(temperature=1e-4),
    dict(temperature=0.0), dict(repetition_penalty=2.0), dict(logit_bias={5: -100, 6: 100}), dict(seed=-1),
    dict(seed=2 ** 63 - 1 - 1024), dict(top_k=50), dict(top_k=-1), dict(n=16, best_of=32, use_beam_search=True,
                                                                         temperature=0.0)])
def test_values_people_use_pass(kw):
    if kw.get("best_of"):
        with pytest.raises(ValueError, match=r"best_of: the beam width must be in \[1, 16\]"):
            SamplingParams(**kw).validate(1000)
        return
    SamplingParams(**kw).validate(1000)


def test_the_widest_length_penalty_is_finite_at_any_length():
    from pagoda.gpu_worker.features.beam_search import beam_score
    for lp in (-10.0, 10.0):
        for n in (1, 2, 2 ** 20):
            assert abs(beam_score(n, False, -1e6, lp)) < float("inf")


def test_length_penalty_without_beam_search_is_refused_on_every_front():
    """The rule lives in validation, so the gRPC front (sampling_from_proto) refuses it as the
    HTTP front does, instead of accepting and ignoring it."""
    from pagoda.gpu_worker.serving.server import sampling_from_proto
    from pagoda.protos.pagoda.v1 import pagoda_pb2 as pb
    with pytest.raises(ValueError, match=r"^length_penalty: only applies with use_beam_search \(got 0.5\)"):
        sampling_from_proto(pb.SamplingParams(length_penalty=0.5)).validate(1000)
    sampling_from_proto(pb.SamplingParams(length_penalty=0.5, use_beam_search=True)).validate(1000)
