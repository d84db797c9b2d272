"""CUDA graphs for decode steps: capture the model's forward once per batch size of a ladder,
then replay a decode step padded up to the next captured size.

A decode step launches a few hundred small kernels; replaying a graph launches them all with
one call, so the step costs the GPU's time, not the CPU's. Only pure-decode steps (one token per
sequence, at most max_num_seqs) replay; prefill and mixed steps run eagerly. The graphs read
static input buffers: a step is staged into them (padding rows write no KV: slot -1, and attend
to one key of block 0), and the hidden rows of the real sequences are read back.

The ladder, the padding and the staging are device-agnostic and tested on CPU; capture and
replay need CUDA (`--enforce-eager` turns them off).
"""
from __future__ import annotations

import bisect
import math

import torch

from pagoda.gpu_worker.models.attention import AttentionMetadata


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every 16 up to max_num_seqs (always included).
    Padding wastes at most 15 rows of a decode step, which costs little next to the weights."""
    ladder = [n for n in (1, 2, 4, 8) if n < max_num_seqs]
    ladder += list(range(16, max_num_seqs, 16))
    return ladder + [max_num_seqs]


def padded_size(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds num_seqs rows; None when none does (run eagerly)."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


class StaticBatch:
    """The graphs' input buffers, sized for the largest captured batch."""

    def __init__(self, max_num_seqs: int, max_model_len: int, block_size: int, device: torch.device):
        n, width = max_num_seqs, math.ceil(max_model_len / block_size)
        self.max_model_len = max_model_len
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(n, width, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)

    def stage(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        """Copy a decode step of S sequences into rows [:S]; rows past S become padding."""
        s, width = ids.shape[0], meta.block_tables.shape[1]
        self.input_ids[:s].copy_(ids)
        self.positions[:s].copy_(positions)
        self.slot_mapping[:s].copy_(meta.slot_mapping)
        self.slot_mapping[s:].fill_(-1)
        self.block_tables[:s, :width].copy_(meta.block_tables)
        self.block_tables[s:].zero_()
        self.seq_lens[:s].copy_(meta.seq_lens)
        self.seq_lens[s:].fill_(1)

    def views(self, n: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(ids, positions, metadata) of the first n rows, as a graph of size n reads them. The
        split-KV count is fixed at capture, for the longest context."""
        meta = AttentionMetadata(slot_mapping=self.slot_mapping[:n], block_tables=self.block_tables[:n],
                                 seq_lens=self.seq_lens[:n], query_start_loc=self.query_start_loc[:n + 1],
                                 max_seq_len=self.max_model_len)
        return self.input_ids[:n], self.positions[:n], meta


class DecodeGraphs:
    """One captured decode forward per ladder size, sharing one memory pool (CUDA only)."""

    def __init__(self, model, max_num_seqs: int, max_model_len: int, block_size: int, device: torch.device):
        self.model, self.sizes = model, capture_sizes(max_num_seqs)
        self.batch = StaticBatch(max_num_seqs, max_model_len, block_size, device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        for n in reversed(self.sizes):  # largest first: the smaller ones reuse its pool
            ids, pos, meta = self.batch.views(n)
            self.model(ids, pos, meta)  # compiles and allocates outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[n] = self.model(ids, pos, meta)
            pool = graph.pool()
            self.graphs[n] = graph

    def run(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """Hidden rows [S, H] of a pure-decode step by replay, or None if it must run eagerly."""
        num_seqs = meta.seq_lens.shape[0]
        n = padded_size(num_seqs, self.sizes) if ids.shape[0] == num_seqs else None
        if n is None:
            return None
        self.batch.stage(ids, positions, meta)
        self.graphs[n].replay()
        return self.outputs[n][:num_seqs]
