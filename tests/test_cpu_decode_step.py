"""The C decode step (CpuDecodeStep in gpu_worker/models/llama.py, kernels/csrc/decode_step_cpu.c):
a step of 1 to GEMV_MAX_M rows of a plain Llama-family model in one call computes what the
modules compute, to the bit (logits and the KV cache it writes), and only the steps whose
modules would run exactly its kernels come to it."""
import logging
import random

import numpy as np
import pytest
import torch

from pagoda.gpu_worker.core.config import EngineConfig
from pagoda.gpu_worker.models import parallel
from pagoda.gpu_worker.models.llama import CpuDecodeStep
from pagoda.gpu_worker.runner.model_runner import ModelRunner
from pagoda.kernels.cpu_lib import GEMV_MAX_M, available
from tests.plugins.engine import Chunk, fresh_step

pytestmark = pytest.mark.skipif(not available(), reason="the CPU kernels' library did not build (no C compiler)")
BS = 16


@pytest.fixture(autouse=True)
def c_linears(monkeypatch):
    """Every linear of 1-8 rows on the C GEMV, as PAGODA_CPU_GEMM=c has it: the tuner picks
    F.linear for these tiny models' 64-wide linears on some machines."""
    monkeypatch.setattr(parallel, "_CPU_GEMM", "c")
    monkeypatch.setattr(parallel, "_generation", parallel._generation + 1)


def make_runner(path, dtype="float32", num_blocks=48, **kw):
    runner = ModelRunner(EngineConfig(model=path, device="cpu", dtype=dtype, block_size=BS, **kw))
    runner.allocate_kv_cache(num_blocks)
    return runner


def caches(runner):
    return [t.clone() for a in runner.model.attention_layers() for t in (a.k_cache, a.v_cache)]


def both_ways(runner, chunks):
    """The step's logits through the C step and through the modules (the same slots written
    twice): asserts they and the caches each leaves are equal; returns the logits."""
    step = runner.model.cpu_decode
    before = step.steps
    fast = runner.forward(fresh_step(runner, chunks))
    took = step.steps > before
    after_fast = caches(runner)
    runner.model.cpu_decode = None
    try:
        slow = runner.forward(fresh_step(runner, chunks))
    finally:
        runner.model.cpu_decode = step
    assert torch.equal(fast, slow)
    for a, b in zip(after_fast, caches(runner)):
        assert torch.equal(a, b)
    return fast, took


