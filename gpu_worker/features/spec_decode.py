"""Speculative decoding: proposers, the rejection sampler, and the draft model's runner.

A step verifies k drafted tokens of a decoding sequence in the target's one forward: the
sequence computes 1 + k query rows (its pending token, then the drafts) over the paged pool,
giving the target's distributions p_0..p_k. Draft j is accepted with probability
min(1, p_j(d) / q_j(d)) (q: the proposer's distribution; n-gram lookup is a point mass, so
q_j(d) = 1); at the first rejection the token is drawn from the residual max(p_j - q_j, 0),
renormalised; when all k are accepted a bonus token is drawn from p_k. This leaves the emitted
tokens distributed exactly as sampling from the target one token at a time (Leviathan et al.,
Chen et al. 2023). Greedy rows use a one-hot p (the argmax), which makes the rule "accept while
the draft is the target's argmax, then emit the argmax": greedy output is that of decoding
without speculation.

Rows with a grammar, penalties, logprobs or min_tokens still to reach never speculate: their
next distribution depends on the tokens before it in ways the one-forward check would not see.
Nor does a request's first token (it carries the prompt's scores, prompt_logprobs).

The draft model's KV lives in its own pool with the target's block ids (same block size, so
the target's block tables and slot mappings serve it): a request's blocks hold both models'
KV, and rolling back rejected tokens frees both at once.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, cast

import numpy as np
import torch

from pagoda.gpu_worker.core.spec_config import SpeculativeConfig

if TYPE_CHECKING:
    from pagoda.gpu_worker.core.request import Request
    from pagoda.gpu_worker.runner.sampler import SamplingBatch

log = logging.getLogger(__name__)


# ---- which requests speculate, and what they propose (scheduler side) ------------------------

def can_speculate(req: "Request") -> bool:
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

    def propose(self, req: "Request", budget: int) -> list[int]:
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


# ---- verification (runner side) ---------------------------------------------------------------

@dataclass
class Verified:
    """Per speculating sequence: drafts accepted, and the tokens emitted (accepted + one)."""
    num_accepted: list[int]
    tokens: list[list[int]]


def rejection_sample(target: torch.Tensor, num_drafts: np.ndarray, draft_ids: torch.Tensor,
                     draft_probs: Optional[torch.Tensor], u: torch.Tensor) -> Verified:
    """target [N, V]: normalised target distributions, 1 + k_s rows per sequence s in order;
    draft_ids [sum k]: the drafts; draft_probs [sum k, V] the distributions they were drawn
    from (None: point masses, n-gram); u [N]: one uniform per target row (the acceptance test
    of draft j on row j, the final draw on the sequence's last row)."""
    s = len(num_drafts)
    rows = num_drafts + 1
    first = np.cumsum(rows) - rows                  # each sequence's first target row
    dev = target.device
    seq_of_draft = np.repeat(np.arange(s), num_drafts)
    draft_row = first[seq_of_draft] + (np.arange(len(seq_of_draft)) - (np.cumsum(num_drafts) - num_drafts)[seq_of_draft])
    draft_row_t = torch.from_numpy(draft_row).to(dev)
    p_d = target[draft_row_t, draft_ids]
    q_d = draft_probs.gather(1, draft_ids[:, None])[:, 0] if draft_probs is not None else torch.ones_like(p_d)
    accept = u[draft_row_t] * q_d < p_d
    # Leading accepts per sequence: a [S, k_max] grid, False past each sequence's drafts.
    k_max = int(num_drafts.max()) if s else 0
    grid = torch.zeros(s, max(k_max, 1), dtype=torch.bool, device=dev)
    col = torch.from_numpy(draft_row - first[seq_of_draft]).to(dev)
    grid[torch.from_numpy(seq_of_draft).to(dev), col] = accept
    num_accepted = grid.to(torch.int64).cumprod(dim=1).sum(dim=1)
    acc = num_accepted.cpu().numpy()
    final_row = torch.from_numpy(first + acc).to(dev)
    dist = target[final_row].clone()
    rejected = np.flatnonzero(acc < num_drafts)
    if len(rejected):
        # The residual at the rejected position: p - q, clipped at 0 (a point mass q just
        # removes the draft token).
        rej = torch.from_numpy(rejected).to(dev)
        pos = torch.from_numpy((np.cumsum(num_drafts) - num_drafts)[rejected] + acc[rejected]).to(dev)
        if draft_probs is not None:
            resid = (dist[rej] - draft_probs[pos]).clamp_(min=0.0)
        else:
            resid = dist[rej].scatter(1, draft_ids[pos][:, None], 0.0)
        # All mass removed only when p == q up to rounding, where rejecting was (nearly)
        # impossible: p itself is then the exact answer.
        empty = resid.sum(dim=1, keepdim=True) <= 0
        dist[rej] = torch.where(empty, dist[rej], resid)
    cdf = dist.cumsum(dim=1)
    # The last row's uniform: never used by an acceptance test (reusing the rejected one's
    # would draw from only the part of [0, 1) that rejection leaves).
    last_row = torch.from_numpy(first + num_drafts).to(dev)
    x = u[last_row][:, None] * cdf[:, -1:]
    final = torch.searchsorted(cdf, x, right=True).squeeze(1).clamp(max=dist.shape[1] - 1)
    drafts_host = draft_ids.cpu().tolist()
    final_host = final.cpu().tolist()
    starts = (np.cumsum(num_drafts) - num_drafts).tolist()
    tokens = [drafts_host[b:b + int(a)] + [f] for b, a, f in zip(starts, acc.tolist(), final_host)]
    return Verified(acc.tolist(), tokens)


def uniforms_for(rows: int, generators: list[tuple[int, torch.Generator]], device) -> torch.Tensor:
    """One uniform per row: unseeded rows in one call, seeded rows from their own generator."""
    from pagoda.gpu_worker.runner.sampler import _uniforms
    return _uniforms(rows, generators, device)


# ---- the draft model --------------------------------------------------------------------------

class DraftModel:
    """A small model of the target's tokenizer that proposes k tokens per speculating row.

    Its KV pool mirrors the target's block ids. Every step it first runs over what the target
    runs (prefill chunks, and each speculating row's pending token), so its KV keeps up with
    the target's, then k - 1 more single-token steps over the speculating rows. Per row it
    tracks how far its own KV is written (`computed`): after a step it is cut back to the
    target's accepted length, and a row whose k drafts were all accepted catches up on the
    last one in its next step.
    """

    def __init__(self, path: str, target_vocab: int, device: torch.device, dtype: torch.dtype,
                 block_size: int, write_fn, attend_fn, model_impl: str = "auto"):
        from pagoda.gpu_worker.models.parallel import Shard
        from pagoda.gpu_worker.runner.loader import load_hf_config, load_model, resolve_model
        self.path = resolve_model(path)
        self.hf_config = load_hf_config(self.path)
        vocab = int(self.hf_config.vocab_size)
        if vocab != target_vocab:
            raise ValueError(f"speculative_config.model: the draft's vocabulary has {vocab} tokens, the "
                             f"target's {target_vocab} (a draft must share the target's tokenizer)")
        self.device, self.block_size = device, block_size
        self.model: Any = cast(Any, load_model(self.path, self.hf_config, device, dtype, Shard(0, 1),
                                               model_impl=model_impl))
        self.write_fn, self.attend_fn = write_fn, attend_fn
        attn = self.model.attention_layers()[0]
        self.num_layers = len(self.model.attention_layers())
        self.num_kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim
        self.dtype = dtype
        self.computed: dict[str, int] = {}      # req id -> positions whose draft KV is written

    def bytes_per_block(self, kv_dtype: torch.dtype) -> int:
        elem = torch.empty(0, dtype=kv_dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    def bind(self, num_blocks: int, kv_dtype: torch.dtype) -> None:
        from pagoda.kernels.reference import new_kv_cache
        shape = (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        for layer in self.model.attention_layers():
            layer.bind(new_kv_cache(*shape, dtype=kv_dtype, device=self.device),
                       new_kv_cache(*shape, dtype=kv_dtype, device=self.device), self.write_fn, self.attend_fn)

    def forget(self, req_ids) -> None:
        for r in req_ids:
            self.computed.pop(r, None)

    def _forward(self, spans: list[tuple[np.ndarray, int, np.ndarray, np.ndarray]], want_logits: list[int]):
        """spans: (token ids, first position, block table, row) per sequence; logits of the
        last position of the sequences in want_logits (indices into spans)."""
        from pagoda.gpu_worker.models.attention import AttentionMetadata
        bs = self.block_size
        ids = np.concatenate([s[0] for s in spans])
        lens = np.array([len(s[0]) for s in spans], np.int64)
        first = np.array([s[1] for s in spans], np.int64)
        pos = np.concatenate([np.arange(f, f + n) for f, n in zip(first, lens)])
        seq = np.repeat(np.arange(len(spans)), lens)
        mb = int(-(-(first + lens).max() // bs))
        tables = np.zeros((len(spans), mb), np.int32)
        for i, s in enumerate(spans):
            nb = min(mb, len(s[2]))
            tables[i, :nb] = s[2][:nb]
        slots = tables[seq, pos // bs].astype(np.int64) * bs + pos % bs
        cu = np.cumsum(lens)
        dev = self.device

        def t(a, dtype):
            return torch.from_numpy(np.ascontiguousarray(a)).to(device=dev, dtype=dtype)

        meta = AttentionMetadata(slot_mapping=t(slots, torch.int64), block_tables=t(tables, torch.int32),
                                 seq_lens=t(first + lens, torch.int32),
                                 query_start_loc=t(np.concatenate([[0], cu]), torch.int32),
                                 max_seq_len=int((first + lens).max()))
        hidden = self.model(t(ids, torch.int64), t(pos, torch.int64), meta)
        if not want_logits:
            return None
        return self.model.compute_logits(hidden[t(cu[want_logits] - 1, torch.int64)]).float()

    @torch.inference_mode()
    def propose(self, batch, scheduled, spec_index: list[int], sampling: Optional["SamplingBatch"],
                probs_fn) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """Draft k_s tokens for each scheduled request at spec_index (into scheduled); writes
        them into the batch's token rows. Returns (draft ids [sum k], their distributions
        [sum k, V]). sampling: the speculating rows' parameters, one row per sequence; probs_fn:
        the sampler's (logits, batch) -> distribution."""
        spans = []
        for s in scheduled:
            row = batch.row_of[s.req_id]
            end = s.start_pos + s.num_tokens - len(s.spec_token_ids)   # the target's known tokens
            begin = min(self.computed.get(s.req_id, s.start_pos), s.start_pos)
            toks = batch.token_ids[row, begin:end]
            spans.append((toks, begin, batch.block_table[row, :batch.num_blocks[row]], row))
            self.computed[s.req_id] = end
        if not spec_index:      # nothing drafts this step: the draft's KV keeps up all the same
            self._forward(spans, [])
            return None
        spec = [scheduled[i] for i in spec_index]
        ks = np.array([len(s.spec_token_ids) for s in spec], np.int64)
        rows = [batch.row_of[s.req_id] for s in spec]
        logits = self._forward(spans, spec_index)
        assert sampling is not None
        drafts: list[list[int]] = [[] for _ in spec]
        dists: list[list[torch.Tensor]] = [[] for _ in spec]
        live = list(range(len(spec)))
        for j in range(int(ks.max()) if len(ks) else 0):
            assert logits is not None
            p = probs_fn(logits, _subset(sampling, live))
            gens = dict(sampling.generators)
            u = uniforms_for(len(live), [(n, gens[i]) for n, i in enumerate(live) if i in gens], p.device)
            cdf = p.cumsum(dim=1)
            tok = torch.searchsorted(cdf, u[:, None] * cdf[:, -1:], right=True).squeeze(1).clamp(max=p.shape[1] - 1)
            tok_host = tok.cpu().tolist()
            for n, i in enumerate(live):
                drafts[i].append(tok_host[n])
                dists[i].append(p[n])
            live = [i for i in live if len(drafts[i]) < ks[i]]
            if not live:
                break
            # One more token for the rows that draft further, at the position after the last.
            step_spans = []
            for i in live:
                s = spec[i]
                row = rows[i]
                at = s.start_pos + len(drafts[i])
                step_spans.append((np.array([drafts[i][-1]], np.int64), at,
                                   batch.block_table[row, :batch.num_blocks[row]], row))
                self.computed[s.req_id] = at + 1
            logits = self._forward(step_spans, list(range(len(live))))
        for i, s in enumerate(spec):
            row, p0 = rows[i], s.start_pos + 1
            batch.token_ids[row, p0:p0 + len(drafts[i])] = drafts[i]
            s.spec_token_ids[:] = drafts[i]
        ids = torch.tensor([t for d in drafts for t in d], dtype=torch.int64, device=self.device)
        return ids, torch.stack([q for d in dists for q in d])

    def rollback(self, req_id: str, num_computed: int) -> None:
        if req_id in self.computed:
            self.computed[req_id] = min(self.computed[req_id], num_computed)


def _subset(b: "SamplingBatch", idx: list[int]) -> "SamplingBatch":
    """The sampling batch restricted to rows idx (speculating rows use no sparse extras but
    logit_bias, which is re-indexed)."""
    import dataclasses
    if idx == list(range(len(b.temperature))):
        return b
    t = torch.tensor(idx, dtype=torch.int64, device=b.temperature.device)
    temp = b.temperature[t]
    greedy = temp == 0
    out = dataclasses.replace(
        b, temperature=temp, top_p=b.top_p[t], top_k=b.top_k[t], min_p=b.min_p[t],
        greedy=greedy if b.greedy is not None else None,
        generators=[(idx.index(i), g) for i, g in b.generators if i in idx])
    if b.logit_bias is not None:
        rows, ids, vals = b.logit_bias
        pos = {i: n for n, i in enumerate(idx)}
        keep = [n for n, r in enumerate(rows.tolist()) if r in pos]
        k = torch.tensor(keep, dtype=torch.int64, device=rows.device)
        out.logit_bias = (torch.tensor([pos[r] for r in rows[k].tolist()], dtype=torch.int64,
                                       device=rows.device), ids[k], vals[k])
    return out
