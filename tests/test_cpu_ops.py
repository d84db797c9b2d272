"""A layer's elementwise ops in C (kernels/cpu_ops.py, csrc/small_ops_cpu.c) against the torch
references they replace, at row counts one thread takes and ones split over the pool, and the
cases they hand back."""
import pytest
import torch
import torch.nn.functional as F

from pagoda.kernels import cpu_lib
from pagoda.kernels.cpu_ops import add_rms_norm_cpu, rotary_cpu, silu_mul_cpu, write_kv_cache_cpu
from pagoda.kernels.reference import add_rms_norm_ref, new_kv_cache, rotary_ref, write_kv_cache_ref


def test_library_builds():
    assert cpu_lib.available()


@pytest.mark.parametrize("rows", [1, 5, 300])
@pytest.mark.parametrize("dim", [8, 100, 512])
def test_add_rms_norm(rows, dim):
    g = torch.Generator().manual_seed(rows * 1000 + dim)
    x, res = torch.randn(rows, dim, generator=g) * 3, torch.randn(rows, dim, generator=g)
    w = torch.randn(dim, generator=g)
    for r in (res, None):
        out, h = add_rms_norm_cpu(x, r, w, 1e-6)
        want_out, want_h = add_rms_norm_ref(x, r, w, 1e-6)
        assert torch.equal(h, want_h)          # the residual sum is one exact add
        torch.testing.assert_close(out, want_out, rtol=2e-6, atol=2e-6)
    # a strided row view (a slice of a wider buffer) is read through its stride
    wide = torch.randn(rows, dim + 24, generator=g)[:, 8:8 + dim]
    torch.testing.assert_close(add_rms_norm_cpu(wide, res, w, 1e-5)[0], add_rms_norm_ref(wide, res, w, 1e-5)[0],
                               rtol=2e-6, atol=2e-6)


def tables(positions: int, dim: int):
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    emb = torch.outer(torch.arange(positions).float(), inv)
    emb = torch.cat((emb, emb), dim=-1)
    return emb.cos(), emb.sin()


@pytest.mark.parametrize("rows", [1, 3, 300])
def test_rotary_in_place_on_the_fused_projection(rows):
    g = torch.Generator().manual_seed(rows)
    hq, hk, d = 8, 2, 64
    qkv = torch.randn(rows, (hq + 2 * hk) * d, generator=g)
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q, k = q.reshape(rows, hq, d), k.reshape(rows, hk, d)
    v_before = v.clone()
    cos, sin = tables(4096, d)
    positions = torch.randint(0, 4096, (rows,), generator=g)
    want_q, want_k = rotary_ref(positions, q.clone(), k.clone(), cos, sin)
    got_q, got_k = rotary_cpu(positions, q, k, cos, sin)
    torch.testing.assert_close(got_q, want_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_k, want_k, rtol=1e-6, atol=1e-6)
    assert torch.equal(v, v_before)
    assert got_q.data_ptr() == q.data_ptr()          # in place, as the Triton twin


def test_rotary_position_outside_the_table():
    cos, sin = tables(16, 8)
    q, k = torch.randn(2, 2, 8), torch.randn(2, 1, 8)
    with pytest.raises(IndexError, match="positions"):
        rotary_cpu(torch.tensor([3, 16]), q, k, cos, sin)


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_write_kv_cache(rows):
    g = torch.Generator().manual_seed(rows)
    blocks, bs, h, d = 48, 8, 2, 16
    key, value = torch.randn(rows, h, d, generator=g), torch.randn(rows, h, d, generator=g)
    slots = torch.randperm(blocks * bs, generator=g)[:rows]
    slots[::3] = -1                                   # padding rows are not written
    caches = [(new_kv_cache(blocks, bs, h, d, torch.float32, "cpu"), new_kv_cache(blocks, bs, h, d, torch.float32, "cpu"))
              for _ in range(2)]
    write_kv_cache_cpu(key, value, *caches[0], slots)
    write_kv_cache_ref(key, value, *caches[1], slots)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


def test_write_kv_cache_slot_past_the_pool():
    kc, vc = new_kv_cache(2, 4, 1, 8, torch.float32, "cpu"), new_kv_cache(2, 4, 1, 8, torch.float32, "cpu")
    with pytest.raises(IndexError, match="slot_mapping"):
        write_kv_cache_cpu(torch.randn(1, 1, 8), torch.randn(1, 1, 8), kc, vc, torch.tensor([8]))


