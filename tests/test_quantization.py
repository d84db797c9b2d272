"""Quantized weights (--quantization fp8, compressed-tensors fp8, GPTQ and AWQ int4) on the CPU twin.

Each format's checkpoint is written here from the tiny random model by pagoda.gpu_worker.testing.tiny_quant
(packed exactly as the format's tools pack it), beside a plain checkpoint holding the dequantized
weights. The worker's logits on the quantized checkpoint equal the plain model's (fp32: the
same numbers, so to rounding), and greedy output is identical. Bad quantization configs are
refused naming the field.
"""
import json
import os
import random
import shutil

import pytest
import torch

from pagoda.gpu_worker.core.config import EngineConfig
from pagoda.gpu_worker.core.sampling_params import SamplingParams
from pagoda.gpu_worker.engine.llm import LLM
from pagoda.gpu_worker.features.quantization import AWQ_ORDER, Fp8Linear, Int4Linear, parse_quantization, unpack_int4_cols
from pagoda.gpu_worker.runner.memory import linear_weight_bytes, module_bytes
from pagoda.gpu_worker.runner.model_runner import ModelRunner
from pagoda.gpu_worker.testing.tiny_quant import dequantize_fp8_dynamic, pack_cols, pack_rows, quantize_checkpoint
from pagoda.kernels.quant_ref import dequantize_fp8_weight, pack_int4_rows, unpack_int4_rows
from tests.plugins.engine import Chunk, fresh_step

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)

# name: (format, options, model overrides)
CASES = {
    "ct-channel": ("compressed-tensors", {"strategy": "channel"}, {}),
    "ct-tensor": ("compressed-tensors", {"strategy": "tensor"}, {}),
    "ct-static-input": ("compressed-tensors", {"strategy": "channel", "static_input": True}, {}),
    "ct-block32": ("compressed-tensors", {"strategy": "block", "block": (32, 32)}, {}),
    # 128x128 blocks, as published (DeepSeek, Qwen3-FP8), on a model with 128-wide projections.
    "ct-block128": ("compressed-tensors", {"strategy": "block", "block": (128, 128)},
                    {"hidden_size": 128, "intermediate_size": 256, "head_dim": 32, "num_key_value_heads": 4}),
    "fp8-block": ("fp8", {"block": (32, 32)}, {}),
    "gptq-g32": ("gptq", {"group_size": 32}, {}),
    "gptq-channel-asym": ("gptq", {"group_size": -1, "sym": False}, {}),
    "gptq-v2-asym": ("gptq", {"group_size": 32, "sym": False, "checkpoint_format": "gptq_v2"}, {}),
    "gptq-act-order": ("gptq", {"group_size": 32, "desc_act": True, "zero_bias": True}, {}),
    "awq-g32": ("awq", {"group_size": 32}, {}),
    "awq-g64": ("awq", {"group_size": 64}, {}),
    # compressed-tensors W4A16 (llm-compressor's int4 presets): pack-quantized.
    "ct-w4a16-g32": ("compressed-tensors-w4a16", {"group_size": 32}, {}),
    "ct-w4a16-channel": ("compressed-tensors-w4a16", {"group_size": -1}, {}),
    "ct-w4a16-asym-actorder": ("compressed-tensors-w4a16", {"group_size": 32, "sym": False, "desc_act": True}, {}),
}


@pytest.fixture(scope="module")
def checkpoints(tiny_model_factory, tmp_path_factory):
    """case -> (quantized dir, dequantized reference dir), written once per module."""
    cache: dict = {}

    def get(case):
        if case not in cache:
            fmt, opts, overrides = CASES[case]
            src = tiny_model_factory("llama", **overrides)
            cache[case] = quantize_checkpoint(src, str(tmp_path_factory.mktemp(case) / "q"), fmt, **opts)
        return cache[case]
    return get


def runner(path, **kw):
    r = ModelRunner(EngineConfig(model=path, device="cpu", block_size=16, **kw))
    r.allocate_kv_cache(8)
    return r


