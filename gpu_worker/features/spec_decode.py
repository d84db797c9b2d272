"""Speculative decoding's rejection sampler: which drafted tokens a step keeps.

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

Who speculates and what n-gram lookup proposes is the scheduler's side
(gpu_worker/core/drafter.py); a draft model proposes in the runner (gpu_worker/runner/draft_model.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch


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
