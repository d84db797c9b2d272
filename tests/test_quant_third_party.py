"""Quantized checkpoints written by the tools people quantize with, read by pagoda.

tests/test_quantization.py checks each format against pagoda's own writer (testing/tiny_quant.py),
so a misreading that the reader and the writer share would pass there. Here the checkpoints come
from elsewhere, starting from the tiny random Llama:
- compressed-tensors (the library llm-compressor saves with and vLLM loads with): its presets
  FP8_DYNAMIC (fp8 e4m3, a scale per output channel), FP8 (a scale per tensor, static input
  scale) and W4A16 / W4A16_ASYM with groups of 32 (int4 pack-quantized), each scale from its
  calculate_qparams, packed by its ModelCompressor, config.json written by its update_config;
- AutoAWQ: its own AWQ search (scales, clipping, the norms folded) calibrated on random token
  ids, written by save_quantized;
- GPTQ: neither GPTQModel nor AutoGPTQ runs with this project's pins (GPTQModel wants another
  torch or numpy, AutoGPTQ no longer imports under transformers 5), so `gptq_checkpoint` below
  transcribes AutoGPTQ's QuantLinear.pack (qlinear_cuda_old.py) loop for loop, as the format's
  reference; it shares no code with tiny_quant.
Each checkpoint loads in pagoda, every decoder linear dequantizes to exactly what the library's
own dequantization gives (compressed-tensors' decompressor; for AWQ both AutoAWQ's
dequantize_gemm and compressed-tensors' AutoAWQ converter), and pagoda's greedy tokens equal
transformers' on a plain checkpoint that holds those library-dequantized weights.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import warnings

import numpy as np
import pytest
import torch

from pagoda.gpu_worker.core.sampling_params import SamplingParams
from pagoda.gpu_worker.engine.llm import LLM
from pagoda.gpu_worker.features.quantization import Fp8Linear, Int4Linear, QuantLinear, parse_quantization
from pagoda.gpu_worker.models.parallel import Shard
from pagoda.gpu_worker.runner.loader import load_hf_config, load_model
from pagoda.kernels.quant_ref import dequantize_fp8_weight

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Our fused linears -> the HF linears they stack, in order.
LINEARS = {("self_attn", "qkv_proj"): ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
           ("self_attn", "o_proj"): ("self_attn.o_proj",),
           ("mlp", "gate_up_proj"): ("mlp.gate_proj", "mlp.up_proj"),
           ("mlp", "down_proj"): ("mlp.down_proj",)}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
GROUP = 32

# case -> (writer, pagoda's quant_method, pagoda's scheme)
CASES = {
    "ct-fp8-dynamic": ("FP8_DYNAMIC", "compressed-tensors", "fp8"),
    "ct-fp8-static": ("FP8", "compressed-tensors", "fp8"),
    "ct-w4a16": ("W4A16", "compressed-tensors", "int4"),
    "ct-w4a16-asym": ("W4A16_ASYM", "compressed-tensors", "int4"),
    "autoawq": ("awq", "awq", "int4"),
    "gptq-as-autogptq-packs": ("gptq", "gptq", "int4"),
}


def _calibration(n: int = 8, length: int = 64, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 1000) for _ in range(length)] for _ in range(n)]


def _copy_side_files(src: str, dst: str) -> None:
    os.makedirs(dst, exist_ok=True)
    for f in TOKENIZER_FILES:
        if os.path.exists(os.path.join(src, f)):
            shutil.copy(os.path.join(src, f), dst)


def _hf_model(src: str):
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()


# ---- writers ----------------------------------------------------------------------------


def ct_checkpoint(src: str, dst: str, preset: str) -> str:
    """compressed-tensors' preset on every decoder Linear (lm_head ignored), as llm-compressor's
    oneshot would save it, but with the scales from weight (and activation) min/max alone: the
    observers are llm-compressor's, calculate_qparams and everything after it compressed-tensors'."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    model = _hf_model(src)
    scheme = preset_name_to_scheme(preset, ["Linear"])
    if scheme.weights.strategy == "group":
        scheme.weights.group_size = GROUP
    acts: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    if scheme.input_activations is not None and not scheme.input_activations.dynamic:
        # Static input scales: each linear's input range over the calibration prompts.
        def watch(name):
            def hook(_mod, args):
                x = args[0].detach()
                lo, hi = acts.get(name, (x.min(), x.max()))
                acts[name] = (torch.minimum(lo, x.min()), torch.maximum(hi, x.max()))
            return hook
        handles = [m.register_forward_pre_hook(watch(n)) for n, m in model.named_modules()
                   if isinstance(m, torch.nn.Linear) and n != "lm_head"]
        with torch.no_grad():
            for ids in _calibration(4):
                model(torch.tensor([ids]))
        for h in handles:
            h.remove()
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    quantized = 0
    for name, m in model.named_modules():
        args = getattr(m, "quantization_scheme", None)
        if args is None:
            continue
        w, wa = m.weight.data, args.weights
        if wa.strategy == "channel":
            lo, hi = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
        elif wa.strategy == "group":
            g = w.reshape(w.shape[0], -1, wa.group_size)
            lo, hi = g.amin(dim=2), g.amax(dim=2)
        else:
            assert wa.strategy == "tensor"
            lo, hi = w.amin(), w.amax()
        scale, zero = calculate_qparams(lo, hi, wa)
        m.weight_scale.data.copy_(scale.reshape(m.weight_scale.shape))
        if hasattr(m, "weight_zero_point"):
            m.weight_zero_point.data.copy_(zero.reshape(m.weight_zero_point.shape))
        if name in acts:
            s, _ = calculate_qparams(*acts[name], args.input_activations)
            m.input_scale.data.copy_(s.reshape(m.input_scale.shape))
        quantized += 1
    assert quantized == 7 * model.config.num_hidden_layers
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(dst)
    compressor.update_config(dst)
    _copy_side_files(src, dst)
    return dst