def step_logits(r, seq, n_prompt):
    """Logits of a prefill of seq[:n_prompt], then of one decode step per further token."""
    prompt, blocks = seq[:n_prompt], list(range(8))
    out = [r.forward(fresh_step(r, [Chunk("a", prompt, 0, blocks, True, GREEDY, prompt)]))[0]]
    for i in range(n_prompt, len(seq)):
        out.append(r.forward(fresh_step(r, [Chunk("a", [seq[i]], i, blocks, True, GREEDY, prompt,
                                                  seq[n_prompt:i + 1])]))[0])
    return out


def assert_same_logits(quantized, reference, rel=1e-6):
    rng = random.Random(3)
    prompt = [rng.randrange(5, reference.vocab_size) for _ in range(29)]
    ref = step_logits(reference, prompt, len(prompt))
    seq = prompt + [int(ref[0].argmax())]
    ref = step_logits(reference, seq + [7, 11], len(prompt))
    got = step_logits(quantized, seq + [7, 11], len(prompt))
    for g, w in zip(got, ref):
        err = (g - w).abs().max().item()
        assert err <= rel * w.abs().max().item(), f"max abs error {err} vs scale {w.abs().max().item()}"
    return got, ref


@pytest.mark.parametrize("case", list(CASES))
def test_logits_equal_the_dequantized_model(checkpoints, case):
    qdir, refdir = checkpoints(case)
    q = runner(qdir)
    assert q.quant is not None and q.quant.method == CASES[case][0].removesuffix("-w4a16")
    layers = [m for m in q.model.modules() if isinstance(m, (Fp8Linear, Int4Linear))]
    assert len(layers) == 4 * q.hf_config.num_hidden_layers      # every decoder linear is quantized
    assert_same_logits(q, runner(refdir))


@pytest.mark.parametrize("case", ["ct-channel", "ct-block32", "gptq-g32", "awq-g32", "ct-w4a16-g32"])
def test_greedy_output_equals_the_dequantized_model(checkpoints, case):
    qdir, refdir = checkpoints(case)
    prompts = [[5 + i, 40 + 3 * i, 9, 200 + i] * (1 + i) for i in range(4)]
    got = LLM(qdir, device="cpu", num_kv_blocks=32).generate(prompts, GREEDY)
    want = LLM(refdir, device="cpu", num_kv_blocks=32).generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert all(len(o.outputs[0].token_ids) > 0 for o in got)


def test_fp8_at_load_is_per_channel_e4m3(tiny_model, tmp_path):
    q = runner(tiny_model, quantization="fp8")
    assert q.quant is not None and not q.quant.prequantized
    layer = q.model.layers[0].self_attn.qkv_proj
    assert isinstance(layer, Fp8Linear) and layer.weight.dtype == torch.float8_e4m3fn
    assert layer.weight_scale.shape == (layer.out_features,)
    # Each row's largest magnitude lands on e4m3's largest value.
    assert layer.weight.float().abs().amax(dim=1).eq(448).all()
    ref = runner(dequantize_fp8_dynamic(tiny_model, str(tmp_path / "ref")))
    got, _ = assert_same_logits(q, ref)
    # Quantization is visible (the reference is not just the original model) yet bounded (the
    # tiny model's sharp attention amplifies e4m3's 2^-4 relative rounding).
    plain = runner(tiny_model)
    rng = random.Random(3)
    prompt = [rng.randrange(5, plain.vocab_size) for _ in range(29)]
    orig = step_logits(plain, prompt, len(prompt))[0]
    assert 0 < (got[0] - orig).abs().max().item() < 0.3 * orig.abs().max().item()


