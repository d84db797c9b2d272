"""Write quantized copies of a (tiny) checkpoint in the formats people publish, for tests and bench.

quantize_checkpoint(src, dst, fmt) quantizes every decoder-layer linear of a float checkpoint
(q/k/v/o, gate/up/down) and writes `dst` as the format's tools do: the packed tensors under their
published names and dtypes, and config.json's quantization_config. It also writes `dst`-ref: the
same model with each quantized weight replaced by its dequantized value in fp32 (computed here
from the integer codes and scales, not by unpacking what was written), so that the worker's
logits on `dst` can be checked against a plain model on `dst`-ref.

Formats (each one's layout in gpu_worker/features/quantization.py's docstring):
  compressed-tensors  fp8 e4m3, strategy channel | tensor | block (block_structure), optional
                      static input_scale; scales in the scale_dtype (llm-compressor writes bf16)
  fp8                 vLLM's fp8 format with weight_block_size: fp32 weight_scale_inv per block
  gptq                int4, group_size (-1: per channel), sym or not, desc_act (a g_idx
                      permutation shared by the linears of one input), checkpoint_format gptq (zero
                      points stored minus one) or gptq_v2
  awq                 int4 GEMM, zero points, group_size
  compressed-tensors-w4a16
                      llm-compressor's pack-quantized int4 (W4A16): group_size or per channel,
                      sym or not, desc_act (actorder "group", weight_g_idx)
"""
from __future__ import annotations

import json
import os
import re
import shutil

import torch
from safetensors.torch import load_file, save_file

from pagoda.kernels.fp8 import FP8_DTYPE, FP8_MAX

_LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)\.weight")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _fp8(w: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, dequantized fp32) of w / scale (scale broadcast to w)."""
    q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, q.float() * scale


