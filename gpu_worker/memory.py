"""GPU memory arithmetic for sizing the KV pool: what must stay free beside it.

The KV budget is what gpu_memory_utilization leaves after memory outside torch (CUDA context,
other processes), the profiled peak of a worst-case forward (weights + activations), the
sampler's working set at max_num_seqs rows and the CUDA graphs' private memory pool. Pure
arithmetic, so the CPU suite checks it; ModelRunner._profile_num_blocks feeds it measurements.
"""
from __future__ import annotations

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
