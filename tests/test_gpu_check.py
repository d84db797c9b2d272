"""bench/gpu_check.sh, checked without a GPU: --dry-run walks every part and runs the e2e harness
at a tiny shape on the CPU; --vendor gathers what the GPU host lacks (pytest, llguidance)."""
import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_dry_run_plans_every_part_and_runs_the_harness(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), GPU_VENDOR=str(tmp_path / "none"))
    res = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry-run"], env=env,
                         capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-2000:]
    summary = (tmp_path / "summary.txt").read_text()
    for part in ("gpu_tests", "kernels", "e2e", "quant", "lora", "kv_tier", "kv_copy"):
        assert f"== {part}" in summary
    assert "e2e: rc=0" in summary, summary
    assert "kv_copy: rc=0" in summary, summary
    assert "| 16 | " in (tmp_path / "kv_copy.md").read_text()
    assert "quant: rc=0" in summary, summary
    assert "| qkv (256 x 128) | 16 |" in (tmp_path / "quant.md").read_text()
    table = (tmp_path / "e2e.md").read_text()
    assert all(f"| tiny | {mode} | {b} |" in table for mode in ("graphs", "sync", "eager") for b in (1, 3))
    lines = (tmp_path / "e2e.jsonl").read_text().splitlines()
    assert len(lines) == 6


def test_vendor_gathers_the_packages_the_gpu_host_lacks(tmp_path):
    vendor = tmp_path / "vendor"
    res = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--vendor"],
                         env=dict(os.environ, GPU_VENDOR=str(vendor)), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    names = set(os.listdir(vendor))
    assert {"pytest", "_pytest", "pluggy", "llguidance", "pytest_timeout.py"} <= names
    assert any(n.startswith("pytest_timeout-") and n.endswith(".dist-info") for n in names), "entry points lost"


def test_the_parts_fit_one_device_command():
    # The device runs one command for at most 600 s out of 15 minutes a session, start-up included:
    # the parts' limits (a part named twice is the --dry-run branch, then the real one) stay <= 480 s.
    limits = {}
    for name, limit in re.findall(r"^\s*part (\S+) (\d+) ", (ROOT / "bench" / "gpu_check.sh").read_text(), re.M):
        limits[name] = int(limit)
    assert set(limits) == {"gpu_tests", "kernels", "e2e", "quant", "lora", "kv_tier", "kv_copy"}
    assert sum(limits.values()) <= 480, limits