def quantize_fp8(w: torch.Tensor, strategy: str, block=(128, 128), scale_dtype=torch.bfloat16):
    """(weight e4m3 [N, K], scale tensor as published, dequantized W fp32)."""
    n, k = w.shape
    if strategy == "channel":
        s = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12).to(scale_dtype)
        q, deq = _fp8(w, s.float())
        return q, s, deq
    if strategy == "tensor":
        s = (w.abs().amax() / FP8_MAX).clamp(min=1e-12).reshape(1).to(scale_dtype)
        q, deq = _fp8(w, s.float())
        return q, s, deq
    if strategy == "block":
        bn, bk = block
        gn, gk = -(-n // bn), -(-k // bk)
        pad = torch.zeros(gn * bn, gk * bk)
        pad[:n, :k] = w
        amax = pad.reshape(gn, bn, gk, bk).abs().amax(dim=(1, 3))
        s = (amax / FP8_MAX).clamp(min=1e-12).to(scale_dtype)
        full = s.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
        q, deq = _fp8(w, full)
        return q, s, deq
    raise ValueError(f"strategy: channel, tensor or block (got {strategy!r})")


def quantize_int4(w: torch.Tensor, g_idx: torch.Tensor, groups: int, sym: bool, zmin: int = 0):
    """(codes int32 [K, N] 0..15, zeros int32 [G, N], scales fp16 [G, N], dequantized W fp32 [N, K])
    for W [N, K] grouped along the input by g_idx."""
    wt = w.t().float()                                   # [K, N]
    k, n = wt.shape
    scales = torch.empty(groups, n)
    zeros = torch.empty(groups, n, dtype=torch.int32)
    for g in range(groups):
        rows = wt[g_idx == g]
        if sym:
            s = (rows.abs().amax(dim=0) * 2 / 15).clamp(min=1e-8)
            z = torch.full((n,), 8, dtype=torch.int32)
        else:
            lo, hi = rows.amin(dim=0).clamp(max=0), rows.amax(dim=0).clamp(min=0)
            s = ((hi - lo) / 15).clamp(min=1e-8)
            z = torch.round(-lo / s.half().float()).clamp(zmin, 15).to(torch.int32)
        scales[g], zeros[g] = s, z
    scales16 = scales.half()
    s_rows, z_rows = scales16.float()[g_idx], zeros[g_idx]
    q = (torch.round(wt / s_rows) + z_rows).clamp(0, 15).to(torch.int32)
    deq = ((q - z_rows).float() * s_rows).t().contiguous()
    return q, zeros, scales16, deq


def pack_rows(q: torch.Tensor) -> torch.Tensor:
    """int [K, N] 0..15 -> int32 [K/8, N], row 8i + j in bits 4j (GPTQ's qweight)."""
    k, n = q.shape
    words = torch.zeros(k // 8, n, dtype=torch.int64)
    for j in range(8):
        words |= q[j::8].to(torch.int64) << (4 * j)
    return _int32(words)


def pack_cols(q: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """int [R, N] 0..15 -> int32 [R, N/8]; nibble i holds column order[i] of each eight (GPTQ's
    qzeros: identity; AWQ: AWQ_ORDER)."""
    r, n = q.shape
    words = torch.zeros(r, n // 8, dtype=torch.int64)
    for i, c in enumerate(order):
        words |= q[:, c::8].to(torch.int64) << (4 * i)
    return _int32(words)


def _int32(words: torch.Tensor) -> torch.Tensor:
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def quantization_config(fmt: str, **o) -> dict:
    if fmt == "compressed-tensors":
        strategy = o.get("strategy", "channel")
        weights = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False,
                   "group_size": None, "block_structure": list(o.get("block", (128, 128))) if strategy == "block" else None}
        # Dynamic activations as llm-compressor's presets write them: per token (FP8_DYNAMIC),
        # per group of 128 (FP8_BLOCK).
        acts = ({"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True, "dynamic": False}
                if o.get("static_input") else
                {"num_bits": 8, "type": "float", "strategy": "token" if strategy != "block" else "group",
                 "symmetric": True, "dynamic": True, "group_size": 128 if strategy == "block" else None})
        return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}},
                "ignore": ["lm_head"]}
    if fmt == "compressed-tensors-w4a16":
        group = o.get("group_size", 128)
        weights = {"num_bits": 4, "type": "int", "symmetric": bool(o.get("sym", True)), "dynamic": False,
                   "strategy": "channel" if group == -1 else "group", "group_size": None if group == -1 else group,
                   "actorder": "group" if o.get("desc_act") else None, "observer": "minmax"}
        return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}},
                "ignore": ["lm_head"]}
    if fmt == "fp8":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                "weight_block_size": list(o.get("block", (128, 128)))}
    if fmt == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": o.get("group_size", 128),
                "desc_act": bool(o.get("desc_act", False)), "sym": bool(o.get("sym", True)),
                "checkpoint_format": o.get("checkpoint_format", "gptq"), "damp_percent": 0.01,
                "static_groups": False, "true_sequential": True}
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": o.get("group_size", 128), "zero_point": True,
                "version": "gemm", "modules_to_not_convert": None}
    raise ValueError(f"fmt: compressed-tensors, fp8, gptq or awq (got {fmt!r})")


