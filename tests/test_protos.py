"""The committed pagoda.v1 stubs are exactly what `python -m pagoda.protos.gen` produces, and they import
without torch (a router or client image carries no GPU stack)."""
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_stubs_are_reproducible(tmp_path):
    pytest.importorskip("grpc_tools")
    from pagoda.protos import gen
    gen.generate(tmp_path)
    produced = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert produced, "protoc produced nothing"
    for rel in produced:
        committed = ROOT / rel
        assert committed.exists(), f"{rel} is generated but not committed: run python -m pagoda.protos.gen"
        assert committed.read_text() == (tmp_path / rel).read_text(), f"{rel} is stale: run python -m pagoda.protos.gen"


def test_stubs_and_client_side_import_without_torch():
    code = ("import sys; import pagoda.protos.pagoda.v1.pagoda_pb2_grpc, pagoda.runtime.tokenization, pagoda.clients.cli; "
            "bad = [m for m in ('torch', 'pagoda.gpu_worker', 'transformers') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)


def test_proto_round_trip_keeps_unset_distinct_from_zero():
    from pagoda.protos.pagoda.v1 import pagoda_pb2 as pb
    req = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(temperature=0.0))
    back = pb.GenerateRequest.FromString(req.SerializeToString())
    assert back.sampling.HasField("temperature") and back.sampling.temperature == 0.0
    assert not back.sampling.HasField("top_p")
    assert back.HasField("text") and not back.token_ids
