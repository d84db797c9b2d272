"""Smoke test: bench/relay.py --quick still runs end to end with its variants (stream intervals,
direct mode) and reports sane figures (the recorded numbers live in bench/RESULTS.md)."""
import pytest

from tests.test_bench_smoke import run_script, table_rows


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_relay_quick_with_stream_intervals_and_direct_mode():
    out = run_script("relay.py", "--min-tokens", "64", "--stream-intervals", "1,4",
                     "--fronts", "worker,grpc,direct", timeout=220)
    rows = {(r["concurrency"], r["front"], r["stream interval"]): r for r in table_rows(out, "concurrency")}
    assert set(rows) == {(c, f, si) for c in ("1", "4") for f in ("worker", "grpc", "direct") for si in ("1", "4")}
    for (c, front, si), r in rows.items():
        per_chunk = float(r["tokens/chunk"])
        # 16 tokens a request: interval 4 sends 1 + 4 + 4 + 4 + 3 (fewer when steps queued up).
        assert (per_chunk >= 3.0) if si == "4" else (1.0 <= per_chunk < 3.0), (c, front, si, per_chunk)
        assert float(r["worker CPU us/token"]) > 0
        if front != "worker":
            assert float(r["router CPU us/token"]) >= 0 and r["router CPU us/request"] != "-"
