"""The CUDA paths of quantized weights against their torch twins: the Triton int4 and fp8
dequantize-matmuls (interpreted on CPU tensors, kernels/launch.py, at tiny fp32/fp16 shapes;
compiled in bf16 on a GPU) and torch._scaled_mm's W8A8 fp8 (GPU only: its oracle is
pagoda.kernels.quant_ref.fp8_w8a8_ref).
"""
import pytest
import torch

from pagoda.gpu_worker.core.config import EngineConfig
from pagoda.gpu_worker.testing.tiny_quant import quantize_checkpoint
from pagoda.kernels.quant_ref import (
    dequantize_fp8_weight,
    fp8_linear_ref,
    fp8_w8a8_ref,
    int4_linear_ref,
    pack_int4_rows,
    quantize_fp8_per_channel,
)
from pagoda.kernels.triton_quant import fp8_matmul_triton, int4_matmul_triton, launch_config

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def int4_case(m, k, n, group, act_order, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (k, n), generator=g)
    groups = k // group
    zeros = torch.randint(0, 17, (groups, n), generator=g).to(torch.uint8)   # 16: GPTQ v1's wrapped zero
    scales = (torch.rand(groups, n, generator=g) * 0.02 + 0.001).half()
    g_idx = (torch.arange(k) // group).int()
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=g)].contiguous()
    x = torch.randn(m, k, generator=g).to(dtype)
    tensors = (x, pack_int4_rows(q), zeros, scales, g_idx)
    return [t.to(device) for t in tensors]


# (M, K, N, group, act order): ragged edges on every axis, a decode row, and act-order groups.
SHAPES = [(5, 64, 48, 32, False), (20, 96, 40, 32, True), (1, 128, 136, 128, False), (33, 64, 16, 64, True)]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
@pytest.mark.parametrize("shape", SHAPES)
def test_int4_triton_matches_the_twin_interpreted(shape, dtype, tol):
    m, k, n, group, act_order = shape
    x, qw, zeros, scales, g_idx = int4_case(m, k, n, group, act_order, dtype)
    got = int4_matmul_triton(x, qw, zeros, scales, g_idx)
    want = int4_linear_ref(x, qw, zeros, scales, g_idx, None)
    assert got.dtype == dtype and got.shape == (m, n)
    torch.testing.assert_close(got.float(), want.float(), atol=tol * want.abs().max().item(), rtol=tol)


def test_int4_triton_takes_leading_dims_and_refuses_misfits():
    x, qw, zeros, scales, g_idx = int4_case(6, 64, 32, 32, False, torch.float32)
    got = int4_matmul_triton(x.reshape(2, 3, 64), qw, zeros, scales, g_idx)
    assert got.shape == (2, 3, 32)
    torch.testing.assert_close(got.reshape(6, 32), int4_linear_ref(x, qw, zeros, scales, g_idx, None))
    assert int4_matmul_triton(x[:0], qw, zeros, scales, g_idx).shape == (0, 32)
    with pytest.raises(ValueError, match="qweight/g_idx"):
        int4_matmul_triton(x[:, :32], qw, zeros, scales, g_idx)
    assert launch_config(1, 4096)["BLOCK_M"] == 16 and launch_config(512, 4096)["BLOCK_M"] == 64


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shape", SHAPES + [(256, 4096, 4096, 128, False), (1, 4096, 14336, 128, False)])
def test_int4_triton_bf16_gpu(shape):
    m, k, n, group, act_order = shape
    x, qw, zeros, scales, g_idx = int4_case(m, k, n, group, act_order, torch.bfloat16, "cuda")
    got = int4_matmul_triton(x, qw, zeros, scales, g_idx)
    want = int4_linear_ref(x, qw, zeros, scales, g_idx, None)     # cuBLAS on the same bf16 weights
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2 * want.abs().max().item(), rtol=1e-2)


def fp8_case(m, k, n, block, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 100).clamp(-440, 440).to(torch.float8_e4m3fn)
    s = torch.rand(n, generator=g) if block is None else torch.rand(-(-n // block[0]), -(-k // block[1]), generator=g)
    x = torch.randn(m, k, generator=g).to(dtype)
    return x.to(device), w.to(device), s.to(device)


# (M, K, N, block): per channel, blocks that leave partial edges, published 128x128 blocks.
FP8_SHAPES = [(5, 64, 48, None), (20, 96, 40, (32, 32)), (1, 100, 72, (16, 64)), (33, 64, 16, (128, 128))]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
@pytest.mark.parametrize("shape", FP8_SHAPES)
def test_fp8_triton_matches_the_twin_interpreted(shape, dtype, tol):
    m, k, n, block = shape
    x, w, s = fp8_case(m, k, n, block, dtype)
    got = fp8_matmul_triton(x, w, s, block)
    want = fp8_linear_ref(x, w, s, None, block)
    assert got.dtype == dtype and got.shape == (m, n)
    torch.testing.assert_close(got.float(), want.float(), atol=tol * want.abs().max().item(), rtol=tol)
    with pytest.raises(ValueError, match="weight"):
        fp8_matmul_triton(x[:, :8], w, s, block)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shape", FP8_SHAPES + [(1, 7168, 2048, (128, 128)), (256, 4096, 4096, (128, 128))])
def test_fp8_triton_bf16_gpu(shape):
    m, k, n, block = shape
    x, w, s = fp8_case(m, k, n, block, torch.bfloat16, "cuda")
    got = fp8_matmul_triton(x, w, s, block)
    want = fp8_linear_ref(x, w, s, None, block)
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2 * want.abs().max().item(), rtol=1e-2)


def test_fp8_scaled_mm_wrapper_on_cpu():
    """torch._scaled_mm runs on a CPU too: the wrapper's scale shapes and transposes against the
    W8A8 oracle (per-token and static input scales)."""
    from pagoda.gpu_worker.features.quantization import fp8_scaled_mm
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=g) * 0.05
    x = torch.randn(2, 5, 64, generator=g).bfloat16()
    q, s = quantize_fp8_per_channel(w)
    got = fp8_scaled_mm(x, q, s)
    assert got.shape == (2, 5, 48) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), fp8_w8a8_ref(x, q, s, None).float(), atol=2e-2, rtol=2e-2)
    static = fp8_scaled_mm(x, q, s, torch.tensor([x.float().abs().max().item() / 448]))
    torch.testing.assert_close(static.float(), got.float(), atol=0.1, rtol=0.1)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m,k,n", [(1, 4096, 4096), (37, 1024, 3072), (512, 4096, 1024)])
