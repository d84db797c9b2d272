"""Speculative decoding, the scheduler's side: which requests speculate, what they propose, and
the acceptance counters.

A decoding request may compute up to k drafted tokens after its own in one step (the runner
verifies them: gpu_worker/features/spec_decode.py). n-gram prompt lookup proposes here, from
the request's own tokens; a draft model proposes in the runner (gpu_worker/runner/draft_model.py),
so its drafts leave the scheduler as -1 placeholders.

Rows with a grammar, penalties, logprobs or min_tokens still to reach never speculate: their
next distribution depends on the tokens before it in ways the one-forward check would not see.
Nor does a request's first token (it carries the prompt's scores, prompt_logprobs).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from pagoda.gpu_worker.core.request import Request
from pagoda.gpu_worker.core.spec_config import SpeculativeConfig


def can_speculate(req: Request) -> bool:
    p = req.params
    return (req.grammar is None and p.logprobs is None and p.repetition_penalty == 1.0
            and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
            and req.num_output_tokens >= max(1, p.min_tokens))


def ngram_propose(tokens: np.ndarray, n_min: int, n_max: int, k: int) -> np.ndarray:
    """Prompt lookup: the longest suffix of `tokens` (n_max down to n_min tokens) that also
    occurs earlier; the up-to-k tokens that followed its first occurrence. Empty: no match."""
    length = len(tokens)
    if k < 1:
        return tokens[:0]
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        # Windows that start early enough to be followed by at least one token.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:length - 1], n)
        hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
        if len(hits):
            start = int(hits[0]) + n
            return tokens[start:start + k]
    return tokens[:0]


class Drafter:
    """The scheduler's view of the proposer: how many drafts a decoding request gets this step,
    and (n-gram) which. A draft model proposes in the runner: its drafts go out as -1s."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        self.config = config
        self.k = config.num_speculative_tokens
        self.max_model_len = max_model_len

    def propose(self, req: Request, budget: int) -> list[int]:
        if not can_speculate(req):
            return []
        # Never past the request's end: every draft accepted plus the bonus token must fit.
        k = min(self.k, budget, req.params.max_tokens - req.num_output_tokens - 1,
                self.max_model_len - req.num_tokens - 1)
        if k < 1:
            return []
        if self.config.method != "ngram":
            return [-1] * k
        c = self.config
        drafts = ngram_propose(np.asarray(req.all_token_ids, dtype=np.int64), c.prompt_lookup_min,
                               c.prompt_lookup_max, k)
        return drafts.tolist()


@dataclass
class SpecStats:
    """Acceptance counters, cumulative, under vLLM's meaning: a draft is one sequence's
    proposal in one step (of num_draft_tokens tokens); accepted_per_pos[j] counts drafts whose
    token j was accepted."""
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: Optional[list[int]] = None

    def record(self, num_draft: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        assert self.accepted_per_pos is not None
        for j in range(num_accepted):
            self.accepted_per_pos[j] += 1
