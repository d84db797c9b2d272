"""Turn one step's logits into tokens, per request, with vLLM's sampling semantics.

Order (as vLLM V1): raw log-probabilities are taken first (what `logprobs` reports), then
min_tokens suppression and logit_bias, then penalties (repetition over prompt + output,
presence and frequency over output), then greedy argmax for temperature 0, else temperature,
min_p, top_k, top_p and a draw.

The draw is argmax(probs / q) with q ~ Exp(1) (the exponential race, equivalent to sampling
from probs). A request with its own torch.Generator draws its q row from it alone, so a seeded
request gives the same tokens whatever else shares the batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from gpu_worker.outputs import Logprob, TokenLogprobs
from gpu_worker.sampling_params import SamplingParams
from gpu_worker.structured_output import apply_grammar_masks


@dataclass
class SamplingRow:
    """What the sampler needs of one request that samples this step."""
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: Optional[torch.Generator] = None
    grammar: Any = None           # structured_output.GrammarState of a constrained request


class Sampler:
    def __init__(self, eos_token_ids: list[int]):
        self.eos_token_ids = list(eos_token_ids)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]
                 ) -> tuple[list[int], list[Optional[TokenLogprobs]]]:
        """logits [B, V] fp32, one row per request -> (token ids, logprobs or None per row)."""
        # Structured output first: a token the grammar forbids is not a candidate at all.
        apply_grammar_masks(logits, [r.grammar for r in rows], [r.output_token_ids for r in rows])
        raw_logprobs = None
        if any(r.params.logprobs is not None for r in rows):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = logits.clone()
        for i, r in enumerate(rows):
            self._apply_biases(logits[i], r)
        tokens = self._sample(logits, rows)
        token_list = tokens.tolist()
        return token_list, self._logprobs(raw_logprobs, token_list, rows)

    def _apply_biases(self, row: torch.Tensor, r: SamplingRow) -> None:
        p = r.params
        if len(r.output_token_ids) < p.min_tokens:
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
            stops = [t for t in stops if 0 <= t < row.shape[0]]
            if stops:
                row[stops] = float("-inf")
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias.keys()), device=row.device)
            row.index_add_(0, ids, torch.tensor(list(p.logit_bias.values()), dtype=row.dtype,
                                                device=row.device))
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(r.prompt_token_ids) | set(r.output_token_ids)),
                                dtype=torch.long, device=row.device)
            if seen.numel():
                vals = row[seen]
                row[seen] = torch.where(vals > 0, vals / p.repetition_penalty,
                                        vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and r.output_token_ids:
            counts = torch.bincount(torch.tensor(r.output_token_ids, device=row.device),
                                    minlength=row.shape[0])[:row.shape[0]].to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        greedy = torch.tensor([r.params.temperature == 0.0 for r in rows], device=logits.device)
        argmax = logits.argmax(dim=-1)
        if bool(greedy.all()):
            return argmax
        temps = torch.tensor([r.params.temperature or 1.0 for r in rows], device=logits.device,
                             dtype=logits.dtype)
        logits = logits / temps[:, None]
        logits = _apply_min_p(logits, [r.params.min_p for r in rows])
        logits = _apply_top_k_top_p(logits, [r.params.top_k for r in rows], [r.params.top_p for r in rows])
        probs = torch.softmax(logits, dim=-1)
        q = torch.empty_like(probs)
        seeded = [r.generator is not None and r.params.temperature != 0.0 for r in rows]
        if not all(seeded):
            q.exponential_()
        for i, r in enumerate(rows):
            if seeded[i]:
                q[i].exponential_(generator=r.generator)
        sampled = (probs / q).argmax(dim=-1)
        return torch.where(greedy, argmax, sampled)

    @staticmethod
    def _logprobs(raw: Optional[torch.Tensor], tokens: list[int],
                  rows: list[SamplingRow]) -> list[Optional[TokenLogprobs]]:
        out: list[Optional[TokenLogprobs]] = []
        for i, r in enumerate(rows):
            k = r.params.logprobs
            if k is None:
                out.append(None)
                continue
            top = []
            if k > 0:
                vals, ids = raw[i].topk(k)
                top = [Logprob(t, v) for t, v in zip(ids.tolist(), vals.tolist())]
            out.append(TokenLogprobs(Logprob(tokens[i], raw[i, tokens[i]].item()), top))
        return out


def _apply_min_p(logits: torch.Tensor, min_ps: list[float]) -> torch.Tensor:
    if not any(min_ps):
        return logits
    min_p = torch.tensor(min_ps, device=logits.device, dtype=logits.dtype)
    probs = torch.softmax(logits, dim=-1)
    threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, float("-inf"))


def _apply_top_k_top_p(logits: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
    vocab = logits.shape[-1]
    ks = [k if 0 < k < vocab else vocab for k in top_ks]
    if all(k == vocab for k in ks) and all(p >= 1.0 for p in top_ps):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    k = torch.tensor(ks, device=logits.device)
    # Ascending sort: the k-th largest sits at index vocab - k; everything below it goes.
    kth = sorted_logits.gather(1, (vocab - k)[:, None])
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    top_p = torch.tensor(top_ps, device=logits.device, dtype=logits.dtype)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cum <= 1 - top_p[:, None]
    drop[:, -1] = False     # the most likely token always stays
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