def test_other_dtypes_take_the_reference():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 16, generator=g).double(), torch.randn(16, generator=g).double()
    assert torch.equal(add_rms_norm_cpu(x, None, w, 1e-6)[0], add_rms_norm_ref(x, None, w, 1e-6)[0])
    # mixed dtypes (bf16 rows, an fp32 weight) too
    xb = x.bfloat16()
    assert torch.equal(add_rms_norm_cpu(xb, None, w.float(), 1e-6)[0], add_rms_norm_ref(xb, None, w.float(), 1e-6)[0])
    cos, sin = tables(8, 16)
    q, k = torch.randn(2, 2, 16, generator=g).double(), torch.randn(2, 1, 16, generator=g).double()
    pos = torch.tensor([1, 5])
    assert all(torch.equal(a, b) for a, b in zip(rotary_cpu(pos, q, k, cos, sin), rotary_ref(pos, q, k, cos, sin)))


HALVES = [torch.bfloat16, torch.float16]


def ulp(dtype):
    return 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("rows", [1, 300])
@pytest.mark.parametrize("dim", [8, 100, 512])
def test_add_rms_norm_16_bit(dtype, rows, dim):
    g = torch.Generator().manual_seed(rows + dim)
    x, res = (torch.randn(rows, dim, generator=g) * 3).to(dtype), torch.randn(rows, dim, generator=g).to(dtype)
    w = torch.randn(dim, generator=g).to(dtype)
    for r in (res, None):
        out, h = add_rms_norm_cpu(x, r, w, 1e-6)
        want_out, want_h = add_rms_norm_ref(x, r, w, 1e-6)
        assert out.dtype == h.dtype == dtype
        assert torch.equal(h, want_h)          # one add in fp32, rounded as torch rounds it
        # the reference's roundings are made too: only the sum of squares' order differs, which
        # can flip the rounding of the normalised row by an ulp, and so the output by two
        torch.testing.assert_close(out.float(), want_out.float(), rtol=4 * ulp(dtype), atol=1e-6)
        # and against the same arithmetic in fp32 on the 16-bit inputs: within two roundings
        f32 = add_rms_norm_ref(x.float(), None if r is None else r.float(), w.float(), 1e-6)[0]
        torch.testing.assert_close(out.float(), f32, rtol=3 * ulp(dtype), atol=1e-5)


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("rows", [1, 300])
def test_rotary_16_bit(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    hq, hk, d = 8, 2, 64
    qkv = torch.randn(rows, (hq + 2 * hk) * d, generator=g).to(dtype)
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q, k = q.reshape(rows, hq, d), k.reshape(rows, hk, d)
    v_before = v.clone()
    cos, sin = tables(4096, d)
    positions = torch.randint(0, 4096, (rows,), generator=g)
    want_q, want_k = rotary_ref(positions, q.float(), k.float(), cos, sin)     # fp32 math, 16-bit inputs
    got_q, got_k = rotary_cpu(positions, q, k, cos, sin)
    assert got_q.data_ptr() == q.data_ptr() and got_q.dtype == dtype
    # one rounding of the fp32 result: within an ulp of the rounded fp32 reference (the kernel's
    # fp32 x*c - y*s may be fused, which moves a value near a tie across it)
    for got, want in ((got_q, want_q), (got_k, want_k)):
        torch.testing.assert_close(got.float(), want.to(dtype).float(), rtol=2 * ulp(dtype), atol=1e-6)
    assert torch.equal(v, v_before)


@pytest.mark.parametrize("dtype", HALVES)
def test_write_kv_cache_16_bit(dtype):
    g = torch.Generator().manual_seed(9)
    blocks, bs, h, d = 48, 8, 2, 16
    key, value = torch.randn(300, h, d, generator=g).to(dtype), torch.randn(300, h, d, generator=g).to(dtype)
    slots = torch.randperm(blocks * bs, generator=g)[:300]
    slots[::3] = -1
    caches = []
    for _ in range(2):
        kc, vc = new_kv_cache(blocks, bs, h, d, dtype, "cpu"), new_kv_cache(blocks, bs, h, d, dtype, "cpu")
        kc.fill_(float("nan")), vc.fill_(float("nan"))           # unwritten slots stay NaN in both
        caches.append((kc, vc))
    write_kv_cache_cpu(key, value, *caches[0], slots)
    write_kv_cache_ref(key, value, *caches[1], slots)
    for a, b in zip(caches[0], caches[1]):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("rows", [1, 300])
@pytest.mark.parametrize("inter", [8, 1408, 13])
def test_silu_mul_16_bit(dtype, rows, inter):
    g = torch.Generator().manual_seed(rows + inter)
    gate_up = (torch.randn(rows, 2 * inter, generator=g) * 6).to(dtype)
    gate_up[0, 0], gate_up[0, 1] = -200.0, 200.0
    gate, up = gate_up.float().split(inter, dim=-1)
    got = silu_mul_cpu(gate_up)
    assert got.dtype == dtype
    # computed in fp32 and rounded once: the rounded fp32 result, give or take the tie
    torch.testing.assert_close(got.float(), (F.silu(gate) * up).to(dtype).float(), rtol=ulp(dtype), atol=1e-6)


@pytest.mark.parametrize("rows", [1, 4, 300])
@pytest.mark.parametrize("inter", [8, 1408, 13])
def test_silu_mul(rows, inter):
    g = torch.Generator().manual_seed(rows + inter)
    gate_up = torch.randn(rows, 2 * inter, generator=g) * 6        # both tails of the sigmoid
    gate_up[0, 0], gate_up[0, 1] = -200.0, 200.0
    gate, up = gate_up.split(inter, dim=-1)
    torch.testing.assert_close(silu_mul_cpu(gate_up), F.silu(gate) * up, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("threads", ["1", "2", "3"])
def test_thread_count_changes_nothing(monkeypatch, threads):
    g = torch.Generator().manual_seed(5)
    x, res, w = torch.randn(300, 512, generator=g), torch.randn(300, 512, generator=g), torch.randn(512, generator=g)
    gate_up = torch.randn(300, 2816, generator=g)
    want = add_rms_norm_cpu(x, res, w, 1e-6)[0], silu_mul_cpu(gate_up)
    monkeypatch.setenv("PAGODA_CPU_KERNEL_THREADS", threads)
    got = add_rms_norm_cpu(x, res, w, 1e-6)[0], silu_mul_cpu(gate_up)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_small_job_does_not_wake_a_sleeping_pool(monkeypatch):
    """Waking a pool thread costs up to half a millisecond on a VM, a large step's KV write or rotary
    tens of microseconds: with the pool asleep such a job runs on the caller alone, and a job big
    enough to pay for the wake-up still takes the pool."""
    import time

    from pagoda.kernels import cpu_lib
    lib = cpu_lib.load_library()
    monkeypatch.setenv("PAGODA_CPU_KERNEL_THREADS", "2")
    monkeypatch.setattr(cpu_lib, "_spin_always", cpu_lib._spin_always)
    cpu_lib.set_spin_always(False)
    try:
        g = torch.Generator().manual_seed(9)
        big = torch.randn(700, 2816, generator=g)               # ~2M floats: worth a thread
        rows, blocks, bs, h, d = 64, 48, 8, 8, 128                 # 131k floats: two threads' worth
        key, value = torch.randn(rows, h, d, generator=g), torch.randn(rows, h, d, generator=g)
        slots = torch.randperm(blocks * bs, generator=g)[:rows]
        caches = [(new_kv_cache(blocks, bs, h, d, torch.float32, "cpu"),
                   new_kv_cache(blocks, bs, h, d, torch.float32, "cpu")) for _ in range(2)]

        def asleep():       # after a job that asks for no spin, its pool thread goes to sleep
            deadline = time.monotonic() + 5
            while not lib.pool_asleep():
                assert time.monotonic() < deadline, "the pool thread never went to sleep"
                time.sleep(0.001)
        silu_mul_cpu(big)                                        # starts the pool thread
        asleep()
        before = lib.pool_wakeups()
        write_kv_cache_cpu(key, value, *caches[0], slots)        # 64 rows, past the small-step spin
        assert lib.pool_wakeups() == before
        write_kv_cache_ref(key, value, *caches[1], slots)
        assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
        asleep()
        silu_mul_cpu(big)
        assert lib.pool_wakeups() == before + 1
    finally:
        from pagoda.gpu_worker.models import parallel
        cpu_lib.set_spin_always(parallel._POOL)
