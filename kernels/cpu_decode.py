"""A decode step of a plain Llama-family model as one call into csrc/decode_step_cpu.c.

That C function runs every layer's kernels (RMSNorm, the GEMVs, rotary, the KV write, paged
attention, SiLU * up) with the arguments the Python modules would pass them, so its output is
theirs to the bit; what goes is the Python between them. A linear the C code does not run
(oneDNN, F.linear: the tuner's pick) is computed by the caller's function between two C calls, on
the step's scratch buffers. A DecodeProgram holds the model's tables (weights, norm weights,
caches, shapes) as the C structures, built once; run() takes one step's rows and attention work.
pagoda.gpu_worker.models.llama decides which steps may come here.
"""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from typing import Callable, cast

import numpy as np
import torch

from pagoda.kernels.cpu_lib import GEMV_MAX_M, KINDS, load_library

i64, vp, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
WEIGHTS = ("ln1", "ln2", "w_qkv", "b_qkv", "w_o", "b_o", "w_gu", "b_gu", "w_down", "b_down")
PACKED = ("p_qkv", "p_o", "p_gu", "p_down")      # each linear's weight packed for the GEMM, or the GEMV
# decode_step_cpu.c's scratch buffers, in order; each linear's input and output among them
BUFFERS = ("res_a", "res_b", "x", "qkv", "att", "gu", "act", "y")
LINEAR_IO = (("x", "qkv"), ("att", "y"), ("x", "gu"), ("act", "y"))    # qkv, o, gate/up, down


class DecodeLayer(ctypes.Structure):
    _fields_ = [*((name, vp) for name in WEIGHTS + PACKED), ("external", i64), ("k_cache", vp), ("v_cache", vp),
                ("window", i64)]


class DecodeModel(ctypes.Structure):
    _fields_ = [("layers", ctypes.POINTER(DecodeLayer)), ("n_layers", i64), ("final_norm", vp),
                *((name, i64) for name in ("hidden", "hq", "hkv", "head_dim", "inter", "k_sb", "k_st", "k_sh",
                                           "v_sb", "v_st", "v_sh", "block_size", "n_slots")),
                ("cos_t", vp), ("sin_t", vp), ("cs_st", i64), ("n_pos", i64), ("eps", f32), ("scale", f32),
                ("kind", i64)]


class DecodeStep(ctypes.Structure):
    _fields_ = [("m", i64), ("h", vp), ("out", vp), ("pos", vp), ("slots", vp), ("bt", vp), ("bt_s", i64),
                ("seq_lens", vp), ("qsl", vp), ("items", vp), ("n_items", i64), ("heads_per_item", i64),
                ("scratch", vp), ("threads", i64), ("next", i64), ("in_", vp), ("res", vp)]


@dataclass
class LayerTensors:
    """One decoder layer as the C step reads it (biases None when the layer has none). Each linear
    (0 qkv, 1 o, 2 gate/up, 3 down) runs the GEMV, or the GEMM on its packed weight where one is
    given (kernels/cpu_gemm.pack), or the caller's function where its bit of `external` is set."""
    ln1: torch.Tensor
    ln2: torch.Tensor
    w_qkv: torch.Tensor
    b_qkv: torch.Tensor | None
    w_o: torch.Tensor
    b_o: torch.Tensor | None
    w_gu: torch.Tensor
    b_gu: torch.Tensor | None
    w_down: torch.Tensor
    b_down: torch.Tensor | None
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    window: int
    p_qkv: torch.Tensor | None = None
    p_o: torch.Tensor | None = None
    p_gu: torch.Tensor | None = None
    p_down: torch.Tensor | None = None
    external: int = 0


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    """The kernels' library with decode_step_cpu.c's functions typed and its structures' sizes
    checked against these mirrors."""
    lib = load_library()
    if lib is None:
        return None
    lib.decode_step_cpu.argtypes = [ctypes.POINTER(DecodeModel), ctypes.POINTER(DecodeStep)]
    lib.decode_step_cpu.restype = ctypes.c_int
    lib.decode_step_scratch.argtypes = [ctypes.POINTER(DecodeModel), i64]
    lib.decode_step_scratch.restype = i64
    lib.decode_step_offsets.argtypes = [ctypes.POINTER(DecodeModel), i64, ctypes.POINTER(i64)]
    lib.decode_step_offsets.restype = None
    lib.decode_step_sizes.restype = i64
    sizes = lib.decode_step_sizes()
    want = ctypes.sizeof(DecodeModel) << 32 | ctypes.sizeof(DecodeLayer) << 16 | ctypes.sizeof(DecodeStep)
    if sizes != want:
        raise RuntimeError(f"decode_step_cpu.c: its structures are {sizes:#x} in size, {__name__} mirrors {want:#x}")
    return lib