def test_fp8_at_load_under_tensor_parallelism_quantizes_each_ranks_slice(tiny_model, tmp_path):
    """TP=2 (gloo ranks): each rank quantizes its shard; greedy output equals TP=1 on the model
    holding those per-slice dequantized weights (row-parallel layers: one scale per row per rank)."""
    from pagoda.gpu_worker.models.parallel import Shard
    from pagoda.gpu_worker.runner.loader import load_hf_config, load_model
    from tests.test_tensor_parallel import generate
    cfg = load_hf_config(tiny_model)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        gptq = parse_quantization(None, type("C", (), {"quantization_config": {"quant_method": "gptq", "bits": 4}})())
        load_model(tiny_model, cfg, torch.device("cpu"), torch.float32, Shard(0, 2), quant=gptq)
    model = load_model(tiny_model, cfg, torch.device("cpu"), torch.float32, Shard(1, 2),
                       quant=parse_quantization("fp8", cfg))
    o_proj = model.layers[0].self_attn.o_proj
    assert isinstance(o_proj, Fp8Linear) and o_proj.reduce and o_proj.in_features == cfg.hidden_size // 2
    prompts = [[5 + i, 40 + 3 * i, 9, 200 + i] * (2 + 3 * i) for i in range(3)]
    gens = [16, 24, 12]
    ref = dequantize_fp8_dynamic(tiny_model, str(tmp_path / "ref-tp2"), tensor_parallel_size=2)
    want, _ = generate(ref, prompts, gens, 1)
    llm = LLM(tiny_model, device="cpu", num_kv_blocks=32, tensor_parallel_size=2, quantization="fp8")
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(
            prompts, [SamplingParams(temperature=0.0, max_tokens=g) for g in gens])]
    finally:
        llm.engine.runner.close()
    assert got == want


@pytest.mark.parametrize("case", ["ct-channel", "ct-block32", "gptq-g32", "awq-g32", "gptq-channel-asym",
                                  "ct-w4a16-g32"])
def test_weight_bytes_count_packed_weights_and_scales(checkpoints, case):
    qdir, refdir = checkpoints(case)
    q, ref = runner(qdir), runner(refdir)
    fmt, opts, _ = CASES[case]
    scheme = "fp8" if fmt in ("compressed-tensors", "fp8") else "int4"
    block = opts.get("block") if opts.get("strategy", "block" if fmt == "fp8" else None) == "block" else None
    plain_linears = quant_linears = 0
    for name, m in q.model.named_modules():
        if isinstance(m, (Fp8Linear, Int4Linear)):
            plain_linears += linear_weight_bytes(m.out_features, m.in_features, None, elem_size=4)
            quant_linears += linear_weight_bytes(m.out_features, m.in_features, scheme,
                                                 group_size=opts.get("group_size", 128), block=block)
    assert module_bytes(ref.model) == ref.weight_bytes
    assert q.weight_bytes == ref.weight_bytes - plain_linears + quant_linears
    assert q.weight_bytes < ref.weight_bytes


def test_int4_packings_round_trip():
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (64, 48), generator=g, dtype=torch.int32)
    assert torch.equal(unpack_int4_rows(pack_int4_rows(q)), q)
    assert torch.equal(pack_int4_rows(q), pack_rows(q))          # the writer's GPTQ packing
    assert torch.equal(unpack_int4_cols(pack_cols(q, AWQ_ORDER), AWQ_ORDER), q)
    # AWQ's interleave as AutoAWQ writes it out (awq/modules/linear/gemm.py, WQLinear_GEMM.from_linear:
    # order_map = [0, 2, 4, 6, 1, 3, 5, 7]; nibble i of a word takes column order_map[i]), and as its
    # readers undo it (awq/utils/packing_utils.py and compressed-tensors' AutoAWQ converter:
    # AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]; column c sits in nibble reverse[c]).
    order_map, reverse = [0, 2, 4, 6, 1, 3, 5, 7], [0, 4, 1, 5, 2, 6, 3, 7]
    assert [order_map[reverse[c]] for c in range(8)] == list(range(8))
    cols = [9, 1, 14, 3, 0, 7, 12, 5]                    # a row of eight columns, all values distinct
    word = 0
    for i in range(8):
        word |= cols[order_map[i]] << (4 * i)
    assert [(word >> (4 * reverse[c])) & 0xF for c in range(8)] == cols
    packed = torch.tensor([[word - 2**32 if word >= 2**31 else word]], dtype=torch.int32)
    assert unpack_int4_cols(packed, AWQ_ORDER)[0].tolist() == cols                 # what the loader reads
    assert int(pack_cols(torch.tensor([cols], dtype=torch.int32), AWQ_ORDER)[0, 0]) == int(packed[0, 0])  # the writer