class Seqs:
    """Sequences prefilled through the modules, then decoded a token per step."""

    def __init__(self, runner, n, prompt_len, seed=0, shared=0):
        rng = random.Random(seed)
        self.runner, self.vocab = runner, runner.vocab_size
        head = [rng.randrange(5, self.vocab) for _ in range(shared)]
        self.toks = [head + [rng.randrange(5, self.vocab) for _ in range(prompt_len - shared)] for _ in range(n)]
        per = -(-(prompt_len + 64) // BS)
        shared_blocks = list(range(shared // BS))
        free = iter(range(len(shared_blocks), 10_000))
        self.blocks = [shared_blocks + [next(free) for _ in range(per - len(shared_blocks))] for _ in range(n)]
        for i in range(n):      # one prompt per step: a prefill of many rows runs the modules
            out = runner.forward(fresh_step(runner, [self.chunk(i, 0)]))
            self.toks[i].append(int(out[0].argmax()))

    def chunk(self, i, start=None):
        toks = self.toks[i]
        start = len(toks) - 1 if start is None else start
        return Chunk(f"s{i}", toks[start:], start, self.blocks[i], True, None, toks[:start] or toks, [])

    def decode(self, which):
        logits, took = both_ways(self.runner, [self.chunk(i) for i in which])
        for row, i in enumerate(which):
            self.toks[i].append(int(logits[row].argmax()))
        return took


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_decode_steps_equal_the_modules_to_the_bit(tiny_model_factory, family):
    # llama: GQA; mistral: a sliding window on every layer, shorter than the context; qwen2: q/k/v bias
    overrides = {"sliding_window": 24} if family == "mistral" else {}
    runner = make_runner(tiny_model_factory(family, **overrides))
    assert isinstance(runner.model.cpu_decode, CpuDecodeStep)
    seqs = Seqs(runner, 8, 20, seed=1)
    for which in ([0], [1, 2, 3], list(range(8)), [5], [0, 7]):
        for _ in range(3):
            assert seqs.decode(which)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_steps_equal_the_modules(tiny_model_factory, dtype):
    runner = make_runner(tiny_model_factory("llama"), dtype=dtype)
    seqs = Seqs(runner, 4, 30, seed=3)
    for which in ([0], [0, 1, 2, 3]):
        for _ in range(4):
            assert seqs.decode(which)


def test_a_short_chunk_beside_decodes_and_many_rows(tiny_model_factory):
    runner = make_runner(tiny_model_factory("llama"))
    seqs = Seqs(runner, 3, 20, seed=4)
    rng = random.Random(5)
    prompt = [rng.randrange(5, runner.vocab_size) for _ in range(5)]
    new = Chunk("new", prompt, 0, [40, 41], True, None, prompt, [])
    _, took = both_ways(runner, [new, seqs.chunk(0), seqs.chunk(1)])      # 7 rows: here
    assert took
    long = [rng.randrange(5, runner.vocab_size) for _ in range(GEMV_MAX_M + 1)]
    _, took = both_ways(runner, [Chunk("long", long, 0, [42], True, None, long, [])])
    assert not took                                                       # 9 rows: the modules


def test_cascade_attention_steps_go_to_the_modules(tiny_model_factory):
    # 8 sequences behind 64 shared keys: paged attention's plan has a gemm_attention job for them
    runner = make_runner(tiny_model_factory("llama"))
    seqs = Seqs(runner, 8, 70, seed=6, shared=64)
    assert not seqs.decode(list(range(8)))
    assert seqs.decode(list(range(4)))       # 4 query tokens: too few for a group


def choose(monkeypatch, runner, impls, only=None):
    """The tuner's choices for the runner's layer linears: `impls` per bucket for all, or for the
    linear `only` with the C GEMV (1 row) and GEMM (more) for the others (whatever earlier tests
    of this process tuned for these shapes)."""
    monkeypatch.setattr(parallel, "_CPU_GEMM", "auto")
    for layer in runner.model.layers:
        for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            if only is None or lin is not only:
                base = impls if only is None else ("gemv", "gemm", "gemm", "gemm")
                monkeypatch.setitem(parallel._choices, (*lin.weight.shape, lin.weight.dtype), base)
    if only is not None:
        monkeypatch.setitem(parallel._choices, (*only.weight.shape, only.weight.dtype), impls)
    monkeypatch.setattr(parallel, "_generation", parallel._generation + 1)


def test_the_tuners_gemm_runs_in_the_step_too(tiny_model_factory, monkeypatch):
    runner = make_runner(tiny_model_factory("qwen2"))
    seqs = Seqs(runner, 4, 20, seed=9)
    choose(monkeypatch, runner, ("gemv", "gemm", "gemm", "gemm"))
    for which in ([0], [0, 1, 2], [3]):
        assert seqs.decode(which)       # the modules' GEMM on packed weights, to the bit
    program, outside = runner.model.cpu_decode._program(1)
    assert outside is None and program.uses_gemm and not runner.model.cpu_decode._program(0)[0].uses_gemm


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_linears_c_cannot_run_run_between_c_calls(tiny_model_factory, monkeypatch, family):
    runner = make_runner(tiny_model_factory(family))
    seqs = Seqs(runner, 3, 12, seed=7)
    step = runner.model.cpu_decode
    # F.linear for the down projections at 2-8 rows: the step stops before each, the modules' F.linear runs
    # it, the step goes on; still the modules' bits
    choose(monkeypatch, runner, ("gemv", "torch", "torch", "torch"), only=runner.model.layers[1].mlp.down_proj)
    assert step._program(0)[1] is None and step._program(1)[1] is not None
    for _ in range(2):
        assert seqs.decode([0, 1]) and seqs.decode([2])
    # every linear of both buckets elsewhere (oneDNN where it takes the dtype): stops at each
    other = "onednn" if parallel.onednn_takes(torch.float32) else "torch"
    choose(monkeypatch, runner, (other, other, "gemm", "gemm"))
    program = step._program(0)[0]
    assert all(layer.external == 0b1111 for layer in program._layers)
    for which in ([0], [0, 1, 2]):
        assert seqs.decode(which)


def test_the_tuners_own_picks_for_tiny_linears(tiny_model_factory, monkeypatch):
    # no forcing: whatever this machine's tuner picks for the 64-wide linears, the step is the modules'
    monkeypatch.undo()
    runner = make_runner(tiny_model_factory("llama"), dtype="bfloat16")
    seqs = Seqs(runner, 2, 9, seed=11)
    for which in ([0], [0, 1]):
        assert seqs.decode(which)


def test_lora_and_autograd_go_to_the_modules(tiny_model_factory):
    runner = make_runner(tiny_model_factory("llama"))
    seqs = Seqs(runner, 2, 12, seed=7)
    assert seqs.decode([0, 1])
    calls = []
    runner.model.layers[0].self_attn.lora_o = lambda x, y: calls.append(x.shape)
    try:
        assert not seqs.decode([1]) and calls      # the modules, which call the hook
    finally:
        runner.model.layers[0].self_attn.lora_o = None
    assert seqs.decode([1])
    with torch.enable_grad():        # (the runner's forward is under inference_mode)
        assert runner.model.cpu_decode.forward(torch.tensor([7]), torch.tensor([12]), None,
                                               lambda *a: "the modules") == "the modules"


def test_refused_models_are_logged(tiny_model_factory, caplog, monkeypatch):
    with caplog.at_level(logging.INFO, logger="pagoda.gpu_worker.models.llama"):
        qwen3 = make_runner(tiny_model_factory("qwen3"), num_blocks=8)
    assert qwen3.model.cpu_decode is None
    assert "CPU decode step in C: off (q/k norm)" in caplog.text
    monkeypatch.setenv("PAGODA_CPU_DECODE_STEP", "off")
    assert make_runner(tiny_model_factory("llama"), num_blocks=8).model.cpu_decode is None
    monkeypatch.setenv("PAGODA_CPU_DECODE_STEP", "yes")
    with pytest.raises(ValueError, match="PAGODA_CPU_DECODE_STEP: must be one of on, off"):
        make_runner(tiny_model_factory("llama"), num_blocks=8)
    monkeypatch.delenv("PAGODA_CPU_DECODE_STEP")
    # an fp8 cache: the modules' attention reads it through the reference
    fp8 = make_runner(tiny_model_factory("llama"), num_blocks=8, kv_cache_dtype="fp8")
    assert fp8.model.cpu_decode is None or fp8.model.cpu_decode._program(0)[0] is None


def test_bad_positions_and_slots_are_named_and_harm_nothing(tiny_model_factory):
    runner = make_runner(tiny_model_factory("llama"))
    seqs = Seqs(runner, 1, 10, seed=8)
    step = runner.model.cpu_decode
    limit = runner.model.layers[0].self_attn.rotary.max_positions
    program = step._program(0)[0]
    h = torch.zeros(1, program.hidden)
    t32 = torch.zeros(1, 1, dtype=torch.int32)
    lens, starts = torch.tensor([1], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
    items = np.zeros(1, dtype=np.int64)
    kept = caches(runner)
    with pytest.raises(IndexError, match=f"positions: outside the rotary table's {limit} positions"):
        program.run(h, torch.tensor([limit]), torch.tensor([0]), t32, lens, starts, items, 1, 1)
    n_slots = program.model.n_slots
    with pytest.raises(IndexError, match=f"slot_mapping: a slot past the cache's {n_slots} slots"):
        program.run(h, torch.tensor([3]), torch.tensor([n_slots]), t32, lens, starts, items, 1, 1)
    with pytest.raises(ValueError, match="positions: want a contiguous torch.int64"):
        program.run(h, torch.tensor([3], dtype=torch.int32), torch.tensor([0]), t32, lens, starts, items, 1, 1)
    with pytest.raises(ValueError, match="h: want 1 to 8 contiguous rows"):
        program.run(torch.zeros(9, program.hidden), torch.tensor([3]), torch.tensor([0]), t32, lens, starts,
                    items, 1, 1)
    for a, b in zip(kept, caches(runner)):
        assert torch.equal(a, b)
    assert seqs.decode([0])           # and the next step goes on
