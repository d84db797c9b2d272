"""Which steps to run before a worker reports SERVING, so that no Triton kernel compiles mid-serving.

A Triton kernel compiles once per distinct set of compile-time parameters. Per model those are
fixed except what a step's shape selects: prefill/mixed against decode tiles (launch_config) and
the split-KV segment count of a decode step (num_kv_splits: 1, 2, 4, ... up to what the longest
context allows). Integers that vary per step (token and sequence counts, the block-table width)
are marked do_not_specialize in the kernels, so they add no variants. The plan below is one
prefill step plus one decode step per reachable split count. CUDA-graph capture then runs each
ladder size once before capturing it (with the longest context, a split count of the plan).
"""
from __future__ import annotations

from dataclasses import dataclass

from pagoda.kernels.triton_attention import num_kv_splits


@dataclass(frozen=True)
class WarmupStep:
    num_seqs: int
    seq_len: int        # every sequence's context length, this step's token included
    decode: bool        # one new token per sequence (else the whole context is prefill)


def reachable_splits(max_num_seqs: int, max_model_len: int, num_kv_heads: int, num_sms: int,
                     block_n: int) -> list[int]:
    """Every split-KV count a decode step can select (it grows with the context, shrinks with
    the batch, so one sequence at the longest context gives the largest)."""
    top = num_kv_splits(1, num_kv_heads, num_sms, block_n, max_model_len)
    return [1 << i for i in range(top.bit_length())]


def warmup_plan(max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int, num_kv_heads: int,
                num_sms: int, block_n: int) -> list[WarmupStep]:
    prefill_len = min(max_model_len, max_num_batched_tokens, 64)
    steps = [WarmupStep(1, prefill_len, decode=False)]
    for splits in reachable_splits(max_num_seqs, max_model_len, num_kv_heads, num_sms, block_n):
        # The shortest context that selects this count for one sequence (1 for no split).
        seq_len = 1 if splits == 1 else min(max_model_len, 4 * block_n * splits)
        steps.append(WarmupStep(1, seq_len, decode=True))
    return steps
