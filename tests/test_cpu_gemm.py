"""The CPU GEMM for linears past the small-batch kernel (kernels/cpu_gemm.py, csrc/gemm_cpu.c):
results against F.linear over shapes with every kind of tail (rows past a register tile and a
row block, columns past a panel, k past a k block), bf16 and fp16 against fp32 on the same upcast
values, a row's result independent of its batch and of the thread count, bias, NaN, and what it
refuses."""
import pytest
import torch
import torch.nn.functional as F

from pagoda.kernels import cpu_gemm, cpu_lib
from tests.test_cpu_gemv import assert_matches_upcast


def test_library_builds():
    assert cpu_lib.available(), "the C kernels must build on the test machine (gcc/cc)"


@pytest.mark.parametrize("m", [1, 5, 6, 13, 97, 200])      # MR 6, MC 96
@pytest.mark.parametrize("n", [1, 15, 16, 17, 300])        # NR 16
@pytest.mark.parametrize("k", [1, 7, 64, 513, 1100])       # KC 512
def test_matches_f_linear(m, n, k):
    g = torch.Generator().manual_seed(m * 10007 + n * 101 + k)
    x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    packed = cpu_gemm.pack(w)
    assert cpu_gemm.takes(x, w, b)
    tol = dict(rtol=1e-5, atol=1e-5 * k ** 0.5)
    torch.testing.assert_close(cpu_gemm.linear(x, packed, n, b), F.linear(x, w, b), **tol)
    torch.testing.assert_close(cpu_gemm.linear(x, packed, n), F.linear(x, w), **tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 7, 97])                  # MR 6, MC 96
@pytest.mark.parametrize("n", [1, 17, 300])                # NR 16
@pytest.mark.parametrize("k", [7, 33, 513, 1100])          # vector width 8, KC 512
@pytest.mark.parametrize("threads", ["1", "2"])
def test_low_precision_matches_fp32_of_the_same_values(dtype, m, n, k, threads, monkeypatch):
    monkeypatch.setenv("PAGODA_CPU_KERNEL_THREADS", threads)
    g = torch.Generator().manual_seed(m * 10007 + n * 101 + k)
    x, w = torch.randn(m, k, generator=g).to(dtype), torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    packed = cpu_gemm.pack(w)
    assert packed.dtype == dtype and cpu_gemm.takes(x, w, b)
    assert_matches_upcast(cpu_gemm.linear(x, packed, n, b), x, w, b)
    assert_matches_upcast(cpu_gemm.linear(x, packed, n), x, w, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_row_is_the_same_in_any_batch_and_thread_count(monkeypatch, dtype):
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(200, 600, generator=g).to(dtype), torch.randn(200, generator=g).to(dtype)
    x = torch.randn(150, 600, generator=g).to(dtype)
    packed = cpu_gemm.pack(w)
    whole = cpu_gemm.linear(x, packed, 200, b)
    for threads in ("1", "2", "3"):
        monkeypatch.setenv("PAGODA_CPU_KERNEL_THREADS", threads)
        assert torch.equal(cpu_gemm.linear(x, packed, 200, b), whole)
        for lo, hi in ((0, 1), (7, 8), (40, 101), (149, 150)):
            assert torch.equal(cpu_gemm.linear(x[lo:hi].contiguous(), packed, 200, b), whole[lo:hi])


def test_nan_and_inf_propagate_as_in_f_linear():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(40, 32, generator=g)
    x = torch.randn(20, 32, generator=g)
    x[3, 5] = float("nan")
    x[11, 0] = float("inf")
    got, want = cpu_gemm.linear(x, cpu_gemm.pack(w), 40), F.linear(x, w)
    assert torch.equal(got.isnan(), want.isnan()) and got[3].isnan().all()
    assert torch.equal(got.isinf(), want.isinf())
    ok = ~(want.isnan() | want.isinf())
    torch.testing.assert_close(got[ok], want[ok], rtol=1e-5, atol=1e-5)


def test_what_it_does_not_take():
    w = torch.randn(16, 8)
    assert not cpu_gemm.takes(torch.randn(4, 8).double(), w.double(), None)
    assert not cpu_gemm.takes(torch.randn(8, 4).t(), w, None)          # not contiguous
    assert not cpu_gemm.takes(torch.randn(4, 8), w, torch.randn(15))   # bias of the wrong size
    assert not cpu_gemm.takes(torch.randn(0, 8), w, None)
    assert not cpu_gemm.takes(torch.randn(4, 9), w, None)
    assert not cpu_gemm.takes(torch.randn(4, 8).half(), w, None)              # mixed dtypes
    assert not cpu_gemm.takes(torch.randn(4, 8), w, torch.randn(16).bfloat16())
    with pytest.raises(ValueError, match=r"packed: not a packed \[16, 8\] torch.bfloat16 weight"):
        cpu_gemm.linear(torch.randn(4, 8).bfloat16(), cpu_gemm.pack(w), 16)
    with pytest.raises(ValueError, match=r"packed: not a packed \[16, 8\] torch.float32 weight"):
        cpu_gemm.linear(torch.randn(4, 8), cpu_gemm.pack(torch.randn(32, 8)), 16)


def test_portable_build_computes_the_same(tmp_path, monkeypatch):
    # The library built for no particular CPU (no -march=native: no AVX2, F16C or FMA on x86-64)
    # takes every conversion's portable form; its linears must agree with torch too.
    import ctypes
    flags = [f for f in cpu_lib.FLAGS if not f.startswith("-march")]
    path = tmp_path / "portable.so"
    cpu_lib.build(path, flags)
    lib = cpu_lib.bind(ctypes.CDLL(str(path)))
    monkeypatch.setattr(cpu_lib, "load_library", lambda: lib)
    monkeypatch.setattr(cpu_gemm, "load_library", lambda: lib)
    from pagoda.kernels import cpu_gemv
    monkeypatch.setattr(cpu_gemv, "load_library", lambda: lib)
    g = torch.Generator().manual_seed(4)
    for dtype in (torch.bfloat16, torch.float16):
        w, b = torch.randn(40, 75, generator=g).to(dtype), torch.randn(40, generator=g).to(dtype)
        for m in (1, 3, 8):
            x = torch.randn(m, 75, generator=g).to(dtype)
            assert_matches_upcast(cpu_gemv.small_linear(x, w, b), x, w, b)
        x = torch.randn(20, 75, generator=g).to(dtype)
        assert_matches_upcast(cpu_gemm.linear(x, cpu_gemm.pack(w), 40, b), x, w, b)
