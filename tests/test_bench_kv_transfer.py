"""Smoke test: bench/kv_transfer.py --quick still runs end to end (two real workers, fetch against
recompute) and reports a row per prefix length and a break-even line (the recorded figures live in
bench/RESULTS.md)."""
import pytest

from tests.test_bench_smoke import run_script, table_rows


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_kv_transfer_quick():
    out = run_script("kv_transfer.py", timeout=280)
    rows = {r["prefix tokens"]: r for r in table_rows(out, "prefix tokens")}
    assert set(rows) == {"64", "256"} and rows["256"]["blocks"] == "16"
    for r in rows.values():
        assert float(r["fetch TTFT ms (median)"]) > 0 and float(r["recompute TTFT ms (median)"]) > 0
    assert "break-even prefix:" in out
