"""Turn one step's logits into tokens, all rows at once, with vLLM's sampling semantics.

Order: the structured-output grammar mask first (a forbidden token is no candidate, not even
for logprobs), then raw log-probabilities (what `logprobs` reports), min_tokens suppression,
logit_bias, penalties (repetition over prompt + output, presence and frequency over output),
then greedy argmax for temperature 0, else temperature, min_p, top_k, top_p and a draw. Every transform is one
batched tensor operation over the rows that use it; rows that do not are left as they are.

top_k takes the k best with topk, not a sort. top_p looks only at the best candidates (the k
best, or the best TOP_P_CANDIDATES for rows without top_k): when they hold p of the mass the
answer is exact; otherwise (a very flat distribution) it falls back to a sort of the vocabulary.

The draw is by inverse CDF: one uniform per row, the first token (in candidate order) whose
cumulative mass passes it. Unseeded rows draw their uniforms in one call; a row with its own
torch.Generator draws from it alone, so a seeded request gives the same tokens whatever shares
the batch. Sampled tokens and logprobs reach the host in one copy.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from pagoda.gpu_worker.core.outputs import Logprob, TokenLogprobs
from pagoda.gpu_worker.features.structured_output import apply_grammar_masks

# top_p candidates looked at before falling back to the whole vocabulary.
TOP_P_CANDIDATES = 256


@dataclass
class SamplingBatch:
    """What the sampler needs of the rows that sample this step (row i = logits row i)."""
    temperature: torch.Tensor                 # [B]; 0 = greedy
    top_p: torch.Tensor                       # [B]; 1 = off
    top_k: torch.Tensor                       # [B] float; vocab size = off
    min_p: torch.Tensor                       # [B]; 0 = off
    all_greedy: bool
    any_greedy: bool
    greedy: Optional[torch.Tensor]            # [B] bool, when rows are mixed
    top_k_max: int                            # largest k in use, 0 when no row uses top_k
    any_top_p: bool
    any_min_p: bool
    all_top_k: bool = False                   # every row uses top_k (known on the host: no sync)
    generators: list[tuple[int, torch.Generator]] = field(default_factory=list)
    # (rows, token ids) to hold back while a row is under min_tokens.
    min_tokens_mask: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    logit_bias: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None   # rows, ids, values
    # (rows, seen in prompt+output [P, V], output counts [P, V], [P, 3] rep/presence/frequency)
    penalties: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = None
    num_logprobs: Optional[list[int]] = None  # per row, -1 = none; None when no row wants any
    # Structured output, the one place for per-row token constraints: each row's GrammarState
    # (None: free) and its output tokens so far; None when no row is constrained.
    grammars: Optional[list[Any]] = None
    outputs: Optional[list[list[int]]] = None


@dataclass
class Sampled:
    """A step's draw on its way to the host: tokens (int64 [B]), or with logprobs one float64
    [B, 2 + 2k] block (token, its logprob, k top values, k top ids); on CUDA copied into pinned
    memory without waiting, `ready` marking when the copy has landed."""
    host: torch.Tensor
    ready: Optional[Any]                      # torch.cuda.Event, None when already on the host
    num_logprobs: Optional[list[int]]
    k: int
    tokens: torch.Tensor                      # int64 [B] on the device: the next step's inputs


class Sampler:
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch
                 ) -> tuple[list[int], list[Optional[TokenLogprobs]]]:
        """logits [B, V] fp32 (modified in place) -> (token ids, logprobs or None per row)."""
        return self.to_host(self.draw(logits, batch))

    def draw(self, logits: torch.Tensor, batch: SamplingBatch) -> Sampled:
        """Sample on the device and start the copy to the host; on CUDA this returns before
        the GPU is done (rows whose top_p must check a flat distribution still wait for it)."""
        if batch.grammars is not None and batch.outputs is not None:
            # Before everything else: a token the grammar forbids is not a candidate at all.
            apply_grammar_masks(logits, batch.grammars, batch.outputs)
        raw = torch.log_softmax(logits, dim=-1) if batch.num_logprobs is not None else None
        logits = self.process(logits, batch)
        tokens = self.sample(logits, batch)
        packed, k = self._pack(tokens, raw, batch)
        if packed.device.type != "cuda":
            return Sampled(packed, None, batch.num_logprobs, k, tokens)
        host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        host.copy_(packed, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return Sampled(host, ready, batch.num_logprobs, k, tokens)

    @staticmethod
    def process(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
        """Everything before temperature: constraints, suppression, biases, penalties."""
        if b.min_tokens_mask is not None:
            logits[b.min_tokens_mask] = float("-inf")
        if b.logit_bias is not None:
            rows, ids, vals = b.logit_bias
            logits.index_put_((rows, ids), vals, accumulate=True)
        if b.penalties is not None:
            rows, seen, counts, p = b.penalties
            sub = logits[rows]
            rep = p[:, 0:1]
            sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
            sub -= p[:, 2:3] * counts + p[:, 1:2] * (counts > 0).to(sub.dtype)
            logits[rows] = sub
        return logits

    @staticmethod
    def sample(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
        argmax = logits.argmax(dim=-1) if b.any_greedy else None
        if b.all_greedy:
            assert argmax is not None
            return argmax
        # Greedy rows divide by 1: their draw is discarded below.
        temp = torch.where(b.temperature > 0, b.temperature, torch.ones_like(b.temperature))
        # In place from here: a fresh [B, V] tensor per operation costs an allocation and its page
        # faults on a CPU. Probabilities stay unnormalised (the best token of a row is exactly 1),
        # since every cut and the draw below compare within a row.
        probs = logits.div_(temp[:, None])
        probs = probs.sub_(probs.amax(dim=-1, keepdim=True)).exp_()
        if b.any_min_p:     # below min_p of the best token's probability
            probs.masked_fill_(probs < b.min_p[:, None], 0.0)
        u = uniforms(probs.shape[0], b.generators, probs.device)
        if b.top_k_max or b.any_top_p:
            sampled = _sample_truncated(probs, b, u)
        else:
            sampled = _inverse_cdf(probs, u)
        if b.greedy is not None and argmax is not None:
            return torch.where(b.greedy, argmax, sampled)
        return sampled

    @staticmethod
    def probs(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
        """The normalised distribution sample() draws from, per row (greedy rows: one-hot at the
        argmax), after process(); for speculative decoding's rejection sampler. logits are
        modified in place."""
        argmax = logits.argmax(dim=-1) if b.any_greedy else None
        if b.all_greedy:
            assert argmax is not None
            return torch.zeros_like(logits).scatter_(1, argmax[:, None], 1.0)
        temp = torch.where(b.temperature > 0, b.temperature, torch.ones_like(b.temperature))
        probs = logits.div_(temp[:, None])
        probs = probs.sub_(probs.amax(dim=-1, keepdim=True)).exp_()
        if b.any_min_p:
            probs.masked_fill_(probs < b.min_p[:, None], 0.0)
        if b.top_k_max or b.any_top_p:
            probs = _truncate(probs, b)
        probs = probs.div_(probs.sum(dim=-1, keepdim=True))
        if argmax is not None:
            greedy = b.greedy if b.greedy is not None else b.temperature == 0
            one_hot = torch.zeros_like(probs).scatter_(1, argmax[:, None], 1.0)
            probs = torch.where(greedy[:, None], one_hot, probs)
        return probs

    @staticmethod
    def _pack(tokens: torch.Tensor, raw: Optional[torch.Tensor], b: SamplingBatch) -> tuple[torch.Tensor, int]:
        """Everything the host needs of the draw in one tensor, so that one copy moves it."""
        if raw is None or b.num_logprobs is None:
            return tokens, 0
        k = max(b.num_logprobs)
        parts = [tokens[:, None].double(), raw.gather(1, tokens[:, None]).double()]
        if k > 0:
            top_vals, top_ids = raw.topk(k, dim=-1)
            parts += [top_vals.double(), top_ids.double()]
        return torch.cat(parts, dim=1), k     # token ids are exact in float64

    @staticmethod
    def to_host(s: Sampled) -> tuple[list[int], list[Optional[TokenLogprobs]]]:
        """Wait for the draw's copy, then (token ids, logprobs or None per row)."""
        if s.ready is not None:
            s.ready.synchronize()
        if s.num_logprobs is None:
            return s.host.tolist(), [None] * s.host.shape[0]
        k = s.k
        host = s.host.tolist()
        out_tokens: list[int] = []
        out_lps: list[Optional[TokenLogprobs]] = []
        for row, want in zip(host, s.num_logprobs):
            tok = int(row[0])
            out_tokens.append(tok)
            if want < 0:
                out_lps.append(None)
                continue
            top = [Logprob(int(t), v) for v, t in zip(row[2:2 + want], row[2 + k:2 + k + want])]
            out_lps.append(TokenLogprobs(Logprob(tok, row[1]), top))
        return out_tokens, out_lps