def ct_reference(qdir: str) -> dict[str, torch.Tensor]:
    """compressed-tensors' own decompressor over the checkpoint's tensors (embeddings are not
    its Linears: it matches targets by name only)."""
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer
    from safetensors.torch import load_file
    deq = CompressedTensorsDequantizer(qdir, ignore=["model.embed_tokens"], dtype=torch.float32)
    return deq.process(load_file(os.path.join(qdir, "model.safetensors")))


def awq_checkpoint(src: str, dst: str) -> str:
    """AutoAWQ's quantize (zero points, groups of 32, GEMM) and save_quantized."""
    # AutoAWQ (deprecated, still working) installs its own warning filter and prints a farewell
    # notice on import: both stay inside this block.
    with warnings.catch_warnings(record=True):
        from awq import AutoAWQForCausalLM
    from transformers import AutoTokenizer
    model = AutoAWQForCausalLM.from_pretrained(src, dtype=torch.float32)
    model.quantize(AutoTokenizer.from_pretrained(src),
                   quant_config={"zero_point": True, "q_group_size": GROUP, "w_bit": 4, "version": "GEMM"},
                   calib_data=_calibration(), max_calib_samples=8, max_calib_seq_len=64)
    model.save_quantized(dst)
    _copy_side_files(src, dst)
    return dst


