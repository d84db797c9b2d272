"""Smoke test: bench/pd.py --quick still runs end to end (redis, a router, two workers per mode:
colocated and prefill/decode) and reports a row per mode and their ratio, with every request of
the P/D rounds disaggregated (the recorded figures live in bench/RESULTS.md)."""
import pytest

from tests.test_bench_smoke import run_script, table_rows


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pd_quick():
    out = run_script("pd.py", timeout=280)
    rows = {r["mode"]: r for r in table_rows(out, "mode")}
    assert set(rows) == {"colo", "pd", "pd / colo"}
    assert rows["colo"]["ITL samples"] == rows["pd"]["ITL samples"] == str(2 * 23)
    assert all(float(rows[m]["throughput tok/s"]) > 0 for m in ("colo", "pd"))
    # 1 round: 2 streams + 2 long prompts, every one through a prefill worker.
    assert "pagoda_router_pd_requests_total 4" in out and "pd_fallbacks" not in out
