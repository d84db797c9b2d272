"""Smoke test: bench/fetch_hints.py --quick still runs end to end (redis-server, two real workers,
routers with fetch hints on and off, closed-loop clients) and reports a row per mode, the router
with hints off sending none (the recorded figures live in bench/RESULTS.md)."""
import pytest

from tests.test_bench_smoke import run_script, table_rows


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fetch_hints_quick():
    out = run_script("fetch_hints.py", timeout=280)
    rows = {r["fetch hints"]: r for r in table_rows(out, "fetch hints")}
    assert set(rows) == {"off", "on"} and rows["off"]["hints sent"] == "0"
    for r in rows.values():
        assert int(r["requests"]) > 0 and float(r["TTFT p50 ms"]) > 0
    assert "on / off:" in out
