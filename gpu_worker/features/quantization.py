"""Quantized linear layers: --quantization fp8 at load, and checkpoints published pre-quantized.

What a checkpoint is, vLLM's way: config.json's quantization_config.quant_method names the format,
and --quantization (when given) must agree with it. Without a quantization_config,
`--quantization fp8` quantizes a bf16/fp16/fp32 checkpoint while it loads.
- fp8 (dynamic): each linear's weight becomes e4m3 with one fp32 scale per output channel
  (its row's largest magnitude maps to 448).
- fp8 pre-quantized: compressed-tensors' float-quantized format (weights per channel, per
  tensor or in blocks such as 128x128: `weight`, `weight_scale`, optional static `input_scale`),
  and vLLM's own "fp8" format (`weight_scale_inv` for blocks, `weight_scale` per tensor).
- int4 weight-only: GPTQ (qweight int32 [K/8, N] packed along the input, qzeros [G, N/8] packed
  along the output and stored minus one in the original "gptq" format, scales [G, N], g_idx [K]),
  AWQ GEMM (qweight [K, N/8] and qzeros [G, N/8] packed along the output in AWQ's interleaved
  nibble order 0 2 4 6 1 3 5 7, scales [G, N]) and compressed-tensors' pack-quantized W4A16
  (weight_packed [N, K/8] along the input holding signed values + 8, weight_scale [N, G],
  weight_zero_point [N/8, G] along the output when asymmetric, weight_g_idx with act order).
All int4 formats are repacked at load into one layout (kernels/quant_ref.py), so one torch
twin and one Triton kernel serve them. The decoder layers' linears are quantized; embeddings,
the LM head and the norms stay in the model dtype (as vLLM does), and modules a checkpoint lists
in `ignore` stay unquantized.

Compute: on CUDA, per-channel fp8 goes through torch._scaled_mm with per-token fp8 activations
(W8A8, bf16); block-wise fp8 (and what _scaled_mm cannot take) and int4 through the Triton
dequantize-matmuls of kernels/triton_quant.py (weight-only). On CPU the weight is dequantized per
call and multiplied in the activation dtype: exact against a model built from the dequantized
weights.

Loading: the model is built on the meta device, then quantize_model swaps each quantizable
nn.Linear for a QuantLinear before the weights are read. The loader hands a QuantLinear its
checkpoint tensors (fused q/k/v and gate/up parts joined by QuantLinear.fuse), and its load
converts them; nothing is ever held at full precision beyond one tensor at a time.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from pagoda.gpu_worker.core.config import QUANTIZATION_METHODS as METHODS
from pagoda.gpu_worker.models.parallel import all_reduce, dense_linear
from pagoda.kernels.fp8 import FP8_DTYPE
from pagoda.kernels.quant_ref import (
    dequantize_fp8_weight,
    dequantize_int4_weight,
    pack_int4_rows,
    quantize_fp8_per_channel,
    quantize_fp8_per_token,
)

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)    # nibble i of an AWQ word holds column AWQ_ORDER[i] of its 8


@dataclass(frozen=True)
class QuantConfig:
    method: str                              # vLLM's name: fp8 | compressed-tensors | gptq | awq
    scheme: str                              # fp8 | int4
    prequantized: bool = True
    block: Optional[tuple[int, int]] = None  # fp8 weight-scale blocks (rows, columns)
    scale_name: str = "weight_scale"         # vLLM's fp8 format names block scales weight_scale_inv
    static_input: bool = False               # fp8: the checkpoint carries input_scale
    group_size: int = -1                     # int4: input rows per scale group; -1: one group
    packing: str = ""                        # int4: gptq | awq | compressed-tensors
    zeros_minus_one: bool = False            # GPTQ's original format stores zero points minus one
    symmetric: bool = True                   # compressed-tensors int4: no zero points stored (8)
    ignore: tuple[str, ...] = ()             # HF module names (or "re:" patterns) left unquantized

    def describe(self) -> str:
        if self.scheme == "fp8":
            how = f"blocks {self.block[0]}x{self.block[1]}" if self.block else "per channel"
            return f"{self.method} (fp8 e4m3 weights {how}{', static input scales' if self.static_input else ''}" \
                   f"{'' if self.prequantized else ', quantized at load'})"
        return f"{self.method} (int4 weights, group size {self.group_size})"


def _qc_dict(hf_config) -> Optional[dict]:
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None or isinstance(qc, dict):
        return qc
    return qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))


def parse_quantization(flag: Optional[str], hf_config) -> Optional[QuantConfig]:
    """The QuantConfig for --quantization `flag` and a checkpoint's config; ValueError naming the
    flag or the quantization_config field at fault."""
    if flag is not None and flag not in METHODS:
        raise ValueError(f"quantization: must be one of {', '.join(METHODS)} (got {flag!r})")
    qc = _qc_dict(hf_config)
    if qc is None:
        if flag is None:
            return None
        if flag != "fp8":
            raise ValueError(f"quantization: {flag} needs a checkpoint quantized that way (its config.json "
                             "has no quantization_config); only fp8 quantizes at load")
        return QuantConfig("fp8", "fp8", prequantized=False)
    method = qc.get("quant_method")
    if not isinstance(method, str):
        raise ValueError(f"quantization_config.quant_method: missing or not a string (got {method!r})")
    method = method.lower()
    if flag is not None and flag != method:
        raise ValueError(f"quantization: --quantization {flag} does not match the checkpoint's "
                         f"quantization_config.quant_method {method!r}")
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "fp8":
        return _vllm_fp8(qc)
    if method in ("gptq", "awq"):
        return _int4(method, qc)
    raise ValueError(f"quantization_config.quant_method: {method!r} is not supported "
                     f"(pagoda loads {', '.join(METHODS)})")


def _field(qc: dict, where: str, name: str, allowed, *aliases, default: Any = None):
    for key in (name, *aliases):
        if key in qc:
            value = qc[key]
            break
    else:
        value = default
    if allowed is not None and value not in allowed:
        raise ValueError(f"quantization_config.{where}{name}: {value!r} is not supported "
                         f"(pagoda takes {', '.join(repr(a) for a in allowed)})")
    return value


def _block(value, where: str) -> tuple[int, int]:
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
        raise ValueError(f"quantization_config.{where}: must be two positive integers such as [128, 128] "
                         f"(got {value!r})")
    return int(value[0]), int(value[1])


def _compressed_tensors(qc: dict) -> QuantConfig:
    fmt = _field(qc, "", "format", ("float-quantized", "naive-quantized", "pack-quantized"))
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError("quantization_config.config_groups: missing or empty")
    schemes = set()
    for gname, g in groups.items():
        where = f"config_groups.{gname}."
        if not isinstance(g, dict):
            raise ValueError(f"quantization_config.{where[:-1]}: must be an object")
        targets = g.get("targets") or []
        if "Linear" not in targets:
            raise ValueError(f"quantization_config.{where}targets: {targets!r} is not supported (pagoda "
                             "quantizes Linear layers)")
        w = g.get("weights")
        if not isinstance(w, dict):
            raise ValueError(f"quantization_config.{where}weights: missing")
        if w.get("dynamic"):
            raise ValueError(f"quantization_config.{where}weights.dynamic: must be false (weights are stored quantized)")
        kind = _field(w, where + "weights.", "type", ("float", "int"))
        if kind == "int":
            schemes.add(_ct_int4(fmt, w, g.get("input_activations"), where))
            continue
        if fmt == "pack-quantized":
            raise ValueError("quantization_config.format: 'pack-quantized' holds int4 weights, but "
                             f"{where}weights.type is 'float' (fp8 checkpoints are 'float-quantized')")
        _field(w, where + "weights.", "num_bits", (8,))
        strategy = _field(w, where + "weights.", "strategy", ("channel", "tensor", "block"))
        block = _block(w.get("block_structure"), where + "weights.block_structure") if strategy == "block" else None
        a = g.get("input_activations")
        static = False
        if a is not None:
            _field(a, where + "input_activations.", "type", ("float",))
            _field(a, where + "input_activations.", "num_bits", (8,))
            static = not a.get("dynamic", False)
            if static:
                _field(a, where + "input_activations.", "strategy", ("tensor",))
            else:
                # llm-compressor's FP8_BLOCK writes per-group (1 x 128) dynamic activations.
                _field(a, where + "input_activations.", "strategy", ("token", "tensor", "group", None))
        schemes.add(("fp8", block, static))
    if len(schemes) > 1:
        raise ValueError("quantization_config.config_groups: groups with different schemes are not supported")
    scheme = schemes.pop()
    ignore = _ignore(qc.get("ignore"))
    if scheme[0] == "int4":
        _, group, symmetric = scheme
        return QuantConfig("compressed-tensors", "int4", group_size=group, packing="compressed-tensors",
                           symmetric=symmetric, ignore=ignore)
    _, block, static = scheme
    return QuantConfig("compressed-tensors", "fp8", block=block, static_input=static, ignore=ignore)


def _ct_int4(fmt: str, w: dict, acts, where: str) -> tuple:
    """compressed-tensors W4A16 (llm-compressor's GPTQ / AWQ presets): weight_packed int32 [N, K/8]
    along the input, values offset by 8 (signed int4 stored unsigned), weight_scale [N, G],
    weight_zero_point [N/8, G] packed along the output (asymmetric only), optional weight_g_idx."""
    if fmt != "pack-quantized":
        raise ValueError(f"quantization_config.format: {fmt!r} with int weights is not supported "
                         f"(pagoda takes int4 as 'pack-quantized')")
    _field(w, where + "weights.", "num_bits", (4,))
    strategy = _field(w, where + "weights.", "strategy", ("group", "channel"))
    group = -1
    if strategy == "group":
        size = w.get("group_size")
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise ValueError(f"quantization_config.{where}weights.group_size: must be a positive integer (got {size!r})")
        group = size
    _field(w, where + "weights.", "actorder", (None, "group", "weight", "static", "dynamic"))
    if acts is not None:
        raise ValueError(f"quantization_config.{where}input_activations: int4 weights with quantized activations "
                         "are not supported (pagoda takes W4A16: input_activations null)")
    return ("int4", group, bool(w.get("symmetric", True)))


def _vllm_fp8(qc: dict) -> QuantConfig:
    scheme = _field(qc, "", "activation_scheme", ("dynamic", "static"), default="dynamic")
    block_size = qc.get("weight_block_size")
    block = _block(block_size, "weight_block_size") if block_size is not None else None
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"quantization_config.fmt: {fmt!r} is not supported (pagoda takes 'e4m3')")
    ignore = qc.get("ignored_layers", qc.get("modules_to_not_convert"))
    return QuantConfig("fp8", "fp8", block=block, static_input=scheme == "static",
                       scale_name="weight_scale_inv" if block else "weight_scale", ignore=_ignore(ignore))


def _int4(method: str, qc: dict) -> QuantConfig:
    _field(qc, "", "bits", (4,), "w_bit")
    group = _field(qc, "", "group_size", None, "q_group_size", default=-1 if method == "gptq" else 128)
    if not isinstance(group, int) or isinstance(group, bool) or not (group == -1 or group > 0):
        raise ValueError(f"quantization_config.group_size: must be -1 or a positive integer (got {group!r})")
    if method == "gptq":
        fmt = _field(qc, "", "checkpoint_format", ("gptq", "gptq_v2"), default="gptq")
        return QuantConfig("gptq", "int4", group_size=group, packing="gptq", zeros_minus_one=fmt == "gptq",
                           ignore=_ignore(qc.get("modules_to_not_convert")))
    version = str(_field(qc, "", "version", None, default="gemm")).lower()
    if version != "gemm":
        raise ValueError(f"quantization_config.version: {version!r} is not supported (pagoda takes 'gemm')")
    _field(qc, "", "zero_point", (True,), default=True)
    return QuantConfig("awq", "int4", group_size=group, packing="awq",
                       ignore=_ignore(qc.get("modules_to_not_convert")))


def _ignore(value) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"quantization_config.ignore: must be a list of module names (got {value!r})")
    return tuple(value)


def _ignored(hf_name: str, patterns: tuple[str, ...]) -> bool:
    for p in patterns:
        if p.startswith("re:"):
            if re.fullmatch(p[3:], hf_name):
                return True
        elif hf_name == p or hf_name.endswith("." + p) or ("." not in p and p in hf_name.split(".")):
            return True
    return False


# ---- layers ------------------------------------------------------------------------------


class QuantLinear(nn.Module):
    """y = x @ W^T (+ bias) for a quantized W; `parts` are the output sizes of the HF linears a
    fused projection stacks (q/k/v, gate/up), `reduce` a row-parallel layer's all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool, cfg: QuantConfig,
                 parts: tuple[int, ...], reduce: bool, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features, self.cfg = in_features, out_features, cfg
        self.parts = parts
        self.reduce = reduce
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None
        self.loaded: set[str] = set()
        for leaf in self.stored:
            self.register_buffer(leaf, None)

    stored: tuple[str, ...] = ()     # the buffers load fills in

    def expected(self) -> set[str]:
        raise NotImplementedError

    def missing(self) -> list[str]:
        return sorted(self.expected() - self.loaded)

    def fuse(self, leaf: str, pieces: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(pieces, dim=0)

    def load(self, leaf: str, tensor: torch.Tensor, hf_name: str, device: torch.device) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        """After the last tensor: derive what the checkpoint may leave out."""

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x)
        if self.reduce:
            y = all_reduce(y)
        return y + self.bias if self.bias is not None else y

    def _set(self, leaf: str, tensor: torch.Tensor) -> None:
        setattr(self, leaf, tensor)
        self.loaded.add(leaf)

    def _shape(self, hf_name: str, tensor: torch.Tensor, want: tuple[int, ...]) -> None:
        if tuple(tensor.shape) != want:
            raise ValueError(f"model: checkpoint tensor {hf_name} has shape {tuple(tensor.shape)}, expected "
                             f"{want} ({self.cfg.method})")


class Fp8Linear(QuantLinear):
    """weight e4m3 [N, K]; weight_scale fp32 [N] (per channel; per-tensor scales are expanded)
    or [ceil(N / bn), ceil(K / bk)] (blocks); input_scale fp32 [1] when static."""

    weight: torch.Tensor
    weight_scale: torch.Tensor
    input_scale: Optional[torch.Tensor]
    stored = ("weight", "weight_scale", "input_scale")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        block = self.cfg.block
        if block is not None and any(p % block[0] for p in self.parts[:-1]):
            raise ValueError(f"quantization_config: weight blocks of {block[0]} rows do not divide the fused "
                             f"projection's parts {self.parts} (weight_block_size / block_structure)")

    def expected(self) -> set[str]:
        if not self.cfg.prequantized:
            return {"weight"}
        return {"weight", "weight_scale"} | ({"input_scale"} if self.cfg.static_input else set())

    def fuse(self, leaf: str, pieces: list[torch.Tensor]) -> torch.Tensor:
        if leaf == "input_scale":     # one scale for the fused input: the largest (no part clips)
            return torch.stack([p.float().reshape(()) for p in pieces]).amax().reshape(1)
        if leaf == self.cfg.scale_name and self.cfg.block is None:
            return torch.cat([p.float().reshape(-1).expand(n) if p.numel() == 1 else p.float().reshape(-1)
                              for p, n in zip(pieces, self.parts)])
        return torch.cat(pieces, dim=0)

    def load(self, leaf: str, tensor: torch.Tensor, hf_name: str, device: torch.device) -> None:
        n, k = self.out_features, self.in_features
        if leaf == "weight":
            self._shape(hf_name, tensor, (n, k))
            if not self.cfg.prequantized:
                q, s = quantize_fp8_per_channel(tensor.to(device))
                self._set("weight", q)
                self._set("weight_scale", s)
                return
            if tensor.dtype != FP8_DTYPE:
                raise ValueError(f"model: checkpoint tensor {hf_name} is {tensor.dtype}; quantization_config "
                                 f"({self.cfg.method}) says fp8 weights ({FP8_DTYPE})")
            self._set("weight", tensor.to(device))
        elif leaf == self.cfg.scale_name and self.cfg.prequantized:
            s = tensor.to(device=device, dtype=torch.float32)
            if self.cfg.block is None:
                s = s.reshape(-1)
                if s.numel() == 1:
                    s = s.expand(n).contiguous()
                self._shape(hf_name, s, (n,))
            else:
                bn, bk = self.cfg.block
                self._shape(hf_name, s, (-(-n // bn), -(-k // bk)))
            self._set("weight_scale", s)
        elif leaf == "input_scale" and self.cfg.static_input:
            self._set("input_scale", tensor.to(device=device, dtype=torch.float32).reshape(1))
        else:
            raise ValueError(f"model: checkpoint tensor {hf_name} has no place in a {self.cfg.method} layer")

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            if self.cfg.block is None and _scaled_mm_ok(x, self.out_features, self.in_features):
                return fp8_scaled_mm(x, self.weight, self.weight_scale, self.input_scale)
            from pagoda.kernels.triton_quant import fp8_matmul_triton  # lazy: triton, only on CUDA
            return fp8_matmul_triton(x, self.weight, self.weight_scale, self.cfg.block)
        # The model's own GEMM on the dequantized weight, so logits equal the dequantized model's.
        return dense_linear(x, dequantize_fp8_weight(self.weight, self.weight_scale, self.cfg.block, x.dtype))


def _scaled_mm_ok(x: torch.Tensor, n: int, k: int) -> bool:
    # Row-wise scaled fp8 GEMM: bf16 output, both matrix dims multiples of 16 (cuBLASLt).
    return x.dtype == torch.bfloat16 and n % 16 == 0 and k % 16 == 0


def fp8_scaled_mm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                  input_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """torch._scaled_mm with per-token activation scales (or the checkpoint's static one) and
    per-channel weight scales; fp32 accumulation, output in x's dtype."""
    x2 = x.reshape(-1, x.shape[-1])
    if input_scale is None:
        xq, xs = quantize_fp8_per_token(x2)
    else:
        xs = input_scale.reshape(1, 1).expand(x2.shape[0], 1).contiguous()
        xq = (x2.float() / xs).clamp(-448.0, 448.0).to(FP8_DTYPE)
    out = torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=weight_scale.reshape(1, -1),
                           out_dtype=x.dtype)
    return out.reshape(*x.shape[:-1], weight.shape[0])


class Int4Linear(QuantLinear):
    """The int4 layout of kernels/quant_ref.py: qweight int32 [K/8, N], zeros uint8 [G, N],
    scales [G, N] (the checkpoint's dtype), g_idx int32 [K]."""

    qweight: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    g_idx: torch.Tensor
    stored = ("qweight", "zeros", "scales", "g_idx")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        k, g = self.in_features, self.cfg.group_size
        if k % 8 or (g > 0 and k % g):
            raise ValueError(f"quantization_config.group_size: {g} does not divide this model's {k} input "
                             "features (or they are not a multiple of 8)")
        if any(p % 8 for p in self.parts):
            raise ValueError(f"model: int4 projections need output sizes that are multiples of 8 (got {self.parts})")
        self.groups = 1 if g == -1 else k // g

    def expected(self) -> set[str]:
        if self.cfg.packing == "compressed-tensors":
            return {"weight_packed", "weight_scale"} | (set() if self.cfg.symmetric else {"weight_zero_point"})
        return {"qweight", "qzeros", "scales"}

    def fuse(self, leaf: str, pieces: list[torch.Tensor]) -> torch.Tensor:
        if leaf in ("g_idx", "weight_g_idx"):
            if any(not torch.equal(p, pieces[0]) for p in pieces[1:]):
                raise ValueError("model: the fused projection's parts have different g_idx (act-order "
                                 "permutations); pagoda needs them equal")
            return pieces[0]
        if leaf == "weight_shape":      # [rows, K] per part: the fused layer's is the sum of rows
            return torch.tensor([sum(int(p[0]) for p in pieces), int(pieces[0][1])])
        if pieces[0].dim() == 1:
            return torch.cat(pieces)
        # GPTQ and AWQ keep the output dimension last, compressed-tensors first.
        return torch.cat(pieces, dim=0 if self.cfg.packing == "compressed-tensors" else 1)

    def load(self, leaf: str, tensor: torch.Tensor, hf_name: str, device: torch.device) -> None:
        if self.cfg.packing == "compressed-tensors":
            return self._load_compressed_tensors(leaf, tensor, hf_name, device)
        n, k, g = self.out_features, self.in_features, self.groups
        awq = self.cfg.packing == "awq"
        if leaf == "qweight":
            self._int32(hf_name, tensor)
            if awq:
                self._shape(hf_name, tensor, (k, n // 8))
                tensor = pack_int4_rows(unpack_int4_cols(tensor, AWQ_ORDER))
            else:
                self._shape(hf_name, tensor, (k // 8, n))
            self._set("qweight", tensor.to(device).contiguous())
        elif leaf == "qzeros":
            self._int32(hf_name, tensor)
            self._shape(hf_name, tensor, (g, n // 8))
            z = unpack_int4_cols(tensor, AWQ_ORDER if awq else tuple(range(8)))
            if self.cfg.zeros_minus_one:
                z = z + 1
            self._set("zeros", z.to(device=device, dtype=torch.uint8).contiguous())
            self.loaded.add("qzeros")
        elif leaf == "scales":
            self._shape(hf_name, tensor, (g, n))
            if not tensor.is_floating_point():
                raise ValueError(f"model: checkpoint tensor {hf_name} is {tensor.dtype}; scales must be floating point")
            self._set("scales", tensor.to(device).contiguous())
        elif leaf == "g_idx" and not awq:
            self._shape(hf_name, tensor, (k,))
            if int(tensor.min()) < 0 or int(tensor.max()) >= g:
                raise ValueError(f"model: checkpoint tensor {hf_name} has group ids outside 0..{g - 1}")
            self._set("g_idx", tensor.to(device=device, dtype=torch.int32).contiguous())
        else:
            raise ValueError(f"model: checkpoint tensor {hf_name} has no place in a {self.cfg.method} layer")

    def _load_compressed_tensors(self, leaf: str, tensor: torch.Tensor, hf_name: str, device: torch.device) -> None:
        n, k, g = self.out_features, self.in_features, self.groups
        if leaf == "weight_packed":
            self._int32(hf_name, tensor)
            self._shape(hf_name, tensor, (n, k // 8))
            rows = unpack_int4_cols(tensor, tuple(range(8)))          # [N, K], unsigned (signed + 8)
            self._set("qweight", pack_int4_rows(rows.t()).to(device).contiguous())
            self.loaded.add("weight_packed")
        elif leaf == "weight_scale":
            self._shape(hf_name, tensor, (n, g))
            if not tensor.is_floating_point():
                raise ValueError(f"model: checkpoint tensor {hf_name} is {tensor.dtype}; scales must be floating point")
            self._set("scales", tensor.t().to(device).contiguous())
            self.loaded.add("weight_scale")
        elif leaf == "weight_zero_point" and not self.cfg.symmetric:
            self._int32(hf_name, tensor)
            self._shape(hf_name, tensor, (n // 8, g))
            z = unpack_int4_cols(tensor.t().contiguous(), tuple(range(8)))     # [G, N], unsigned like the weights
            self._set("zeros", z.to(device=device, dtype=torch.uint8).contiguous())
            self.loaded.add("weight_zero_point")
        elif leaf == "weight_g_idx":
            self._shape(hf_name, tensor, (k,))
            if int(tensor.min()) < 0 or int(tensor.max()) >= g:
                raise ValueError(f"model: checkpoint tensor {hf_name} has group ids outside 0..{g - 1}")
            self._set("g_idx", tensor.to(device=device, dtype=torch.int32).contiguous())
        elif leaf == "weight_shape":
            if [int(v) for v in tensor.reshape(-1)] != [n, k]:
                raise ValueError(f"model: checkpoint tensor {hf_name} says shape {tensor.tolist()}, expected {[n, k]}")
        else:
            raise ValueError(f"model: checkpoint tensor {hf_name} has no place in a {self.cfg.method} int4 layer")

    @staticmethod
    def _int32(hf_name: str, tensor: torch.Tensor) -> None:
        if tensor.dtype != torch.int32:
            raise ValueError(f"model: checkpoint tensor {hf_name} is {tensor.dtype}; packed int4 must be int32")

    def finish(self) -> None:
        if self.cfg.packing == "compressed-tensors" and self.cfg.symmetric:
            # Signed int4 stored with +8: the zero point of every group is 8.
            self.zeros = torch.full(tuple(self.scales.shape), 8, dtype=torch.uint8, device=self.scales.device)
        if "g_idx" not in self.loaded:
            size = self.in_features if self.cfg.group_size == -1 else self.cfg.group_size
            rows = torch.arange(self.in_features, device=self.qweight.device, dtype=torch.int32)
            self.g_idx = rows // size

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from pagoda.kernels.triton_quant import int4_matmul_triton  # lazy: triton, only on CUDA
            return int4_matmul_triton(x, self.qweight, self.zeros, self.scales, self.g_idx)
        return dense_linear(x, self.dequantized(x.dtype))     # the model's own GEMM, as Fp8Linear's

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_int4_weight(self.qweight, self.zeros, self.scales, self.g_idx, dtype)


def unpack_int4_cols(packed: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """int32 [R, N/8] packed along the columns -> int32 [R, N]; nibble i of each word holds
    column order[i] of its eight."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF         # [R, N/8, 8]: nibble i
    cols = torch.empty_like(nibbles)
    cols[..., list(order)] = nibbles
    return cols.reshape(packed.shape[0], -1)


# ---- the model ---------------------------------------------------------------------------

# Our linear -> the HF linears it stacks (the loader's stacked_params), per decoder layer.
_LINEARS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            "self_attn.o_proj": ("self_attn.o_proj",),
            "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
            "mlp.down_proj": ("mlp.down_proj",)}


def quantize_model(model: nn.Module, cfg: QuantConfig, dtype: torch.dtype) -> int:
    """Swap the decoder layers' linears (on the meta device) for QuantLinears; returns how many."""
    layers = getattr(model, "layers", None)
    if layers is None or not hasattr(model, "stacked_params"):
        raise ValueError(f"quantization: {cfg.method} needs the native Llama-family backend "
                         f"({type(model).__name__} has no quantized layers)")
    cls = Fp8Linear if cfg.scheme == "fp8" else Int4Linear
    swapped = 0
    for i, layer in enumerate(layers):
        for ours, theirs in _LINEARS.items():
            parent_name, leaf = ours.split(".")
            parent = getattr(layer, parent_name)
            old = getattr(parent, leaf)
            hf = [f"model.layers.{i}.{t}" for t in theirs]
            skip = [_ignored(h, cfg.ignore) for h in hf]
            if all(skip):
                continue
            if any(skip):
                raise ValueError(f"quantization_config.ignore: lists only some of {', '.join(hf)}, which pagoda "
                                 "fuses into one projection")
            out_features, in_features = old.weight.shape
            shard = getattr(old, "shard", None)
            reduce = shard is not None and shard.size > 1
            if leaf == "qkv_proj":
                parts: tuple[int, ...] = (parent.q_size, parent.kv_size, parent.kv_size)
            elif leaf == "gate_up_proj":
                parts = (parent.intermediate, parent.intermediate)
            else:
                parts = (out_features,)
            setattr(parent, leaf, cls(in_features, out_features, old.bias is not None, cfg, parts, reduce, dtype))
            swapped += 1
    return swapped


def quant_layers(model: nn.Module) -> dict[str, QuantLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, QuantLinear)}