def test_fp8_block_scales_cover_partial_blocks():
    w = torch.arange(5 * 7, dtype=torch.float32).reshape(5, 7).to(torch.float8_e4m3fn)
    s = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    d = dequantize_fp8_weight(w, s, (4, 4))
    assert d[0, 0] == w[0, 0].float() and d[4, 6] == w[4, 6].float() * 4 and d[3, 5] == w[3, 5].float() * 2


def _config_of(path):
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def _with_quant_config(src, dst, edit):
    shutil.copytree(src, dst)
    cfg = _config_of(dst)
    edit(cfg["quantization_config"])
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return str(dst)


@pytest.mark.parametrize("case,edit,field", [
    ("gptq-g32", lambda c: c.update(bits=8), "quantization_config.bits"),
    ("gptq-g32", lambda c: c.update(checkpoint_format="marlin"), "quantization_config.checkpoint_format"),
    ("gptq-g32", lambda c: c.update(group_size=48), "quantization_config.group_size"),
    ("gptq-g32", lambda c: c.update(group_size="big"), "quantization_config.group_size"),
    ("awq-g32", lambda c: c.update(version="gemv"), "quantization_config.version"),
    ("awq-g32", lambda c: c.update(zero_point=False), "quantization_config.zero_point"),
    ("gptq-g32", lambda c: c.update(quant_method="bitsandbytes"), "quantization_config.quant_method"),
    ("gptq-g32", lambda c: c.pop("quant_method"), "quantization_config.quant_method"),
    ("ct-channel", lambda c: c.update(format="pack-quantized"), "quantization_config.format"),
    ("ct-channel", lambda c: c["config_groups"]["group_0"]["weights"].update(strategy="group"),
     "quantization_config.config_groups.group_0.weights.strategy"),
    ("ct-channel", lambda c: c["config_groups"]["group_0"]["weights"].update(num_bits=4),
     "quantization_config.config_groups.group_0.weights.num_bits"),
    ("ct-block32", lambda c: c["config_groups"]["group_0"]["weights"].update(block_structure=[32]),
     "quantization_config.config_groups.group_0.weights.block_structure"),
    ("ct-block32", lambda c: c["config_groups"]["group_0"]["weights"].update(block_structure=[48, 32]),
     "weight_block_size / block_structure"),
    ("ct-channel", lambda c: c.update(ignore=["model.layers.0.self_attn.q_proj"]), "quantization_config.ignore"),
    ("fp8-block", lambda c: c.update(activation_scheme="sometimes"), "quantization_config.activation_scheme"),
    ("ct-w4a16-g32", lambda c: c["config_groups"]["group_0"]["weights"].update(num_bits=2),
     "quantization_config.config_groups.group_0.weights.num_bits"),
    ("ct-w4a16-g32", lambda c: c.update(format="float-quantized"), "quantization_config.format"),
    ("ct-w4a16-g32", lambda c: c["config_groups"]["group_0"].update(
        input_activations={"num_bits": 8, "type": "int", "dynamic": True}),
     "quantization_config.config_groups.group_0.input_activations"),
    ("ct-w4a16-g32", lambda c: c["config_groups"]["group_0"]["weights"].update(group_size=0),
     "quantization_config.config_groups.group_0.weights.group_size"),
])
def test_bad_quantization_configs_are_refused_naming_the_field(checkpoints, tmp_path, case, edit, field):
    path = _with_quant_config(checkpoints(case)[0], tmp_path / "bad", edit)
    with pytest.raises(ValueError) as info:
        ModelRunner(EngineConfig(model=path, device="cpu", num_kv_blocks=8))
    assert field in str(info.value)


