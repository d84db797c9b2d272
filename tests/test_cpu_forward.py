"""The CPU forward's process-wide settings: OpenMP threads of a worker process spin only briefly
before they sleep (gpu_worker/__init__.py: on a CPU shared with other processes, libgomp's long
spin costs several times the CPU of the work itself), and fp32 linears go through the small-batch
kernel or oneDNN (models/parallel.py)."""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

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
print(os.environ.get("OMP_WAIT_POLICY"), os.environ.get("GOMP_SPINCOUNT"), time.process_time() - t)
"""


def probe(first: str, **env) -> tuple[str, str, float]:
    out = subprocess.run([sys.executable, "-c", PROBE.format(first=first)], capture_output=True, text=True,
                         check=True, cwd=ROOT, timeout=120,
                         env={**{k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")},
                              **env})
    policy, spin, cpu = out.stdout.split()
    return policy, spin, float(cpu)


def test_waiting_threads_sleep():
    policy, spin, idle_cpu = probe("import pagoda.gpu_worker")
    assert (policy, spin) == ("None", "1000") and idle_cpu < 0.02


def test_own_policy_kept():
    # ACTIVE keeps the other thread spinning through the main thread's sleep.
    policy, spin, idle_cpu = probe("import pagoda.gpu_worker", OMP_WAIT_POLICY="ACTIVE")
    assert (policy, spin) == ("ACTIVE", "None") and idle_cpu > 0.05
    # and a spin count of one's own
    assert probe("import pagoda.gpu_worker", GOMP_SPINCOUNT="5")[:2] == ("None", "5")


def test_torch_first_left_alone():
    # Too late to change OpenMP once torch is loaded: the environment is not touched.
    assert probe("import torch\nimport pagoda.gpu_worker")[:2] == ("None", "None")


def test_dense_linear_matches_f_linear():
    from pagoda.gpu_worker.models.parallel import _POOL, dense_linear
    assert _POOL       # the default: the C kernels (they build on the test machine)
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(300, 96, generator=g), torch.randn(300, generator=g)
    for rows in (1, 7, 64):
        x = torch.randn(rows, 96, generator=g)
        with torch.inference_mode():
            torch.testing.assert_close(dense_linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(dense_linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    # Autograd recording, or 3-D input: F.linear itself.
    x = torch.randn(2, 3, 96, generator=g)
    assert torch.equal(dense_linear(x, w), F.linear(x, w))
    wg = w.clone().requires_grad_()
    dense_linear(x[0], wg).sum().backward()
    assert wg.grad is not None


def test_cpu_gemm_flag_checked():
    out = subprocess.run([sys.executable, "-c", "import pagoda.gpu_worker.models.parallel"], capture_output=True,
                         text=True, cwd=ROOT, timeout=120, env={**os.environ, "PAGODA_CPU_GEMM": "mkl"})
    assert out.returncode != 0 and "PAGODA_CPU_GEMM: must be one of auto, c, onednn, torch (got 'mkl')" in out.stderr


@pytest.mark.parametrize("gemm", ["torch", "onednn", "c", "auto", None])
def test_cpu_gemm_choice(gemm):
    env = {k: v for k, v in os.environ.items() if k != "PAGODA_CPU_GEMM"}
    if gemm:
        env["PAGODA_CPU_GEMM"] = gemm
    code = "from pagoda.gpu_worker.models.parallel import _ONEDNN, _POOL; print(_ONEDNN, _POOL)"
    out = subprocess.run([sys.executable, "-c", code],
                         capture_output=True, text=True, cwd=ROOT, timeout=120, env=env, check=True)
    assert out.stdout.split() == [str(gemm == "onednn"), str(gemm in ("c", "auto", None))]


def test_large_batches_use_the_packed_weight_and_follow_its_writes():
    import gc

    from pagoda.gpu_worker.models import parallel
    g = torch.Generator().manual_seed(4)
    w = torch.nn.Parameter(torch.randn(300, 96, generator=g))
    x = torch.randn(40, 96, generator=g)
    with torch.inference_mode():
        torch.testing.assert_close(parallel.dense_linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    key = (id(w), parallel.cpu_gemm.pack)
    assert key in parallel._packs
    with torch.no_grad():
        w.mul_(-2)                       # a write after packing: the packed copy is stale
    with torch.inference_mode():
        torch.testing.assert_close(parallel.dense_linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    del w
    gc.collect()
    assert key not in parallel._packs   # the copy goes with its parameter