def test_fp8_scaled_mm_gpu(m, k, n):
    from pagoda.gpu_worker.features.quantization import fp8_scaled_mm
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(n, k, device="cuda", generator=g) * 0.05
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    q, s = quantize_fp8_per_channel(w)
    got = fp8_scaled_mm(x, q, s)
    torch.testing.assert_close(got.float(), fp8_w8a8_ref(x, q, s, None).float(), atol=2e-2, rtol=2e-2)
    # Against the weight-only reference: only the activations' e4m3 rounding differs.
    weight_only = (x.float() @ dequantize_fp8_weight(q, s).t())
    err = (got.float() - weight_only).abs().max() / weight_only.abs().max()
    assert err < 0.08, err


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fmt,opts", [("gptq", {"group_size": 32}), ("awq", {"group_size": 32}),
                                      ("compressed-tensors", {"strategy": "channel"}),
                                      ("fp8", {"block": (32, 32)})])
def test_quantized_runner_on_cuda_tracks_the_cpu_twin_gpu(tiny_model_factory, tmp_path, fmt, opts):
    """fp32 on CUDA takes the Triton kernels (int4, and fp8 weight-only): the CPU twin's logits to
    1e-3. bf16 takes torch._scaled_mm for per-channel fp8 (W8A8): close in direction."""
    from pagoda.gpu_worker.core.sampling_params import SamplingParams
    from pagoda.gpu_worker.runner.model_runner import ModelRunner
    from tests.plugins.engine import Chunk, fresh_step
    qdir, _ = quantize_checkpoint(tiny_model_factory("llama"), str(tmp_path / "q"), fmt, **opts)
    logits = {}
    for device, dtype in (("cpu", "float32"), ("cuda", "float32"), ("cuda", "bfloat16")):
        r = ModelRunner(EngineConfig(model=qdir, device=device, dtype=dtype, num_kv_blocks=16, enforce_eager=True))
        r.allocate_kv_cache(16)
        p = SamplingParams(temperature=0.0)
        ids = list(range(20, 61))
        r.forward(fresh_step(r, [Chunk("a", ids[:40], 0, [1, 2, 3], False, p, ids, [])]))
        out = r.forward(fresh_step(r, [Chunk("a", ids[40:], 40, [1, 2, 3], True, p, ids, [])]))
        logits[device, dtype] = out.float().cpu()
    want = logits["cpu", "float32"]
    err = (logits["cuda", "float32"] - want).abs().max().item()
    assert err <= 1e-3 * want.abs().max().item(), (err, want.abs().max().item())
    assert torch.nn.functional.cosine_similarity(logits["cuda", "bfloat16"], want, dim=-1).min() >= 0.9


@pytest.mark.parametrize("fmt,opts", [("gptq", {"group_size": 32, "desc_act": True}), ("fp8", {"block": (32, 32)})])
def test_quantized_runner_through_the_triton_kernels_interpreted(tiny_model_factory, tmp_path, monkeypatch, fmt, opts):
    """The CPU twin of the CUDA runner test: the layers call the Triton kernels (interpreted) as
    they do on CUDA, and the logits equal the torch twin's."""
    from pagoda.gpu_worker.core.sampling_params import SamplingParams
    from pagoda.gpu_worker.features import quantization
    from pagoda.gpu_worker.runner.model_runner import ModelRunner
    from tests.plugins.engine import Chunk, fresh_step
    qdir, _ = quantize_checkpoint(tiny_model_factory("llama"), str(tmp_path / "q"), fmt, **opts)

    def run():
        r = ModelRunner(EngineConfig(model=qdir, device="cpu", num_kv_blocks=8))
        r.allocate_kv_cache(8)
        p = SamplingParams(temperature=0.0)
        ids = list(range(20, 45))
        r.forward(fresh_step(r, [Chunk("a", ids[:24], 0, [1, 2], False, p, ids, [])]))
        return r.forward(fresh_step(r, [Chunk("a", ids[24:], 24, [1, 2], True, p, ids, [])]))

    want = run()
    calls = []

    def int4(self, x):
        calls.append("int4")
        return int4_matmul_triton(x, self.qweight, self.zeros, self.scales, self.g_idx)

    def fp8(self, x):
        calls.append("fp8")
        return fp8_matmul_triton(x, self.weight, self.weight_scale, self.cfg.block)

    monkeypatch.setattr(quantization.Int4Linear, "matmul", int4)
    monkeypatch.setattr(quantization.Fp8Linear, "matmul", fp8)
    got = run()
    assert len(calls) == 2 * 4 * 2            # two steps, four linears, two layers
    torch.testing.assert_close(got, want, atol=1e-4 * want.abs().max().item(), rtol=1e-4)
