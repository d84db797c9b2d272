"""The one stop and length rule (gpu_worker/core/stop.py): each case here fails when one line of
the rule changes (EOS against ignore_eos, min_tokens, max_tokens, max_model_len, stop token ids,
the order of a stop token, a stop string and length)."""
import itertools

import numpy as np
import pytest

from pagoda.gpu_worker.core.request import Request, RequestStatus
from pagoda.gpu_worker.core.sampling_params import SamplingParams
from pagoda.gpu_worker.core.stop import (
    LENGTH,
    STOP_TOKEN,
    check_stop,
    check_stop_batch,
    finish_on_token,
    reaches_length,
    stop_token_ids,
)
from pagoda.protos.block_hash import namespace_root

EOS = [2, 3]


def test_stop_ids_are_the_requests_then_eos_unless_ignored():
    assert stop_token_ids([7, 2], False, EOS) == [7, 2, 3]
    assert stop_token_ids([7], True, EOS) == [7]
    assert stop_token_ids([], False, EOS) == [2, 3]
    assert stop_token_ids([], True, EOS) == []


# (token, num_tokens, num_output_tokens, stop ids, min_tokens, max_tokens, max_model_len) -> flags
CASES = [
    ((2, 10, 3, stop_token_ids([], False, EOS), 0, 16, 64), STOP_TOKEN),        # EOS
    ((3, 10, 3, stop_token_ids([], False, EOS), 0, 16, 64), STOP_TOKEN),        # the second EOS id
    ((2, 10, 3, stop_token_ids([], True, EOS), 0, 16, 64), 0),                  # ignore_eos
    ((7, 10, 3, stop_token_ids([7], True, EOS), 0, 16, 64), STOP_TOKEN),        # a stop id despite ignore_eos
    ((9, 10, 3, stop_token_ids([7], False, EOS), 0, 16, 64), 0),                # any other token
    ((2, 10, 3, stop_token_ids([], False, EOS), 3, 16, 64), STOP_TOKEN),        # min_tokens out, this one counted
    ((2, 10, 2, stop_token_ids([], False, EOS), 3, 16, 64), 0),                 # min_tokens not yet out
    ((7, 10, 2, stop_token_ids([7], False, EOS), 3, 16, 64), 0),                # min_tokens holds stop ids too
    ((9, 10, 16, stop_token_ids([], False, EOS), 0, 16, 64), LENGTH),           # max_tokens reached
    ((9, 10, 15, stop_token_ids([], False, EOS), 0, 16, 64), 0),                # one short of it
    ((9, 64, 5, stop_token_ids([], False, EOS), 0, 16, 64), LENGTH),            # max_model_len reached
    ((9, 63, 5, stop_token_ids([], False, EOS), 0, 16, 64), 0),                 # one short of it
    ((2, 64, 2, stop_token_ids([], False, EOS), 3, 16, 64), LENGTH),            # min_tokens never holds length
    ((2, 10, 16, stop_token_ids([], False, EOS), 0, 16, 64), STOP_TOKEN | LENGTH),
]


@pytest.mark.parametrize("args, flags", CASES)
def test_check_stop(args, flags):
    assert check_stop(*args) == flags


def test_the_batched_rule_is_the_rule():
    """check_stop_batch over the cases above and a grid around the limits equals check_stop."""
    grid = list(itertools.product([2, 7, 9], [62, 63, 64], [0, 1, 2, 3, 15, 16], [0, 3], [1, 16]))
    cases = [args for args, _ in CASES] + [
        (tok, nt, no, stop_token_ids([7], ign, EOS), mn, mx, 64)
        for (tok, nt, no, mn, mx), ign in itertools.product(grid, [False, True]) if mn <= mx]
    width = max(len(c[3]) for c in cases)
    stops = np.full((len(cases), width), -1, np.int64)
    for i, c in enumerate(cases):
        stops[i, :len(c[3])] = c[3]
    col = [np.array([c[j] for c in cases], np.int64) for j in (0, 1, 2, 4, 5)]
    got = check_stop_batch(col[0], col[1], col[2], stops, col[3], col[4], 64)
    assert got.tolist() == [check_stop(*c) for c in cases]
    # One row's stop ids against several tokens (a speculating row), broadcast.
    t = np.array([9, 7, 2])
    assert check_stop_batch(t, np.array([20, 21, 22]), np.array([1, 2, 3]), stops[3][None, :], 0, 3, 64).tolist() == \
        [check_stop(int(x), 20 + i, 1 + i, CASES[3][0][3], 0, 3, 64) for i, x in enumerate(t)]


def test_reaches_length_without_a_model_limit():
    assert reaches_length(10, 4, 4, None) and not reaches_length(10, 3, 4, None)
    assert reaches_length(64, 1, 4, 64) and not reaches_length(63, 1, 4, 64)


class _Detok:
    """A detokenizer whose text completes the stop string "END" at token `ends_at`."""

    def __init__(self, ends_at: int | None = None):
        self.ends_at, self.added, self.stop_reason = ends_at, [], None

    def add_token(self, token, check_stop=True):
        self.added.append((token, check_stop))
        if check_stop and token == self.ends_at:
            self.stop_reason = "END"
            return "END"
        return None


def _req(**params) -> Request:
    return Request("r", [1, 2, 3], SamplingParams(**params), 16, namespace_root("m", "", ""))


def test_a_stop_token_ends_before_its_text_and_names_itself_only_if_asked_for():
    req, detok = _req(stop_token_ids=[7]), _Detok(ends_at=7)
    assert finish_on_token(req, 7, STOP_TOKEN | LENGTH, 1, detok) is RequestStatus.FINISHED_STOPPED
    assert req.stop_reason == 7 and detok.added == []
    req = _req()
    assert finish_on_token(req, 2, STOP_TOKEN, 1, _Detok()) is RequestStatus.FINISHED_STOPPED
    assert req.stop_reason is None          # EOS: no stop reason


def test_a_stop_string_ends_once_min_tokens_are_out_and_wins_over_length():
    req, detok = _req(stop=["END"], min_tokens=2), _Detok(ends_at=5)
    assert finish_on_token(req, 5, 0, 1, detok) is None             # held: min_tokens not out
    assert finish_on_token(req, 5, LENGTH, 2, detok) is RequestStatus.FINISHED_STOPPED
    assert req.stop_reason == "END" and detok.added == [(5, False), (5, True)]


def test_length_ends_last_and_nothing_else_goes_on():
    req = _req()
    assert finish_on_token(req, 9, LENGTH, 16, _Detok()) is RequestStatus.FINISHED_LENGTH
    assert req.stop_reason is None
    assert finish_on_token(req, 9, 0, 3, _Detok()) is None
