"""Smoke test: bench/soak.py --quick still runs end to end (redis-server, 2 CPU workers, a router, the
hostile mix, a worker killed and restarted) and reports its figures, each at its target (the recorded
run lives in bench/RESULTS.md, "Soak")."""
import pytest

from tests.test_bench_smoke import run_script, table_rows


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_soak_quick(tiny_model, tmp_path):
    png = tmp_path / "rss.png"
    out = run_script("soak.py", "--model", tiny_model, "--plot", str(png), timeout=280)
    rows = {r["figure"]: r for r in table_rows(out, "figure")}
    for figure in ("good requests lost", "neighbours failed", "hostile requests answered wrongly",
                   "held connections left open", "blocks leaked", "router RSS past its bound (MiB)"):
        assert float(rows[figure]["value"]) == 0, (figure, rows[figure])
    assert int(rows["good requests lost"]["detail"].split()[0]) > 0            # good requests were served
    detail = rows["held connections left open"]["detail"]
    assert all(kind in detail for kind in ("idle", "slowloris", "stalled")), detail
    assert "w1 killed" in rows["other work"]["detail"]
    processes = {r["process"] for r in table_rows(out, "process")}
    assert processes == {"redis", "router", "w0", "w1"}
    assert png.stat().st_size > 10_000