def quantize_checkpoint(src: str, dst: str, fmt: str, seed: int = 0, **o) -> tuple[str, str]:
    """Write `dst` (quantized, as `fmt` publishes it) and `dst`-ref (dequantized fp32); returns both."""
    ref = dst.rstrip("/") + "-ref"
    for d in (dst, ref):
        os.makedirs(d, exist_ok=True)
        for f in os.listdir(src):
            if not f.endswith(".safetensors") and f != "model.safetensors.index.json" and os.path.isfile(os.path.join(src, f)):
                shutil.copy(os.path.join(src, f), os.path.join(d, f))
    weights = {}
    for f in sorted(os.listdir(src)):
        if f.endswith(".safetensors"):
            weights.update(load_file(os.path.join(src, f)))
    gen = torch.Generator().manual_seed(seed)
    perms: dict[tuple[str, int], torch.Tensor] = {}
    out, deq_all = {}, {}
    for name, w in weights.items():
        m = _LINEAR.fullmatch(name)
        if not m:
            out[name] = w
            deq_all[name] = w
            continue
        base = name[: -len(".weight")]
        w = w.float()
        n, k = w.shape
        if fmt in ("compressed-tensors", "fp8"):
            strategy = o.get("strategy", "channel") if fmt == "compressed-tensors" else "block"
            scale_dtype = o.get("scale_dtype", torch.bfloat16) if fmt == "compressed-tensors" else torch.float32
            q, s, deq = quantize_fp8(w, strategy, o.get("block", (128, 128)), scale_dtype)
            out[base + ".weight"] = q
            out[base + (".weight_scale_inv" if fmt == "fp8" else ".weight_scale")] = s
            if o.get("static_input"):
                out[base + ".input_scale"] = torch.tensor([0.02 + 0.01 * (len(out) % 3)], dtype=scale_dtype)
        else:
            group = o.get("group_size", 128)
            groups = 1 if group == -1 else k // group
            g_idx = torch.arange(k, dtype=torch.int32) // (k if group == -1 else group)
            if o.get("desc_act"):
                # One permutation per layer input: q/k/v (and gate/up) read the same activations.
                key = (name.rsplit(".", 2)[0], m.group(2) in ("q", "k", "v") or m.group(3) in ("gate", "up"))
                if key not in perms:
                    perms[key] = torch.randperm(k, generator=gen)
                g_idx = g_idx[perms[key]].contiguous()
            sym = bool(o.get("sym", True)) if fmt != "awq" else False
            # GPTQ's original format cannot store zero point 0 (0 - 1 wraps to 15, read back as
            # 16), so zero points start at 1 there.
            v1 = fmt == "gptq" and o.get("checkpoint_format", "gptq") == "gptq"
            q, z, s, deq = quantize_int4(w, g_idx, groups, sym, zmin=1 if v1 else 0)
            if fmt == "gptq":
                stored_z = z - 1 if v1 else z
                out[base + ".qweight"] = pack_rows(q)
                out[base + ".qzeros"] = pack_cols(stored_z & 0xF)
                out[base + ".scales"] = s
                out[base + ".g_idx"] = g_idx
                if o.get("zero_bias"):
                    out[base + ".bias"] = torch.zeros(n, dtype=torch.float16)
            elif fmt == "compressed-tensors-w4a16":
                # [N, K/8] along the input, signed values + 8 (our unsigned codes with zero 8 when
                # symmetric); asymmetric zero points [N/8, G] packed along the output.
                out[base + ".weight_packed"] = pack_cols(q.t().contiguous())
                out[base + ".weight_scale"] = s.t().contiguous()
                out[base + ".weight_shape"] = torch.tensor([n, k], dtype=torch.int32)
                if not sym:
                    out[base + ".weight_zero_point"] = pack_cols(z).t().contiguous()
                if o.get("desc_act"):
                    out[base + ".weight_g_idx"] = g_idx
            else:
                out[base + ".qweight"] = pack_cols(q, AWQ_ORDER)
                out[base + ".qzeros"] = pack_cols(z, AWQ_ORDER)
                out[base + ".scales"] = s
        deq_all[name] = deq
    save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    save_file({k: v.contiguous() for k, v in deq_all.items()}, os.path.join(ref, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as fh:
        cfg = json.load(fh)
    cfg.pop("quantization_config", None)
    with open(os.path.join(ref, "config.json"), "w") as fh:
        json.dump(cfg, fh, indent=2)
    cfg["quantization_config"] = quantization_config(fmt, **o)
    with open(os.path.join(dst, "config.json"), "w") as fh:
        json.dump(cfg, fh, indent=2)
    return dst, ref


def dequantize_fp8_dynamic(src: str, dst: str, tensor_parallel_size: int = 1) -> str:
    """`dst`: `src` with each decoder-layer linear replaced by what --quantization fp8 makes of it
    (per-channel e4m3, dequantized to fp32): the reference of the dynamic fp8 path. Under tensor
    parallelism each rank quantizes its own slice: the row-parallel o_proj / down_proj rows are
    cut into tensor_parallel_size column slices, each with its own scale."""
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if not f.endswith(".safetensors") and os.path.isfile(os.path.join(src, f)):
            shutil.copy(os.path.join(src, f), os.path.join(dst, f))
    weights = {}
    for f in sorted(os.listdir(src)):
        if f.endswith(".safetensors"):
            weights.update(load_file(os.path.join(src, f)))
    for name, w in weights.items():
        if _LINEAR.fullmatch(name):
            row_parallel = name.endswith(("o_proj.weight", "down_proj.weight"))
            parts = w.float().chunk(tensor_parallel_size if row_parallel else 1, dim=1)
            weights[name] = torch.cat([quantize_fp8(p.contiguous(), "channel", scale_dtype=torch.float32)[2]
                                       for p in parts], dim=1)
    save_file(weights, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst
