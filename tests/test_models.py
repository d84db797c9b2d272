"""Native models through the runner match transformers' forward, over paged caches of any block size.

Every test builds SchedulerOutputs by hand (block ids chosen and scattered on purpose) and compares
logits at the sampled rows against HF's full-sequence forward in fp32.
"""
import random

import pytest
import torch
import transformers

from pagoda.gpu_worker.core.config import EngineConfig
from pagoda.gpu_worker.core.sampling_params import SamplingParams
from pagoda.gpu_worker.runner.model_runner import ModelRunner
from pagoda.gpu_worker.testing.tiny_model import FAMILIES
from tests.plugins.engine import Chunk, fresh_step

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def hf_models(tiny_model_factory):
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = transformers.AutoModelForCausalLM.from_pretrained(
                tiny_model_factory(family), dtype=torch.float32).eval()
        return cache[family]
    return get


def make_runner(path, block_size=16, num_blocks=64, **kw):
    runner = ModelRunner(EngineConfig(model=path, device="cpu", block_size=block_size, **kw))
    runner.allocate_kv_cache(num_blocks)
    return runner


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def assert_close_rel(got, want, rel=1e-4):
    err = (got - want).abs().max().item()
    assert err <= rel * want.abs().max().item(), f"max abs error {err} vs scale {want.abs().max().item()}"


def req(rid, token_ids, start, blocks, sample=True, prompt=None, output=(), params=GREEDY):
    return Chunk(rid, list(token_ids), start, list(blocks), sample, params, prompt, list(output))


def forward(runner, chunks):
    return runner.forward(fresh_step(runner, chunks))


def scattered_blocks(n, pool, seed):
    ids = list(range(pool))
    random.Random(seed).shuffle(ids)
    return ids[:n]


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_then_decode_logits_match_hf(tiny_model_factory, hf_models, family, block_size):
    path = tiny_model_factory(family)
    runner = make_runner(path, block_size, num_blocks=16)
    hf = hf_models(family)
    rng = random.Random(7)
    prompt = [rng.randrange(5, runner.vocab_size) for _ in range(37)]
    decode = 5
    blocks = scattered_blocks(-(-(len(prompt) + decode) // block_size), 16, seed=block_size)
    seq = list(prompt)
    steps = [forward(runner, [req("a", prompt, 0, blocks, prompt=prompt)])[0]]
    for _ in range(decode):
        seq.append(int(steps[-1].argmax()))
        steps.append(forward(runner, [req("a", seq[-1:], len(seq) - 1, blocks, prompt=prompt,
                                         output=seq[len(prompt):])])[0])
    want = hf_logits(hf, seq)
    for i, got in enumerate(steps):
        assert_close_rel(got, want[len(prompt) - 1 + i])


@pytest.mark.parametrize("family", FAMILIES)
def test_ragged_batch_with_chunked_prefill_over_cached_blocks(tiny_model_factory, hf_models, family):
    path = tiny_model_factory(family)
    bs = 8
    runner = make_runner(path, bs, num_blocks=32)
    hf = hf_models(family)
    rng = random.Random(3)
    shared = [rng.randrange(5, runner.vocab_size) for _ in range(16)]
    a = shared + [rng.randrange(5, runner.vocab_size) for _ in range(13)]   # 29 tokens
    b = shared + [rng.randrange(5, runner.vocab_size) for _ in range(6)]    # 22 tokens
    c = [rng.randrange(5, runner.vocab_size) for _ in range(11)]
    a_blocks, b_blocks, c_blocks = [17, 4, 30, 9], [17, 4, 22], [2, 25]
    # Step 1: A's first chunk (no sample) next to C's whole prompt.
    out1 = forward(runner, [req("a", a[:16], 0, a_blocks, sample=False, prompt=a),
                           req("c", c, 0, c_blocks)])
    assert out1.shape[0] == 1
    assert_close_rel(out1[0], hf_logits(hf, c)[-1])
    c_next = int(out1[0].argmax())
    # Step 2: A's second chunk, B computed over A's two cached blocks, C's first decode.
    out2 = forward(runner, [req("a", a[16:], 16, a_blocks, prompt=a),
                           req("b", b[16:], 16, b_blocks, prompt=b),
                           req("c", [c_next], len(c), c_blocks, prompt=c, output=[c_next])])
    assert out2.shape[0] == 3
    assert_close_rel(out2[0], hf_logits(hf, a)[-1])
    assert_close_rel(out2[1], hf_logits(hf, b)[-1])
    assert_close_rel(out2[2], hf_logits(hf, c + [c_next])[-1])


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_ids_equal_transformers_generate(tiny_model_factory, hf_models, family):
    path = tiny_model_factory(family)
    runner = make_runner(path, 16, num_blocks=8)
    prompt = transformers.AutoTokenizer.from_pretrained(path).encode("Once upon a time the router")
    assert runner.tokenizer.encode_text("Once upon a time the router") == prompt
    x = torch.tensor([prompt])
    with torch.no_grad():
        want = hf_models(family).generate(x, attention_mask=torch.ones_like(x), max_new_tokens=20,
                                          do_sample=False, eos_token_id=None, pad_token_id=0)
    want = want[0, len(prompt):].tolist()
    blocks = [6, 1, 3]
    out = runner.execute(fresh_step(runner, [req("g", prompt, 0, blocks)])).sampled_token_ids["g"]
    got = [out]
    while len(got) < 20:
        seq = prompt + got
        step = fresh_step(runner, [req("g", [got[-1]], len(seq) - 1, blocks, prompt=prompt, output=got)])
        got.append(runner.execute(step).sampled_token_ids["g"])
    assert got == want


def test_llama3_rope_scaling_matches_hf(tiny_model_factory):
    # The pre-5.0 spelling (rope_theta + rope_scaling), which transformers 5 still reads.
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}
    path = tiny_model_factory("llama", seed=5, rope_scaling=rope, rope_theta=500000.0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert hf.config.rope_parameters["rope_type"] == "llama3"
    runner = make_runner(path, 16, num_blocks=16)
    rng = random.Random(1)
    ids = [rng.randrange(5, runner.vocab_size) for _ in range(150)]
    got = forward(runner, [req("r", ids, 0, list(range(10)))])[0]
    assert_close_rel(got, hf_logits(hf, ids)[-1])
    # The scaling matters at these lengths: the same weights without it give other logits.
    plain = make_runner(tiny_model_factory("llama", seed=5), 16, num_blocks=16)
    other = forward(plain, [req("r", ids, 0, list(range(10)))])[0]
    assert (other - got).abs().max() > 1e-2


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_tracks_transformers_in_the_same_dtype(tiny_model, dtype):
    torch_dtype = getattr(torch, dtype)
    half = make_runner(tiny_model, 16, num_blocks=8, dtype=dtype)
    assert half.kv_caches[0][0].dtype == torch_dtype
    assert half.model.embed_tokens.weight.dtype == torch_dtype
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch_dtype).eval()
    rng = random.Random(2)
    ids = [rng.randrange(5, half.vocab_size) for _ in range(40)]
    got = forward(half, [req("x", ids, 0, [0, 1, 2])])[0]
    assert got.dtype == torch.float32
    want = hf_logits(hf, ids)[-1]
    # Rounding differs (fused projections), so only a loose bound; fp32 is the exact path.
    assert (got - want).abs().max() < 0.1 * want.abs().max()


def test_runner_attributes_and_block_sizing(tiny_model):
    r = ModelRunner(EngineConfig(model=tiny_model, device="cpu", block_size=16))
    hf = transformers.AutoTokenizer.from_pretrained(tiny_model)
    assert r.vocab_size == len(hf) == r.tokenizer.vocab_size and r.max_model_len == 1024
    assert r.eos_token_ids == [hf.eos_token_id, hf.convert_tokens_to_ids("<|im_end|>")]
    assert r.num_blocks_for() == 8 * 1024 // 16
    per_block = 2 * 2 * 16 * 2 * 16 * 4      # K+V, layers, block, kv heads, head_dim, fp32
    assert r.bytes_per_block() == per_block
    r2 = ModelRunner(EngineConfig(model=tiny_model, device="cpu", kv_cache_memory=10 * per_block + 5))
    assert r2.num_blocks_for() == 10
    r3 = ModelRunner(EngineConfig(model=tiny_model, device="cpu", num_kv_blocks=7, max_model_len=100))
    assert r3.num_blocks_for() == 7 and r3.max_model_len == 100
    r3.allocate_kv_cache(7)
    assert [tuple(k.shape) for k, _ in r3.kv_caches] == [(7, 16, 2, 16)] * 2
    with pytest.raises(ValueError, match="max_model_len"):
        ModelRunner(EngineConfig(model=tiny_model, device="cpu", max_model_len=4096))


def test_backend_dispatch():
    from pagoda.gpu_worker.models.attention import select_backend
    from pagoda.kernels.cpu_attention import paged_attention_cpu
    from pagoda.kernels.cpu_ops import write_kv_cache_cpu
    from pagoda.kernels.reference import paged_attention_ref, write_kv_cache_ref
    cpu = torch.device("cpu")
    assert select_backend("torch", cpu) == (write_kv_cache_ref, paged_attention_ref)
    assert select_backend("auto", cpu) == select_backend("cpu", cpu) == (write_kv_cache_cpu, paged_attention_cpu)
    from pagoda.kernels.triton_attention import paged_attention_triton
    from pagoda.kernels.triton_cache import write_kv_cache_triton
    # On CPU tensors the Triton kernels run interpreted (kernels/launch.py), on any host.
    assert select_backend("triton", cpu) == (write_kv_cache_triton, paged_attention_triton)
    with pytest.raises(ValueError, match="attention_backend"):
        select_backend("cuda-graphs", cpu)


def test_sliding_windows_are_per_layer_and_do_not_cap_length(tiny_model_factory):
    path = tiny_model_factory("mistral", seed=1, sliding_window=256)
    r = ModelRunner(EngineConfig(model=path, device="cpu"))
    assert r.max_model_len == 1024   # the window is applied, not used as a length cap
    assert [a.sliding_window for a in r.model.attention_layers()] == [256, 256]
    # Qwen2 declares a window but uses it only with use_sliding_window, on layers from max_window_layers.
    q = ModelRunner(EngineConfig(model=tiny_model_factory("qwen2", seed=1, sliding_window=256), device="cpu"))
    assert [a.sliding_window for a in q.model.attention_layers()] == [None, None]
    q = ModelRunner(EngineConfig(model=tiny_model_factory("qwen2", seed=1, sliding_window=256, use_sliding_window=True,
                                                          max_window_layers=1), device="cpu"))
    assert [a.sliding_window for a in q.model.attention_layers()] == [None, 256]


def test_bad_checkpoints_are_named(tiny_model, tmp_path):
    import shutil
    with pytest.raises(ValueError, match="config.json"):
        ModelRunner(EngineConfig(model=str(tmp_path), device="cpu"))
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model, broken)
    from safetensors.torch import load_file, save_file
    weights = load_file(broken / "model.safetensors")
    del weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="layers.1.self_attn.qkv_proj.weight"):
        ModelRunner(EngineConfig(model=str(broken), device="cpu"))


def test_slot_mapping_and_metadata_layout(tiny_model):
    r = make_runner(tiny_model, 8, num_blocks=16)
    step = fresh_step(r, [req("a", [1, 2, 3], 6, [5, 9]), req("b", [4], 0, [3], sample=False)])
    r.batch.update(step)
    got = r.batch.prepare(step.scheduled)
    meta = got.meta
    assert got.input_ids.tolist() == [1, 2, 3, 4] and got.positions.tolist() == [6, 7, 8, 0]
    assert meta.slot_mapping.tolist() == [5 * 8 + 6, 5 * 8 + 7, 9 * 8 + 0, 3 * 8]
    assert meta.seq_lens.tolist() == [9, 1] and meta.query_start_loc.tolist() == [0, 3, 4]
    # The table is as wide as this step's longest sequence needs.
    assert meta.block_tables.tolist() == [[5, 9], [3, 0]] and got.logits_indices.tolist() == [2]
    step = fresh_step(r, [req("a", [1, 2, 3], 7, [5])])
    r.batch.update(step)
    with pytest.raises(ValueError, match="block_ids"):
        r.batch.prepare(step.scheduled)


def test_cuda_runner_matches_cpu(tiny_model_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (CPU twin: test_prefill_then_decode_logits_match_hf)")
    for family in FAMILIES:
        path = tiny_model_factory(family)
        cpu = make_runner(path, 16, num_blocks=16)
        gpu = ModelRunner(EngineConfig(model=path, device="cuda", dtype="float32", block_size=16))
        assert 0 < gpu.num_blocks_for()
        gpu.allocate_kv_cache(16)
        ids = list(range(30, 75))
        a = forward(cpu, [req("x", ids[:40], 0, [3, 7, 1]), req("y", ids, 0, [4, 8, 2, 5])])
        b = forward(gpu, [req("x", ids[:40], 0, [3, 7, 1]), req("y", ids, 0, [4, 8, 2, 5])]).cpu()
        assert_close_rel(b, a, rel=1e-3)


_TRITON_TWIN = """
import random, sys, torch
from pagoda.gpu_worker.core.config import EngineConfig
from pagoda.gpu_worker.runner.model_runner import ModelRunner
from pagoda.gpu_worker.core.sampling_params import SamplingParams
from tests.plugins.engine import Chunk, fresh_step
outs = []
for backend in ("torch", "triton"):
    r = ModelRunner(EngineConfig(model=sys.argv[1], device="cpu", block_size=8, attention_backend=backend))
    r.allocate_kv_cache(16)
    assert r.attend_fn.__name__ == "paged_attention_" + ("ref" if backend == "torch" else "triton")
    # The fused norm/rotary ops follow the attention backend (Qwen3: q/k norms stay torch, 3-D).
    want = backend if backend in ("triton", "cpu") else "torch"
    assert r.model.norm.ops == r.model.layers[0].self_attn.rotary.ops == want
    rng = random.Random(0)
    a = [rng.randrange(5, r.vocab_size) for _ in range(21)]
    b = [rng.randrange(5, r.vocab_size) for _ in range(9)]
    p = SamplingParams()
    step1 = r.forward(fresh_step(r, [Chunk("a", a[:16], 0, [3, 5, 7], False, p, a, []),
                                     Chunk("b", b, 0, [1, 2], True, p, b, [])]))
    step2 = r.forward(fresh_step(r, [Chunk("a", a[16:], 16, [3, 5, 7], True, p, a, []),
                                     Chunk("b", [4], 9, [1, 2], True, p, b, [4])]))
    outs.append(torch.cat([step1, step2]))
err, scale = (outs[0] - outs[1]).abs().max().item(), outs[0].abs().max().item()
assert err <= 1e-4 * scale, (err, scale)
print("ok", err)
"""


def test_triton_backend_matches_torch_under_interpreter(tiny_model_factory):
    """CPU twin of the CUDA path: the runner wired to the Triton kernels, run by Triton's interpreter."""
    import os
    import subprocess
    import sys
    env = dict(os.environ)
    env.pop("PAGODA_ATTENTION", None)
    res = subprocess.run([sys.executable, "-c", _TRITON_TWIN, tiny_model_factory("qwen3")], env=env,
                         capture_output=True, text=True, timeout=240)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]


