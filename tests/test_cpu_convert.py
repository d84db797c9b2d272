"""fp32 <-> bf16 / fp16 as the CPU kernels convert (csrc/convert.h): the vector forms (the 16-bit
shift for bf16, F16C where compiled) against the portable scalar forms, and both against torch's
own conversions, over every 16-bit value and a spread of fp32 ones (ties, subnormals, overflow,
inf, NaN)."""
import pytest
import torch

from pagoda.kernels import cpu_lib
from pagoda.kernels.cpu_lib import KINDS


def to_f32(src: torch.Tensor, portable: bool) -> torch.Tensor:
    dst = torch.empty(src.numel(), dtype=torch.float32)
    assert cpu_lib.load_library().convert_to_f32(src.data_ptr(), dst.data_ptr(), src.numel(),
                                                 KINDS[src.dtype], int(portable)) == 0
    return dst


def from_f32(src: torch.Tensor, dtype: torch.dtype, portable: bool) -> torch.Tensor:
    dst = torch.empty(src.numel(), dtype=dtype)
    assert cpu_lib.load_library().convert_from_f32(src.data_ptr(), dst.data_ptr(), src.numel(),
                                                   KINDS[dtype], int(portable)) == 0
    return dst


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_16_bit_value_widens_exactly(dtype):
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    vec, port = to_f32(every, False), to_f32(every, True)
    want = every.float()
    nan = want.isnan()
    assert torch.equal(vec.isnan(), nan) and torch.equal(port.isnan(), nan)
    assert torch.equal(bits(vec[~nan]), bits(want[~nan])) and torch.equal(bits(port[~nan]), bits(want[~nan]))


def fp32_values() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    raw = torch.randint(-2**31, 2**31 - 1, (1 << 20,), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)
    # every exact tie between two bf16 / fp16 neighbours, either parity, and the edges
    halves = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    ties = torch.arange(0, 65536, dtype=torch.int32) << 16 | 0x8000
    special = torch.tensor([0.0, -0.0, 65504.0, 65519.99, 65520.0, 1e-8, 6e-8, 3e-8, 5.96e-8, 2.98e-8,
                            float("inf"), -float("inf"), float("nan"), 3.4e38, -3.4e38, 1e-40])
    return torch.cat([raw, halves, halves * 1.0004883, ties.view(torch.float32), special,
                      torch.randn(4097, generator=g) * 1000])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_narrowing_rounds_as_torch(dtype):
    x = fp32_values()
    vec, port, want = from_f32(x, dtype, False), from_f32(x, dtype, True), x.to(dtype)
    nan = x.isnan()
    assert vec[nan].isnan().all() and port[nan].isnan().all()
    assert torch.equal(bits(port[~nan]), bits(want[~nan]))       # the portable form is torch's, bit for bit
    assert torch.equal(bits(vec[~nan]), bits(port[~nan]))        # and the vector form is the portable one
    if dtype == torch.bfloat16:
        assert torch.equal(bits(vec), bits(port))                # NaN too: 0x7FC0


def test_odd_lengths_take_the_scalar_tail():
    x = torch.randn(13) * 7
    for dtype in (torch.bfloat16, torch.float16):
        assert torch.equal(from_f32(x, dtype, False), x.to(dtype))
        assert torch.equal(to_f32(x.to(dtype), False), x.to(dtype).float())
