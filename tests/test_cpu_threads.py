"""OpenMP threads of a worker process sleep while they wait (gpu_worker/__init__.py): on a CPU
shared with other processes, spinning threads cost several times the CPU of the work itself."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A parallel torch op on two threads, then the main thread sleeps: CPU seconds spent meanwhile.
PROBE = """
import os, sys, time
{first}
import torch
torch.set_num_threads(2)
x = torch.randn(2048, 2048)
for _ in range(3):
    x @ x
t = time.process_time()
time.sleep(0.5)
print(os.environ.get("OMP_WAIT_POLICY"), time.process_time() - t)
"""


def probe(first: str, **env) -> tuple[str, float]:
    out = subprocess.run([sys.executable, "-c", PROBE.format(first=first)], capture_output=True, text=True,
                         check=True, cwd=ROOT, timeout=120,
                         env={k: v for k, v in {**os.environ, **env}.items() if v is not None})
    policy, cpu = out.stdout.split()
    return policy, float(cpu)


def test_waiting_threads_sleep():
    policy, idle_cpu = probe("import gpu_worker", OMP_WAIT_POLICY=None)
    assert policy == "PASSIVE" and idle_cpu < 0.02


def test_own_policy_kept():
    # ACTIVE keeps the other thread spinning through the main thread's sleep.
    policy, idle_cpu = probe("import gpu_worker", OMP_WAIT_POLICY="ACTIVE")
    assert policy == "ACTIVE" and idle_cpu > 0.05


def test_torch_first_left_alone():
    # Too late to change OpenMP once torch is loaded: the environment is not touched.
    policy, _ = probe("import torch\nimport gpu_worker", OMP_WAIT_POLICY=None)
    assert policy == "None"
