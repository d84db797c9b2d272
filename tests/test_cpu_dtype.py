"""--dtype auto on a CPU (config.cpu_auto_dtype): bf16 where the CPU has native bf16 arithmetic
(avx512_bf16 or amx_bf16, as vLLM's CPU backend), fp32 elsewhere, with the reason logged."""
import logging

import pytest
import torch

from pagoda.gpu_worker.core import config
from pagoda.gpu_worker.core.config import cpu_auto_dtype
from pagoda.gpu_worker.runner.loader import resolve_dtype

ZEN3 = {"sse", "avx", "avx2", "fma", "f16c"}
SAPPHIRE_RAPIDS = ZEN3 | {"avx512f", "avx512bw", "avx512_bf16", "amx_bf16", "amx_tile"}


@pytest.mark.parametrize("flags,want", [(ZEN3, "float32"), (ZEN3 | {"avx512f", "avx512bw"}, "float32"),
                                        (ZEN3 | {"avx512_bf16"}, "bfloat16"), (ZEN3 | {"amx_bf16"}, "bfloat16"),
                                        (SAPPHIRE_RAPIDS, "bfloat16"), (set(), "float32")])
def test_auto_is_bf16_only_with_native_bf16(flags, want):
    dtype, why = cpu_auto_dtype(flags)
    assert dtype == want
    assert why.startswith(f"dtype auto: {want} on this CPU")
    if want == "bfloat16":
        assert all(f in why for f in ("avx512_bf16", "amx_bf16") if f in flags)


def test_the_runner_resolves_and_logs_it(monkeypatch, caplog):
    monkeypatch.setattr(config, "cpu_flags", lambda: SAPPHIRE_RAPIDS)
    with caplog.at_level(logging.INFO):
        assert resolve_dtype("auto", torch.device("cpu")) == torch.bfloat16
    assert "native bf16 arithmetic: avx512_bf16, amx_bf16" in caplog.text
    monkeypatch.setattr(config, "cpu_flags", lambda: ZEN3)
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16       # an explicit dtype stays


def test_this_machines_flags_are_read():
    flags = config.cpu_flags()
    with open("/proc/cpuinfo") as f:
        text = f.read()
    assert all(f in text for f in flags)
