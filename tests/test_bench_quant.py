"""bench/quant.py --quick runs end to end: every format loads, decodes and holds fewer weight bytes."""
import os
import subprocess
import sys

import pytest

from tests.test_bench_smoke import table_rows

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(180)
def test_quant_bench_quick(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(REPO, "bench", "quant.py"), "--quick", "--model-dir",
                           str(tmp_path), "--out", str(tmp_path / "quant.md")],
                          cwd=REPO, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["weights"]: r for r in table_rows(proc.stdout, "weights")}
    assert set(rows) == {"none", "fp8 (at load)", "compressed-tensors fp8 channel", "fp8 block 128x128",
                         "gptq int4 g128", "awq int4 g128", "compressed-tensors int4 g128"}
    assert rows["none"]["bytes x none"] == "1.000" and rows["none"]["tok/s x none"] == "1.00"
    for name, r in rows.items():
        assert float(r["decode tok/s (CPU s)"]) > 0
        if name != "none":
            assert float(r["bytes x none"]) < 0.8, (name, r)      # the quick model's linears are ~40% of it
    assert rows["gptq int4 g128"]["bytes (MiB)"] < rows["fp8 (at load)"]["bytes (MiB)"]
    assert (tmp_path / "quant.md").read_text().count("| ") > 10
