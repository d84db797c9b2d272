"""Speculative decoding's draft model, run by the target's runner before the target's forward.

The draft model's KV lives in its own pool with the target's block ids (same block size, so
the target's block tables and slot mappings serve it): a request's blocks hold both models'
KV, and rolling back rejected tokens frees both at once. Its drafts, with the distributions
they were drawn from, go to the rejection sampler (gpu_worker/features/spec_decode.py).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, cast

import numpy as np
import torch

from pagoda.gpu_worker.models.attention import AttentionMetadata
from pagoda.gpu_worker.models.parallel import Shard
from pagoda.gpu_worker.runner.loader import load_hf_config, load_model, resolve_model
from pagoda.gpu_worker.runner.sampler import SamplingBatch, uniforms
from pagoda.kernels.reference import new_kv_cache


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
    def propose(self, batch, scheduled, spec_index: list[int], sampling: Optional[SamplingBatch],
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
            u = uniforms(len(live), [(n, gens[i]) for n, i in enumerate(live) if i in gens], p.device)
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


def _subset(b: SamplingBatch, idx: list[int]) -> SamplingBatch:
    """The sampling batch restricted to rows idx (speculating rows use no sparse extras but
    logit_bias, which is re-indexed)."""
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
