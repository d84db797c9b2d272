"""`pagoda up` as a context manager for the tests that drive it from outside (third-party tools):
one CPU worker on a checkpoint, every port picked free. A helper, not a plugin: imported by the
tests that use it."""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def pagoda_up(model: str, cache_dir: Path, num_kv_blocks: int = 128) -> Iterator[tuple[str, str]]:
    """Runs `pagoda up --workers 1 --device cpu`; yields (HTTP base URL without /v1, worker metrics URL)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "pagoda.clients.up", "--workers", "1", "--port", "0",
                             "--device", "cpu", "--num-kv-blocks", str(num_kv_blocks), "--model", model,
                             "--cache-dir", str(cache_dir)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 240
        while not any("OpenAI HTTP at" in x for x in lines) and time.monotonic() < deadline:
            line = proc.stdout.readline()     # type: ignore[union-attr]
            if not line:
                break
            lines.append(line)
        out = "".join(lines)
        base = re.search(r"OpenAI HTTP at (http://\S+)", out)
        metrics = re.search(r"metrics at (http://\S+/metrics)", out)
        assert base and metrics, out
        yield base.group(1).removesuffix("/v1"), metrics.group(1)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
