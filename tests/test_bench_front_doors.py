"""Smoke test: bench/front_doors.py --quick still runs end to end (real stack, offline engine) and
reports a row per front door and per constrained share (the recorded figures live in bench/RESULTS.md)."""
import pytest

from tests.test_bench_smoke import run_script, table_rows


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_front_doors_quick(tiny_model):
    out = run_script("front_doors.py", "--model", tiny_model, timeout=220)
    overhead, constrained = out.split("\nBatch of")       # two tables of the same width
    fronts = {r["front door"]: r for r in table_rows(overhead, "front door")}
    assert set(fronts) == {"worker, gRPC (no router)", "router, gRPC", "router, HTTP (OpenAI)"}
    assert all(float(r["p50 ms"]) > 0 for r in fronts.values())
    shares = {r["constrained (JSON schema)"]: r for r in table_rows(constrained, "constrained (JSON schema)")}
    assert set(shares) == {"none", "half", "all"} and shares["none"]["vs none"] == "1"
