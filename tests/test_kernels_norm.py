"""Fused residual-add + RMSNorm and rotary embedding kernels against their torch references.

CPU: under the Triton interpreter (fp32, fp16); the @gpu twins add bf16. Rotary works in place
on views of a fused projection, so the test also checks that nothing around them is touched.
"""
import pytest
import torch

from pagoda.kernels.reference import add_rms_norm_ref, rotary_ref
from pagoda.kernels.triton_norm import add_rms_norm_triton, rotary_triton

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def check_add_rms_norm(dtype, hidden, with_residual, device):
    gen = torch.Generator().manual_seed(0)
    x, res = (torch.randn(5, hidden, generator=gen).to(dtype=dtype, device=device) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype=dtype, device=device)
    residual = res if with_residual else None
    out, res_out = add_rms_norm_triton(x, residual, weight, 1e-6)
    ref_out, ref_res = add_rms_norm_ref(x, residual, weight, 1e-6)
    torch.testing.assert_close(res_out, ref_res, atol=0, rtol=0)
    torch.testing.assert_close(out, ref_out, atol=TOL[dtype], rtol=TOL[dtype])


def rope_tables(max_pos, head_dim, device):
    inv = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    emb = torch.outer(torch.arange(max_pos).float(), inv).repeat(1, 2)
    return emb.cos().to(device), emb.sin().to(device)


def check_rotary(dtype, hq, hkv, head_dim, device):
    gen = torch.Generator().manual_seed(1)
    num_tokens = 6
    # q and k as views into one fused projection, as the model produces them.
    qkv = torch.randn(num_tokens, hq + 2 * hkv, head_dim, generator=gen).to(dtype=dtype, device=device)
    q, k = qkv[:, :hq], qkv[:, hq:hq + hkv]
    positions = torch.tensor([0, 1, 7, 30, 2, 63], device=device)
    cos, sin = rope_tables(64, head_dim, device)
    ref_q, ref_k = rotary_ref(positions, q, k, cos, sin)
    v_before = qkv[:, hq + hkv:].clone()
    got_q, got_k = rotary_triton(positions, q, k, cos, sin)
    assert got_q.data_ptr() == q.data_ptr()
    torch.testing.assert_close(q, ref_q, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(k, ref_k, atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(qkv[:, hq + hkv:], v_before), "rotary wrote outside q and k"


@pytest.mark.parametrize("dtype,hidden,with_residual", [
    (torch.float32, 64, True), (torch.float16, 96, True), (torch.float32, 100, False)])
def test_add_rms_norm(dtype, hidden, with_residual):
    check_add_rms_norm(dtype, hidden, with_residual, "cpu")


@pytest.mark.parametrize("dtype,hq,hkv,head_dim", [
    (torch.float32, 4, 2, 64), (torch.float16, 8, 1, 128), (torch.float32, 3, 3, 32)])
def test_rotary(dtype, hq, hkv, head_dim):
    check_rotary(dtype, hq, hkv, head_dim, "cpu")


def test_bad_shapes_name_the_argument():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="weight"):
        add_rms_norm_triton(x, None, torch.ones(7), 1e-6)
    q = torch.randn(2, 2, 8)
    cos, sin = rope_tables(4, 8, "cpu")
    with pytest.raises(ValueError, match="positions"):
        rotary_triton(torch.tensor([0]), q, q.clone(), cos, sin)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_ops_gpu(dtype):
    check_add_rms_norm(dtype, 4096, True, "cuda")
    check_add_rms_norm(dtype, 4096, False, "cuda")
    check_rotary(dtype, 32, 8, 128, "cuda")