def awq_references(qdir: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(AutoAWQ's dequantize_gemm, compressed-tensors' AutoAWQ converter then its decompressor),
    each linear's W [N, K] in fp32, beside the checkpoint's other tensors. Both with the fp16
    scales widened first: their own arithmetic would round (q - z) * s to fp16, pagoda's is fp32."""
    from awq.utils.packing_utils import dequantize_gemm
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter
    from safetensors.torch import load_file
    tensors = load_file(os.path.join(qdir, "model.safetensors"))
    converter = AutoAWQConverter.from_pretrained(qdir)
    scheme = next(iter(converter.update_config(None).config_groups.values()))
    converted = converter.process(dict(tensors))
    awq, ct = {}, {}
    for name in tensors:
        if not name.endswith(".qweight"):
            if not name.endswith((".qzeros", ".scales")):
                awq[name] = ct[name] = tensors[name]
            continue
        base = name.removesuffix(".qweight")
        awq[base + ".weight"] = dequantize_gemm(tensors[name], tensors[base + ".qzeros"],
                                                tensors[base + ".scales"].float(), 4, GROUP).t().contiguous()
        sd = {k.removeprefix(base + "."): v for k, v in converted.items() if k.startswith(base + ".")}
        sd["weight_scale"] = sd["weight_scale"].float()
        ct[base + ".weight"] = PackedQuantizationCompressor.decompress(sd, scheme)["weight"]
    return awq, ct


def gptq_checkpoint(src: str, dst: str) -> tuple[str, dict[str, torch.Tensor]]:
    """A GPTQ checkpoint (4 bits, asymmetric, groups of 32, no act order, the original "gptq"
    format) as AutoGPTQ writes one: the scales and zero points of GPTQ's Quantizer.find_params
    (min/max, zero = round(-min / scale)), then QuantLinear.pack of auto_gptq/nn_modules/qlinear/
    qlinear_cuda_old.py transcribed: input row 8i + j of qweight in bits 4j of word i, output
    column 8c + j of qzeros in bits 4j of word c, zero points stored minus one, scales in fp16,
    g_idx = row // group_size. Returns the directory and each linear's W = (q - zero) * scale,
    from the integer codes before packing."""
    from safetensors.torch import load_file, save_file
    tensors = load_file(os.path.join(src, "model.safetensors"))
    out, ref = {}, {}
    maxq = 15
    for name, w in tensors.items():
        module = name.removesuffix(".weight")
        if not (name.startswith("model.layers.") and module.endswith("_proj")):
            out[name] = ref[name] = w
            continue
        n, k = w.shape
        g = w.float().reshape(n, k // GROUP, GROUP)
        xmin, xmax = g.amin(dim=2).clamp(max=0), g.amax(dim=2).clamp(min=0)
        scale = ((xmax - xmin) / maxq).half()                            # [N, G], as saved
        zero = torch.round(-xmin / scale.float())
        # The original format keeps zero - 1 in uint32 arithmetic: a zero point of 0 would
        # wrap to 0xFFFFFFFF and spill into its neighbours (AutoGPTQ's own limitation).
        assert int(zero.min()) >= 1
        s_rows = scale.float().repeat_interleave(GROUP, dim=1)           # [N, K]
        z_rows = zero.repeat_interleave(GROUP, dim=1)
        q = torch.clamp(torch.round(w.float() / s_rows) + z_rows, 0, maxq)
        wq = s_rows * (q - z_rows)                                      # what GPTQ hands pack()
        # pack(): intweight[idx] = round((W[:, idx] + scale_zeros[g]) / scales[g]), K x N uint32
        scales_t, zeros_t = scale.float().t().contiguous(), zero.t().contiguous()   # [G, N]
        scale_zeros = zeros_t * scales_t
        intweight = torch.cat([torch.round((wq[:, idx] + scale_zeros[idx // GROUP]) / scales_t[idx // GROUP])
                               .to(torch.int)[:, None] for idx in range(k)], dim=1)
        assert torch.equal(intweight, q.to(torch.int))
        intweight = intweight.t().contiguous().numpy().astype(np.uint32)
        qweight = np.zeros((intweight.shape[0] // 32 * 4, intweight.shape[1]), dtype=np.uint32)
        i = row = 0
        while row < qweight.shape[0]:
            for j in range(i, i + 8):
                qweight[row] |= intweight[j] << (4 * (j - i))
            i += 8
            row += 1
        zeros = (zeros_t.to(torch.int) - 1).numpy().astype(np.uint32)
        qzeros = np.zeros((zeros.shape[0], zeros.shape[1] // 32 * 4), dtype=np.uint32)
        i = col = 0
        while col < qzeros.shape[1]:
            for j in range(i, i + 8):
                qzeros[:, col] |= zeros[:, j] << (4 * (j - i))
            i += 8
            col += 1
        out[module + ".qweight"] = torch.from_numpy(qweight.astype(np.int32))
        out[module + ".qzeros"] = torch.from_numpy(qzeros.astype(np.int32))
        out[module + ".scales"] = scales_t.half()
        out[module + ".g_idx"] = torch.arange(k, dtype=torch.int32) // GROUP
        ref[name] = wq.contiguous()
    _copy_side_files(src, dst)
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    # AutoGPTQ's BaseQuantizeConfig.to_dict(), as transformers' GPTQConfig carries it.
    cfg["quantization_config"] = {"bits": 4, "group_size": GROUP, "damp_percent": 0.01, "desc_act": False,
                                  "static_groups": False, "sym": False, "true_sequential": True,
                                  "model_name_or_path": None, "model_file_base_name": None,
                                  "quant_method": "gptq", "checkpoint_format": "gptq"}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return dst, ref


def plain_checkpoint(qdir: str, tensors: dict[str, torch.Tensor], dst: str) -> str:
    """`qdir` without its quantization: its config less quantization_config, `tensors` in fp32."""
    from safetensors.torch import save_file
    _copy_side_files(qdir, dst)
    save_file({k: v.float().contiguous() for k, v in tensors.items()}, os.path.join(dst, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(qdir, "config.json")) as f:
        cfg = json.load(f)
    cfg.pop("quantization_config", None)
    cfg["torch_dtype"] = cfg["dtype"] = "float32"
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return dst


# ---- fixtures ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def source(tiny_model_factory):
    # Four KV heads: AutoAWQ's clipping search takes output channels 64 at a time, and k/v of
    # the default tiny Llama (2 heads of 16) have 32.
    return tiny_model_factory("llama", num_key_value_heads=4)


@pytest.fixture(scope="module")
def written(source, tmp_path_factory):
    """case -> (quantized dir, {name: the library's dequantized tensor}, second reference or None)."""
    cache: dict = {}

    def get(case):
        if case not in cache:
            writer = CASES[case][0]
            dst = str(tmp_path_factory.mktemp(case) / "q")
            if writer == "awq":
                qdir = awq_checkpoint(source, dst)
                ref, ref2 = awq_references(qdir)
            elif writer == "gptq":
                qdir, ref = gptq_checkpoint(source, dst)
                ref2 = None
            else:
                qdir = ct_checkpoint(source, dst, writer)
                ref, ref2 = ct_reference(qdir), None
            cache[case] = (qdir, ref, ref2)
        return cache[case]
    return get


def pagoda_weights(qdir: str):
    """pagoda's loaded model and {HF linear name: its dequantized W [N, K] fp32}."""
    cfg = load_hf_config(qdir)
    model = load_model(qdir, cfg, torch.device("cpu"), torch.float32, Shard(0, 1), quant=parse_quantization(None, cfg))
    weights = {}
    for i, layer in enumerate(model.layers):
        for (parent, leaf), theirs in LINEARS.items():
            m = getattr(getattr(layer, parent), leaf)
            assert isinstance(m, QuantLinear), f"layer {i} {parent}.{leaf} is not quantized"
            w = m.dequantized() if isinstance(m, Int4Linear) else \
                dequantize_fp8_weight(m.weight, m.weight_scale, m.cfg.block)
            for name, part in zip(theirs, w.split(list(m.parts))):
                weights[f"model.layers.{i}.{name}.weight"] = part
    return model, weights


# ---- tests ------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_dequantized_weights_equal_the_librarys(written, source, case):
    from safetensors.torch import load_file
    qdir, ref, ref2 = written(case)
    _, method, scheme = CASES[case]
    cfg = parse_quantization(None, load_hf_config(qdir))
    assert cfg is not None and (cfg.method, cfg.scheme) == (method, scheme)
    model, got = pagoda_weights(qdir)
    kinds = {type(m) for m in model.modules() if isinstance(m, QuantLinear)}
    assert kinds == {Fp8Linear if scheme == "fp8" else Int4Linear}
    original = load_file(os.path.join(source, "model.safetensors"))
    assert len(got) == 7 * len(model.layers)
    for name, w in got.items():
        assert torch.equal(w, ref[name]), f"{name}: max difference {(w - ref[name]).abs().max().item()}"
        if ref2 is not None:
            assert torch.equal(w, ref2[name]), f"{name}: the second reference differs"
        # The library quantized (not a copy of the float weights), and not wildly: AWQ also
        # scales the weights it folds into the norms, so it is held to the quantized range only.
        assert not torch.equal(w, original[name])
        if case != "autoawq":
            err = (w - original[name]).abs().max().item()
            assert err <= (0.07 if scheme == "fp8" else 0.15) * original[name].abs().max().item(), name


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_equal_transformers_on_the_librarys_weights(written, tmp_path, case):
    qdir, ref, _ = written(case)
    plain = plain_checkpoint(qdir, ref, str(tmp_path / "plain"))
    model = _hf_model(plain)
    rng = random.Random(7)
    prompts = [[rng.randrange(5, 1000) for _ in range(n)] for n in (5, 17, 40)]
    want = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
            want.append(out[0, len(p):].tolist())
    got = LLM(qdir, device="cpu", num_kv_blocks=32).generate(prompts, SamplingParams(temperature=0.0, max_tokens=16))
    assert [o.outputs[0].token_ids for o in got] == want
    assert all(len(w) > 0 for w in want)
