"""The batched LoRA Triton kernels (kernels/triton_lora.py) against the torch twin and the gather
oracle: on CPU under the Triton interpreter with tiny fp32 shapes; the @gpu twin in bf16 at a
Llama-8B projection's shapes."""
import numpy as np
import pytest
import torch

from pagoda.kernels.reference import lora_expand_ref, lora_gather_ref, lora_segments, lora_shrink_ref
from pagoda.kernels.triton_lora import lora_expand_triton, lora_shrink_triton

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def check(t, fan_in, fan_out, slots, rank, token_slots, dtype, device, offset=3, tol=1e-5):
    g = torch.Generator().manual_seed(t * 7 + rank)
    x = torch.randn(t, fan_in, generator=g).to(dtype=dtype, device=device)
    a = (0.1 * torch.randn(slots, rank, fan_in, generator=g)).to(dtype=dtype, device=device)
    b = (0.1 * torch.randn(slots, fan_out, rank, generator=g)).to(dtype=dtype, device=device)
    seg = lora_segments(token_slots, lambda arr: torch.from_numpy(arr).to(device))
    assert seg is not None
    y0 = torch.randn(t, offset + fan_out + 2, generator=g).to(dtype=dtype, device=device)

    h = lora_shrink_triton(x, a, seg)
    h_ref = lora_shrink_ref(x, a, seg)
    torch.testing.assert_close(h, h_ref, rtol=tol, atol=tol)
    y, y_ref = y0.clone(), y0.clone()
    lora_expand_triton(h_ref, b, seg, y, offset)
    lora_expand_ref(h_ref, b, seg, y_ref, offset)
    torch.testing.assert_close(y, y_ref, rtol=tol, atol=tol)
    # Against the gather oracle, and nothing outside the slice or the adapter rows touched.
    delta = lora_gather_ref(x, a, b, torch.from_numpy(token_slots).to(device))
    torch.testing.assert_close((y - y0)[:, offset:offset + fan_out].float(), delta, rtol=10 * tol, atol=10 * tol)
    assert torch.equal(y[:, :offset], y0[:, :offset]) and torch.equal(y[:, offset + fan_out:], y0[:, offset + fan_out:])
    assert torch.equal(y[torch.from_numpy(token_slots < 0).to(device)], y0[torch.from_numpy(token_slots < 0).to(device)])


@pytest.mark.parametrize("t,fan_in,fan_out,rank,token_slots", [
    (13, 24, 20, 5, np.array([2, -1, 0, 0, 2, 1, -1, 2, 0, 1, 1, -1, 2])),
    (3, 40, 70, 16, np.array([1, 1, 1])),                 # one adapter, rank = the block, N over one tile
    (20, 8, 6, 3, np.array([0] * 18 + [-1, 0])),          # a group longer than BLOCK_M
    (5, 16, 12, 80, np.array([1, 0, -1, 1, 1])),          # a rank (three stacked slices) over one R tile
])
def test_kernels_equal_the_torch_twin_under_the_interpreter(t, fan_in, fan_out, rank, token_slots):
    check(t, fan_in, fan_out, 3, rank, token_slots, torch.float32, "cpu")


def test_bad_shapes_name_the_argument():
    seg = lora_segments(np.array([0, 0]))
    assert seg is not None
    with pytest.raises(ValueError, match="a: expected"):
        lora_shrink_triton(torch.zeros(2, 8), torch.zeros(1, 4, 9), seg)
    with pytest.raises(ValueError, match="b: "):
        lora_expand_triton(torch.zeros(2, 4), torch.zeros(1, 8, 4), seg, torch.zeros(2, 6))


@pytest.mark.gpu
@needs_cuda
def test_kernels_bf16_gpu():
    rng = np.random.default_rng(0)
    token_slots = rng.integers(-1, 4, size=300)
    # q_proj of Llama-3-8B, rank 16, four adapters and base rows mixed: prefill-sized and decode-sized.
    check(300, 4096, 4096, 4, 16, token_slots, torch.bfloat16, "cuda", tol=2e-2)
    check(8, 4096, 1024, 4, 16, token_slots[:8], torch.bfloat16, "cuda", tol=2e-2)