def uniforms(n: int, generators: list[tuple[int, torch.Generator]], device: torch.device) -> torch.Tensor:
    """One uniform per row: unseeded rows in one call, seeded rows from their own generator."""
    u = torch.rand(n, device=device)
    for i, g in generators:
        u[i] = torch.rand(1, generator=g, device=device)[0]
    return u


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Row i's index whose cumulative mass first exceeds u_i of the row's total: a draw from
    probs (unnormalised is fine; overwritten) with one random number per row, not one per token."""
    cdf = probs.cumsum_(dim=-1)
    x = u[:, None] * cdf[:, -1:]
    # The number of cumulative masses <= x, by binary search in each row.
    return torch.searchsorted(cdf, x, right=True).squeeze(1).clamp(max=probs.shape[-1] - 1)


def _sample_truncated(probs: torch.Tensor, b: SamplingBatch, u: torch.Tensor) -> torch.Tensor:
    """Draw among each row's best tokens only (_truncate)."""
    return _inverse_cdf(_truncate(probs, b), u)


def _truncate(probs: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """Keep (in place) each row's best tokens only: the k best (top_k), of which the fewest whose mass
    reaches p (top_p; the best one always stays). Both cut at a per-row threshold found from the
    best values alone (topk); the sorted whole vocabulary is needed only when a top_p row without
    top_k is so flat that its best TOP_P_CANDIDATES do not reach p."""
    vocab = probs.shape[-1]
    k_on = b.top_k < vocab
    if b.top_k_max:
        best = probs.topk(b.top_k_max, dim=-1).values
        kth = best.gather(1, (b.top_k.clamp(max=b.top_k_max).long() - 1)[:, None])
        probs.masked_fill_(k_on[:, None] & (probs < kth), 0.0)
    if b.any_top_p:
        total = probs.sum(dim=-1, keepdim=True)
        if b.all_top_k:
            cand = best.masked_fill(best < kth, 0.0)
        elif vocab <= 4 * TOP_P_CANDIDATES:     # a small vocabulary: sorting costs no more
            cand = _sorted_values(probs)
        else:
            cand = probs.topk(max(TOP_P_CANDIDATES, b.top_k_max), dim=-1).values
            enough = (cand.sum(dim=-1, keepdim=True) >= b.top_p[:, None] * total) | (b.top_p[:, None] >= 1)
            if not bool(enough.all()):
                cand = _sorted_values(probs)
        # Mass strictly ahead of each candidate: top_p keeps those below p of the kept total.
        ahead = cand.cumsum(dim=-1).sub_(cand)
        kept = (ahead < b.top_p[:, None] * total).sum(dim=-1).clamp(min=1)
        cutoff = cand.gather(1, (kept - 1)[:, None])
        probs.masked_fill_((b.top_p[:, None] < 1) & (probs < cutoff), 0.0)
    return probs


def _sorted_values(probs: torch.Tensor) -> torch.Tensor:
    """Each row's values, largest first. On CPU numpy's sort: torch's measured about ten times
    slower there (bench/overhead.py, 256 x 640)."""
    if probs.device.type == "cpu":
        return torch.from_numpy(np.ascontiguousarray(np.sort(probs.numpy(), axis=-1)[:, ::-1]))
    return probs.sort(dim=-1, descending=True).values
