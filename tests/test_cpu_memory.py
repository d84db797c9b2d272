"""A CPU worker's freed activations keep their pages (cpu_lib.keep_freed_memory): the next step's
buffers of the same size fault nothing in, where glibc by default maps and unmaps every
allocation over 32 MiB (a 0.5B model's prefill wrote 1.5 GB of fresh pages per step)."""
import os
import subprocess
import sys
from pathlib import Path

from pagoda.kernels import cpu_lib

# Allocate, write and free 64 MiB (16,384 pages of 4 KiB) twice; print the minor page faults of
# the second time.
SECOND_TOUCH = """
import resource, sys, torch
from pagoda.kernels import cpu_lib
kept = cpu_lib.keep_freed_memory()
def touch():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.empty(16 << 20)
    x.fill_(1.0)
    del x
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
touch()
print(kept, touch())
"""


def second_touch(env_value: str) -> tuple[str, int]:
    env = {**os.environ, "PAGODA_CPU_KEEP_FREED": env_value}
    out = subprocess.run([sys.executable, "-c", SECOND_TOUCH], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    return out[0], int(out[1])


def test_freed_activations_are_reused_without_page_faults():
    kept, faults = second_touch("1")
    assert kept == "True" and faults < 1000
    # glibc's defaults (the opt-out): the same 64 MiB faults in again, page by page (in 2 MiB
    # pages where transparent huge pages are "always": then only the flag is checked).
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    huge = thp.exists() and "[always]" in thp.read_text()
    kept, faults = second_touch("0")
    assert kept == "False" and (faults > 8000 or huge)


def test_a_cpu_model_runner_sets_it(tiny_model, monkeypatch):
    from pagoda.gpu_worker.engine.llm import LLM
    calls: list[int] = []
    monkeypatch.setattr(cpu_lib, "keep_freed_memory", lambda: calls.append(1) or True)
    LLM(tiny_model, device="cpu")
    assert calls == [1]
