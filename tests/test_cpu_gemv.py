"""The small-batch CPU linear (kernels/cpu_gemv.py, csrc/gemv_cpu.c) and the kernels' thread pool
(csrc/thread_pool.c) it shares with the attention kernel: results against F.linear (bf16 and
fp16 against fp32 on the same upcast values), a row's result independent of its batch and of
the thread count, concurrent callers, a forked child, and idle pool threads that cost no CPU."""
import os
import shutil
import subprocess
import sys
import threading

import pytest
import torch
import torch.nn.functional as F

from pagoda.kernels import cpu_gemv, cpu_lib
from pagoda.kernels.cpu_gemv import small_linear

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_library_builds():
    assert cpu_lib.available(), "the C kernels must build on the test machine (gcc/cc)"


@pytest.mark.parametrize("k", [1, 7, 32, 96, 131])
@pytest.mark.parametrize("n", [1, 15, 16, 300])
def test_matches_f_linear(k, n):
    g = torch.Generator().manual_seed(k * 1000 + n)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    for m in range(1, cpu_lib.GEMV_MAX_M + 1):
        x = torch.randn(m, k, generator=g)
        assert cpu_gemv.takes(x, w, b)
        torch.testing.assert_close(small_linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(small_linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)


# Half the spacing of the dtype's values at |y| (its rounding), relative: the most a bf16/fp16
# result may differ from the fp32 result of the same (upcast) inputs, beside fp32's own error.
ROUNDING = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def assert_matches_upcast(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    """y, a bf16/fp16 linear's result, is fp32's F.linear of the same values, rounded once."""
    assert y.dtype == x.dtype and y.shape == (x.shape[0], w.shape[0])
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    torch.testing.assert_close(y.float(), want, rtol=ROUNDING[x.dtype], atol=1e-5 * x.shape[1] ** 0.5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [1, 7, 31, 32, 33, 131, 257])     # blocks of 32 (bf16: 2 x 16) and tails
@pytest.mark.parametrize("n", [1, 17, 300])
@pytest.mark.parametrize("threads", ["1", "2"])
def test_low_precision_matches_fp32_of_the_same_values(dtype, k, n, threads, monkeypatch):
    monkeypatch.setenv("PAGODA_CPU_KERNEL_THREADS", threads)
    g = torch.Generator().manual_seed(k * 1000 + n)
    w, b = torch.randn(n * 20, k, generator=g).to(dtype), torch.randn(n * 20, generator=g).to(dtype)
    for m in range(1, cpu_lib.GEMV_MAX_M + 1):
        x = torch.randn(m, k, generator=g).to(dtype)
        assert cpu_gemv.takes(x, w, b)
        assert_matches_upcast(small_linear(x, w, b), x, w, b)
        assert_matches_upcast(small_linear(x, w), x, w, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rows_independent_of_batch_and_threads(monkeypatch, dtype):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(2048, 1408, generator=g).to(dtype)     # big enough to split over every thread
    x = torch.randn(cpu_lib.GEMV_MAX_M, 1408, generator=g).to(dtype)
    alone = [small_linear(x[i:i + 1], w) for i in range(len(x))]
    for threads in ("1", "2", "3"):
        monkeypatch.setenv("PAGODA_CPU_KERNEL_THREADS", threads)
        for m in range(1, len(x) + 1):
            y = small_linear(x[:m], w)
            for i in range(m):
                assert torch.equal(y[i:i + 1], alone[i]), (threads, m, i)


def test_refused_shapes_go_elsewhere():
    w = torch.randn(16, 8)
    assert not cpu_gemv.takes(torch.randn(cpu_lib.GEMV_MAX_M + 1, 8), w, None)
    assert not cpu_gemv.takes(torch.randn(2, 8).double(), w.double(), None)
    assert not cpu_gemv.takes(torch.randn(2, 8).bfloat16(), w, None)            # mixed dtypes
    assert not cpu_gemv.takes(torch.randn(2, 8), w, torch.randn(16).half())
    assert not cpu_gemv.takes(torch.randn(8, 2).t(), w, None)      # not contiguous
    assert not cpu_gemv.takes(torch.randn(2, 8), w, torch.randn(15))
    assert not cpu_gemv.takes(torch.randn(0, 8), w, None)


def test_dense_linear_takes_it_for_small_batches():
    from pagoda.gpu_worker.models.parallel import _POOL, dense_linear
    assert _POOL
    g = torch.Generator().manual_seed(2)
    w = torch.randn(64, 40, generator=g)
    with torch.inference_mode():
        small = torch.randn(3, 40, generator=g)
        assert torch.equal(dense_linear(small, w), small_linear(small, w))
        big = torch.randn(cpu_lib.GEMV_MAX_M + 1, 40, generator=g)
        torch.testing.assert_close(dense_linear(big, w), F.linear(big, w), rtol=1e-5, atol=1e-5)


def test_concurrent_callers_are_serialised():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(512, 256, generator=g)
    xs = [torch.randn(1 + i % cpu_lib.GEMV_MAX_M, 256, generator=g) for i in range(4)]
    want = [F.linear(x, w) for x in xs]
    errors = []

    def hammer(i):
        for _ in range(50):
            if not torch.allclose(small_linear(xs[i], w), want[i], rtol=1e-5, atol=1e-4):
                errors.append(i)

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in threads)


SCRIPT = """
import os, sys, time
import torch
torch.set_num_threads(2)
from pagoda.kernels.cpu_gemv import small_linear
w, x = torch.randn(4096, 512), torch.randn(1, 512)
want = x @ w.t()
assert torch.allclose(small_linear(x, w), want, rtol=1e-5, atol=1e-4)   # the pool starts
{body}
"""


def run(body: str, **env) -> str:
    out = subprocess.run([sys.executable, "-c", SCRIPT.format(body=body)], capture_output=True, text=True,
                         cwd=ROOT, timeout=120, env={**os.environ, **env})
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_forked_child_gets_its_own_pool():
    # The child has none of the parent's pool threads: a call there must not wait for them.
    run("""
pid = os.fork()
if pid == 0:
    ok = torch.allclose(small_linear(x, w), want, rtol=1e-5, atol=1e-4)
    os._exit(0 if ok else 3)
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, status
""")


IDLE = """
for _ in range(20):
    small_linear(x, w)
time.sleep(0.05)      # past any spin
t = time.process_time()
time.sleep(0.5)
print(time.process_time() - t)
"""


def test_idle_pool_threads_sleep():
    assert float(run(IDLE)) < 0.05


def test_spin_after_small_steps_is_bounded():
    # With a 0.3 s budget the pool thread is still spinning during the first sleep, and asleep
    # after it: the spin keeps a small step's threads awake, never longer than asked.
    out = run("""
t = time.process_time()
time.sleep(0.2)
spun = time.process_time() - t
time.sleep(0.2)
t = time.process_time()
time.sleep(0.5)
print(spun, time.process_time() - t)
""", PAGODA_CPU_SPIN_US="300000")
    spun, idle = map(float, out.split())
    assert spun > 0.05 and idle < 0.05


def test_bad_spin_setting_named():
    out = subprocess.run([sys.executable, "-c", "from pagoda.kernels import cpu_lib; cpu_lib.load_library()"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120,
                         env={**os.environ, "PAGODA_CPU_SPIN_US": "lots"})
    assert out.returncode != 0
    assert "PAGODA_CPU_SPIN_US: must be an integer from 0 to 1000000 microseconds (got 'lots')" in out.stderr


def test_this_cpus_build_runs_vdpbf16ps_where_it_has_avx512_bf16():
    """On a CPU with AVX512-BF16 the native build holds the instruction, so the bf16 tests above
    held its results (first run on a Zen 4, 2026-12-07); elsewhere the portable bf16 path is the one tested."""
    from pagoda.gpu_worker.core.config import cpu_flags
    if not {"avx512_bf16", "avx512vl"} <= cpu_flags():
        pytest.skip("this CPU has no AVX512-BF16: the bf16 tests ran the shift-and-FMA path")
    lib = cpu_lib.load_library()
    objdump = shutil.which("objdump")
    if lib is None or objdump is None:
        pytest.skip("no built library or no objdump to read it")
    out = subprocess.run([objdump, "-d", lib._name], capture_output=True, text=True, timeout=120)
    assert "vdpbf16ps" in out.stdout


def test_avx512_bf16_path_compiles_to_vdpbf16ps(tmp_path):
    # Built for Sapphire Rapids, the bf16 GEMV must compile and use the instruction on any build
    # machine; without the target it must not.
    cc = cpu_lib.compiler()
    src = str(cpu_lib.CSRC / "gemv_cpu.c")
    probe = subprocess.run([cc, "-march=sapphirerapids", "-x", "c", "-c", "-o", os.devnull, "-"], input="",
                           capture_output=True, text=True, timeout=60)
    if probe.returncode:
        pytest.skip(f"{cc} does not target sapphirerapids here")
    for march, want in (("sapphirerapids", True), ("haswell", False)):
        out = subprocess.run([cc, "-O3", f"-march={march}", "-Wall", "-Werror", "-S", "-o", "-", src],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        assert ("vdpbf16ps" in out.stdout) == want, march