def test_paged_attention_layer_passes_features_to_the_kernel():
    """Layer defaults (window, cap) and per-call keywords (scale, sinks) reach the attention
    function; a layer with none takes the plain path."""
    from pagoda.gpu_worker.models.attention import AttentionMetadata, PagedAttention
    from pagoda.kernels.reference import paged_attention_ref, random_paged_batch
    gen = torch.Generator().manual_seed(3)
    b = random_paged_batch([3, 1], [20, 9], 4, 2, 16, 8, generator=gen)
    meta = AttentionMetadata(slot_mapping=torch.full((4,), -1, dtype=torch.int64), block_tables=b["block_tables"],
                             seq_lens=b["seq_lens"], query_start_loc=b["query_start_loc"])
    kv = torch.zeros(4, 2, 16)
    sinks = torch.randn(4, generator=gen)
    plain = PagedAttention(4, 2, 16, 0.25)
    plain.bind(b["k_cache"], b["v_cache"], lambda *a, **kw: None, paged_attention_ref)
    args = (b["q"], b["k_cache"], b["v_cache"], b["block_tables"], b["seq_lens"], b["query_start_loc"])
    torch.testing.assert_close(plain(b["q"], kv, kv, meta), paged_attention_ref(*args, 0.25))
    layer = PagedAttention(4, 2, 16, 0.25, sliding_window=5, softcap=2.0)
    layer.bind(b["k_cache"], b["v_cache"], lambda *a, **kw: None, paged_attention_ref)
    expected = paged_attention_ref(*args, 0.5, sliding_window=5, softcap=2.0, sinks=sinks)
    torch.testing.assert_close(layer(b["q"], kv, kv, meta, scale=0.5, sinks=sinks), expected)
    assert not torch.allclose(expected, paged_attention_ref(*args, 0.5))


def _eos_ids(tokenizer, path):
    from types import SimpleNamespace

    from pagoda.gpu_worker.runner.loader import load_hf_config
    runner = SimpleNamespace(tokenizer=tokenizer, model_path=path, hf_config=load_hf_config(path))
    return ModelRunner._eos_token_ids(runner)


@pytest.mark.parametrize("family", FAMILIES)
def test_eos_ids_are_those_transformers_tokenizer_gives(tiny_model_factory, family, tmp_path):
    # The runner's one tokenizer (not transformers') names EOS; generation_config's ids come
    # on top, or the model config's where there is no generation_config.
    import shutil

    from pagoda.gpu_worker.runner.model_runner import load_tokenizer
    src = tiny_model_factory(family)
    no_gen = str(tmp_path / "no_generation_config")
    shutil.copytree(src, no_gen, ignore=shutil.ignore_patterns("generation_config.json", "*.safetensors"))
    for path in (src, no_gen):
        got = _eos_ids(load_tokenizer(path), path)
        assert got and got == _eos_ids(transformers.AutoTokenizer.from_pretrained(path), path)
