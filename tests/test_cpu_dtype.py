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
    monkeypatch.delenv(config.CPU_DTYPE_ENV, raising=False)
    monkeypatch.setattr(config, "cpu_flags", lambda: SAPPHIRE_RAPIDS)
    with caplog.at_level(logging.INFO):
        assert resolve_dtype("auto", torch.device("cpu")) == torch.bfloat16
    assert "native bf16 arithmetic: avx512_bf16, amx_bf16" in caplog.text
    monkeypatch.setattr(config, "cpu_flags", lambda: ZEN3)
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16       # an explicit dtype stays


def test_an_operator_names_the_dtype_auto_takes(monkeypatch, caplog):
    """$PAGODA_CPU_DTYPE: one dtype for a fleet of mixed CPUs; explicit flags (another CPU) ignore it."""
    monkeypatch.setattr(config, "cpu_flags", lambda: SAPPHIRE_RAPIDS)
    monkeypatch.setenv(config.CPU_DTYPE_ENV, "float32")
    with caplog.at_level(logging.INFO):
        assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert "float32 on this CPU (set by PAGODA_CPU_DTYPE)" in caplog.text
    assert cpu_auto_dtype(SAPPHIRE_RAPIDS)[0] == "bfloat16"
    monkeypatch.setattr(config, "cpu_flags", lambda: ZEN3)
    monkeypatch.setenv(config.CPU_DTYPE_ENV, "bfloat16")
    assert resolve_dtype("auto", torch.device("cpu")) == torch.bfloat16
    assert resolve_dtype("float32", torch.device("cpu")) == torch.float32         # an explicit dtype stays
    monkeypatch.setenv(config.CPU_DTYPE_ENV, "fp64")
    with pytest.raises(ValueError, match="PAGODA_CPU_DTYPE: must be float32, bfloat16 or float16"):
        resolve_dtype("auto", torch.device("cpu"))


def test_this_machines_flags_are_read():
    flags = config.cpu_flags()
    with open("/proc/cpuinfo") as f:
        text = f.read()
    assert all(f in text for f in flags)



@pytest.mark.usefixtures("no_block_leaks", "one_torch_thread")
def test_bf16_greedy_tokens_agree_with_transformers_bf16(tiny_model_factory, monkeypatch):
    """A peaked tiny model served in bf16 on CPU, every linear in the C GEMV (decode) or GEMM
    (prefill), picks transformers' bf16 greedy token at >= 99% of the decisive positions.

    Teacher-forced: after a different token the engine restarts from the prompt and the reference
    up to and including that position, so one near-tie does not turn the rest of a sequence into
    another text. Decisive: transformers' top-1 leads by at least 1.0 (8 bf16 steps at these
    logits, ~30); below that even transformers' own fp32 and bf16 disagree at about one position
    in ten with these random weights, so no bf16 implementation could be held to them there."""
    import random

    import transformers

    from pagoda.gpu_worker.core.sampling_params import SamplingParams
    from pagoda.gpu_worker.engine.llm import LLM
    from pagoda.gpu_worker.models import parallel
    monkeypatch.setattr(parallel, "_CPU_GEMM", "c")
    ran: list[tuple[str, torch.dtype]] = []
    real = parallel.run_linear

    def spy(impl, x, weight, bias=None):
        ran.append((impl, x.dtype))
        return real(impl, x, weight, bias)
    monkeypatch.setattr(parallel, "run_linear", spy)
    path = tiny_model_factory("llama")
    rng = random.Random(7)
    prompts = [[rng.randrange(5, 600) for _ in range(n)] for n in (3, 40, 9, 120, 1, 64, 17, 200)]
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    refs, margins = [], []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=32, do_sample=False)[0].tolist()
            top = model(torch.tensor([ids])).logits[0, len(p) - 1:-1].float().topk(2, dim=-1).values
            refs.append(ids[len(p):])
            margins.append((top[:, 0] - top[:, 1]).tolist())
    llm = LLM(path, device="cpu", dtype="bfloat16", block_size=16)
    pos, agree, decisive, restarts = [0] * len(prompts), 0, 0, 0
    todo = list(range(len(prompts)))
    while todo:
        outs = llm.generate([prompts[i] + refs[i][:pos[i]] for i in todo],
                            [SamplingParams(temperature=0.0, max_tokens=len(refs[i]) - pos[i]) for i in todo])
        for i, out in zip(todo, outs):
            for got in out.outputs[0].token_ids:
                j = pos[i]
                pos[i] += 1
                if margins[i][j] >= 1.0:
                    decisive, agree = decisive + 1, agree + (got == refs[i][j])
                if got != refs[i][j]:
                    restarts += 1
                    break
        todo = [i for i in todo if pos[i] < len(refs[i])]
    assert decisive >= 100 and agree >= 0.99 * decisive, f"{agree} of {decisive} ({restarts} restarts)"
    # The bf16 linears ran in the C kernels: the GEMV at decode, the GEMM at prefill.
    assert {"gemv", "gemm"} == {impl for impl, dtype in ran if dtype == torch.bfloat16}