class DecodeProgram:
    """A model's decode step in C. Keeps references to every tensor it points at; the caller
    builds a new one when a tensor is replaced (the KV caches reallocated)."""

    def __init__(self, layers: list[LayerTensors], final_norm: torch.Tensor, eps: float, scale: float,
                 num_heads: int, cos: torch.Tensor, sin: torch.Tensor):
        lib = _library()
        if lib is None:
            raise ValueError("the CPU kernels' library did not build")
        self.lib = lib
        if not layers:
            raise ValueError("layers: none")
        first = layers[0]
        self.dtype = dtype = first.w_qkv.dtype
        if dtype not in KINDS:
            raise ValueError(f"dtype: {dtype} is not one of {', '.join(map(str, KINDS))}")
        hidden = first.w_qkv.shape[1]
        _, bs, hkv, d = first.k_cache.shape
        if num_heads % hkv or d % 2:
            raise ValueError(f"num_heads: {num_heads} heads over {hkv} KV heads of {d}")
        inter = first.w_down.shape[1]
        shapes = {"ln1": (hidden,), "ln2": (hidden,), "w_qkv": ((num_heads + 2 * hkv) * d, hidden),
                  "b_qkv": ((num_heads + 2 * hkv) * d,), "w_o": (hidden, num_heads * d), "b_o": (hidden,),
                  "w_gu": (2 * inter, hidden), "b_gu": (2 * inter,), "w_down": (hidden, inter), "b_down": (hidden,)}
        for i, layer in enumerate(layers):
            for name, shape in shapes.items():
                t = getattr(layer, name)
                if t is not None and (tuple(t.shape) != shape or t.dtype != dtype or t.device.type != "cpu"
                                      or not t.is_contiguous()):
                    raise ValueError(f"layers[{i}].{name}: want a contiguous {shape} {dtype} CPU tensor, got "
                                     f"{tuple(t.shape)} {t.dtype} on {t.device}")
            for name, weight in zip(PACKED, ("w_qkv", "w_o", "w_gu", "w_down")):
                p, (n, k) = getattr(layer, name), shapes[weight]
                if p is not None and (p.dtype != dtype or p.numel() != lib.gemm_packed_size(n, k)
                                      or not p.is_contiguous()):
                    raise ValueError(f"layers[{i}].{name}: not {weight} packed for the GEMM")
            for name in ("k_cache", "v_cache"):
                c = getattr(layer, name)
                if (c.shape != first.k_cache.shape or c.stride() != first.k_cache.stride() or c.dtype != dtype
                        or c.device.type != "cpu" or c.stride(-1) != 1):
                    raise ValueError(f"layers[{i}].{name}: every cache must be a CPU {dtype} pool shaped and "
                                     f"strided as layers[0].k_cache")
        if final_norm.shape != (hidden,) or final_norm.dtype != dtype or not final_norm.is_contiguous():
            raise ValueError(f"final_norm: want a contiguous ({hidden},) {dtype} tensor")
        if cos.dtype != torch.float32 or cos.shape != sin.shape or cos.shape[-1] != d \
                or not (cos.is_contiguous() and sin.is_contiguous()):
            raise ValueError(f"cos/sin: want contiguous fp32 tables [positions, {d}]")

        def ptr(t: torch.Tensor | None) -> int | None:
            return None if t is None else t.data_ptr()
        self._keep = (layers, final_norm, cos, sin)
        self._layers = (DecodeLayer * len(layers))(*(
            DecodeLayer(*(ptr(getattr(layer, name)) for name in WEIGHTS + PACKED), int(layer.external),
                        layer.k_cache.data_ptr(),
                        layer.v_cache.data_ptr(), int(layer.window)) for layer in layers))
        k_sb, k_st, k_sh, _ = first.k_cache.stride()
        v_sb, v_st, v_sh, _ = first.v_cache.stride()
        self.model = DecodeModel(self._layers, len(layers), final_norm.data_ptr(), hidden, num_heads, hkv, d, inter,
                                 k_sb, k_st, k_sh, v_sb, v_st, v_sh, bs, first.k_cache.shape[0] * bs,
                                 cos.data_ptr(), sin.data_ptr(), cos.stride(0), cos.shape[0], eps, scale,
                                 KINDS[dtype])
        self.hidden = hidden
        self.uses_gemm = any(getattr(layer, name) is not None for layer in layers for name in PACKED)
        self.cache_shape = tuple(first.k_cache.shape)
        self.widths = {"res_a": hidden, "res_b": hidden, "x": hidden, "qkv": (num_heads + 2 * hkv) * d,
                       "att": num_heads * d, "gu": 2 * inter, "act": inter, "y": hidden}
        self.external = any(layer.external for layer in layers)
        self._views: dict[int, dict[str, torch.Tensor]] = {}     # buffers(m), made once per m
        # Scratch for the most rows a step may have, made once (fresh pages fault on every step).
        self._scratch = torch.empty(self.lib.decode_step_scratch(ctypes.byref(self.model), GEMV_MAX_M), dtype=dtype)

    def buffers(self, m: int) -> dict[str, torch.Tensor]:
        """The scratch buffers of a step of m rows, as [m, width] views (decode_step_offsets)."""
        if m not in self._views:
            off = (i64 * (len(BUFFERS) + 1))()
            self.lib.decode_step_offsets(ctypes.byref(self.model), m, off)
            self._views[m] = {name: self._scratch[off[i]:off[i] + m * self.widths[name]].view(m, self.widths[name])
                              for i, name in enumerate(BUFFERS)}
        return self._views[m]

    def run(self, h: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor,
            seq_lens: torch.Tensor, starts: torch.Tensor, items: np.ndarray, heads_per_item: int,
            threads: int, linear: Callable[[int, int, torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """The final norm's output [m, H] for embeddings h [m, H] (1..GEMV_MAX_M rows, contiguous,
        the model's dtype), positions and slots int64 [m], tables int32 [S, B] and seq_lens/starts
        int32, contiguous (kernels/cpu_attention.step_plan makes them), and paged_attention_cpu.c's
        work items (the step's plan; it must have no gemm_attention jobs). linear(layer, which, x)
        computes the layers' external linears (LayerTensors.external), x [m, in] -> [m, out]."""
        m = h.shape[0]
        if not (0 < m <= GEMV_MAX_M and h.shape == (m, self.hidden) and h.dtype == self.dtype and h.is_contiguous()):
            raise ValueError(f"h: want 1 to {GEMV_MAX_M} contiguous rows of {self.hidden} {self.dtype}, got "
                             f"{tuple(h.shape)} {h.dtype}")
        for name, t, dtype in (("positions", positions, torch.int64), ("slot_mapping", slots, torch.int64),
                               ("block_tables", tables, torch.int32), ("seq_lens", seq_lens, torch.int32),
                               ("query_start_loc", starts, torch.int32)):
            if t.dtype != dtype or not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError(f"{name}: want a contiguous {dtype} CPU tensor, got {t.dtype} on {t.device}")
        if positions.shape != (m,) or slots.shape != (m,) or starts.shape != (seq_lens.shape[0] + 1,):
            raise ValueError(f"positions/slot_mapping/query_start_loc: want [{m}], [{m}] and "
                             f"[{seq_lens.shape[0] + 1}], got {tuple(positions.shape)}, {tuple(slots.shape)}, "
                             f"{tuple(starts.shape)}")
        if items.dtype != np.int64 or not items.flags.c_contiguous:
            raise ValueError("items: want a contiguous int64 array")
        out = torch.empty_like(h)
        step = DecodeStep(m, h.data_ptr(), out.data_ptr(), positions.data_ptr(), slots.data_ptr(), tables.data_ptr(),
                          tables.stride(0), seq_lens.data_ptr(), starts.data_ptr(), items.ctypes.data, len(items),
                          heads_per_item, self._scratch.data_ptr(), threads)
        if self.external and linear is None:
            raise ValueError("linear: the layers have external linears and no function computes them")
        views = self.buffers(m) if self.external else {}
        while True:
            rc = self.lib.decode_step_cpu(ctypes.byref(self.model), ctypes.byref(step))
            if rc or step.next < 0:
                break
            layer, which = divmod(step.next, 4)
            src, dst = LINEAR_IO[which]
            views[dst].copy_(cast(Callable, linear)(layer, which, views[src]))
            step.next += 1
        if rc == 3:
            raise IndexError(f"positions: outside the rotary table's {self.model.n_pos} positions")
        if rc == 4:
            raise IndexError(f"slot_mapping: a slot past the cache's {self.model.n_slots} slots")
        if rc:
            raise (MemoryError if rc == 2 else RuntimeError)(f"decode_step_cpu: a kernel refused the step (code {rc})")
        return out