def test_the_flag_must_agree_with_the_checkpoint(checkpoints, tiny_model):
    with pytest.raises(ValueError, match="quantization: --quantization fp8 does not match .*'gptq'"):
        ModelRunner(EngineConfig(model=checkpoints("gptq-g32")[0], device="cpu", quantization="fp8"))
    with pytest.raises(ValueError, match="quantization: awq needs a checkpoint quantized that way"):
        ModelRunner(EngineConfig(model=tiny_model, device="cpu", quantization="awq"))
    with pytest.raises(ValueError, match="quantization: must be one of"):
        EngineConfig(model=tiny_model, quantization="int3")
    # Naming the checkpoint's own method is fine.
    assert runner(checkpoints("awq-g32")[0], quantization="awq").quant.method == "awq"


def test_tensors_of_the_wrong_kind_are_named(checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file
    qdir = checkpoints("ct-channel")[0]
    bad = tmp_path / "bad"
    shutil.copytree(qdir, bad)
    weights = load_file(str(bad / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight"
    weights[name] = weights[name].float()
    save_file(weights, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match=f"{name} is torch.float32; .* says fp8"):
        ModelRunner(EngineConfig(model=str(bad), device="cpu", num_kv_blocks=8))
    weights[name] = weights[name].to(torch.float8_e4m3fn)
    up = "model.layers.1.mlp.up_proj.weight"
    weights[up] = weights[up].float()
    save_file(weights, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match="layers.1.mlp.gate_up_proj.weight differ in dtype"):
        ModelRunner(EngineConfig(model=str(bad), device="cpu", num_kv_blocks=8))
    del weights[up]
    save_file(weights, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks weights for layers.1.mlp.gate_up_proj"):
        ModelRunner(EngineConfig(model=str(bad), device="cpu", num_kv_blocks=8))


def test_quantization_needs_the_native_backend(tiny_model):
    with pytest.raises(ValueError, match="quantization: fp8 needs the native backend"):
        ModelRunner(EngineConfig(model=tiny_model, device="cpu", quantization="fp8", model_impl="transformers"))


def test_flag_in_worker_help():
    from pagoda.gpu_worker.serving.args import build_parser, engine_config_kwargs
    parser = build_parser()
    assert "--quantization" in parser.format_help()
    args = parser.parse_args(["--model", "m", "--quantization", "gptq"])
    assert engine_config_kwargs(args)["quantization"] == "gptq"
    assert parser.parse_args(["--model", "m"]).quantization is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--quantization", "int3"])


def test_start_up_log_gives_the_weights_as_held(checkpoints, caplog):
    import logging
    with caplog.at_level(logging.INFO, logger="pagoda.gpu_worker.runner.model_runner"):
        r = runner(checkpoints("gptq-g32")[0])
    line = next(m for m in caplog.messages if m.startswith("weights:"))
    assert line == f"weights: {r.weight_bytes / 2**30:.3f} GiB on cpu, gptq (int4 weights, group size 32)"


@pytest.mark.slow
def test_a_worker_serves_a_gptq_checkpoint_over_grpc(checkpoints, start_worker):
    """`python -m pagoda.gpu_worker --quantization gptq` on loopback: greedy tokens streamed over gRPC equal
    the dequantized model's offline, and the start-up line gives the quantization and weights."""
    from pagoda.clients import PagodaClient
    qdir, refdir = checkpoints("gptq-g32")
    worker = start_worker(qdir, quantization="gptq")
    ids = [5, 40, 9, 200, 7, 33, 81, 12]
    with PagodaClient(worker.address, retries=0) as client:
        got = client.complete(ids, temperature=0.0, max_tokens=12, ignore_eos=True).token_ids
    want = LLM(refdir, device="cpu", num_kv_blocks=32).generate(
        [ids], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0].outputs[0].token_ids
    assert got == want and len(got) == 12
    assert "quantization=gptq" in worker.log() and "weights=0.00" in worker.log()
