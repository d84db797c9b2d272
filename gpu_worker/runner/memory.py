"""GPU memory arithmetic for sizing the KV pool: what must stay free beside it, and what weights take.

The KV budget is what gpu_memory_utilization leaves after memory outside torch (CUDA context,
other processes), the profiled peak of a worst-case forward (weights + activations), the
sampler's working set at max_num_seqs rows and the CUDA graphs' private memory pool. Pure
arithmetic, so the CPU suite checks it; ModelRunner._profile_num_blocks feeds it measurements.
"""
from __future__ import annotations

from typing import Optional

# fp32 [rows, vocab] tensors the sampler holds at its peak, beyond the logits the profiled step
# already counts: a clone for biases/penalties, probabilities, top-k/top-p's sorted values and
# int64 indices (three fp32 widths), their cumulative sum, the exponential-race noise and the
# log-softmax for logprobs. 128k vocabulary x 256 rows: about 1.2 GiB.
SAMPLER_FP32_COPIES = 9


def sampler_workspace_bytes(max_num_seqs: int, vocab_size: int) -> int:
    """Bytes the sampler may use at once for a step of max_num_seqs sampling rows."""
    return SAMPLER_FP32_COPIES * 4 * max_num_seqs * vocab_size


# Per captured graph: its kernel nodes and the split-KV partials of the small sizes.
GRAPH_OVERHEAD_BYTES = 2 * 2**20


def cuda_graph_bytes(num_graphs: int, max_num_seqs: int, hidden_size: int, intermediate_size: int,
                     qkv_width: int, elem_size: int) -> int:
    """The decode graphs' private pool: one decode step's activations at the largest size (the
    smaller graphs, captured after it, reuse that pool) plus a little per graph. The runner
    logs the pool it really took after capture, to check this estimate."""
    activations = max_num_seqs * (4 * hidden_size + qkv_width + 3 * intermediate_size) * elem_size
    return activations + num_graphs * GRAPH_OVERHEAD_BYTES


def kv_budget_bytes(total: int, utilization: float, outside_torch: int, forward_peak: int,
                    sampler_bytes: int, graph_bytes: int = 0) -> int:
    """Bytes left for KV blocks (may be negative: the caller names the flag to change)."""
    return int(total * utilization) - outside_torch - forward_peak - sampler_bytes - graph_bytes


def module_bytes(model) -> int:
    """Bytes of a model's parameters and buffers as they are held (quantized layers: their packed
    weights, zero points and scales), each storage counted once (tied embeddings)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    tensors = list(model.parameters()) + [b for b in model.buffers() if b is not None]
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.storage_offset()) if t.device.type != "meta" else (id(t), 0)
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


def linear_weight_bytes(out_features: int, in_features: int, scheme: Optional[str], elem_size: int = 2,
                        group_size: int = 128, block: Optional[tuple[int, int]] = None,
                        scale_size: int = 2) -> int:
    """Bytes one linear layer's weight takes under a quantization scheme, without bias:
    None (elem_size per weight), fp8 (one byte per weight + fp32 scales per output channel or
    per block), int4 (half a byte per weight + per group and column: a uint8 zero point and a
    scale_size-byte scale, + an int32 group id per input row)."""
    n, k = out_features, in_features
    if scheme is None:
        return n * k * elem_size
    if scheme == "fp8":
        scales = n if block is None else -(-n // block[0]) * -(-k // block[1])
        return n * k + 4 * scales
    if scheme == "int4":
        groups = 1 if group_size == -1 else k // group_size
        return n * k // 2 + groups * n * (1 + scale_size) + 4 * k
    raise ValueError(f"scheme: must be None, fp8 or int4 (got {scheme!r})")
