"""The runner's persistent batch: one row per running request, kept between steps.

Rows live in preallocated numpy arrays (token ids, progress, block table, sampling
parameters); rows [0, num_reqs) are in use, and a leaving request's row is filled by the
last one, so the used rows stay a dense prefix. A step brings only what changed (new
requests, new block ids, departures); the runner appends the tokens it samples itself.

A sampled token takes its row's next place as soon as its step is launched, as a placeholder
(mark_sampled), and lands when the step's tokens reach the host (fill_sampled). A step built
meanwhile (async scheduling) reads that token from the device: prepare returns the pairs
(input position, index in the previous draw) that the runner fills in before the forward.

Step inputs are built with vectorised numpy into fixed staging buffers (pinned on CUDA, two
sets used in turn, since a step is built while the previous one's copy may still be pending)
and copied to the device once, into fixed device buffers of which a step uses a prefix:
shapes that CUDA graphs can capture later.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from pagoda.gpu_worker.core.outputs import NewRequest, ScheduledRequest, SchedulerOutput
from pagoda.gpu_worker.core.sampling_params import MAX_STOP_STRINGS
from pagoda.gpu_worker.core.stop import check_stop_batch, stop_token_ids
from pagoda.gpu_worker.models.attention import AttentionMetadata
from pagoda.gpu_worker.runner.sampler import SamplingBatch

# Columns of the per-row float parameter table; gathered and copied in one piece per step.
TEMPERATURE, TOP_P, TOP_K, MIN_P, REPETITION, PRESENCE, FREQUENCY = range(7)
NUM_PARAMS = 7


@dataclass
class StepInputs:
    input_ids: torch.Tensor         # [T] on the device
    positions: torch.Tensor         # [T]
    meta: AttentionMetadata
    logits_indices: torch.Tensor    # [B]: the token rows whose logits are sampled
    sample_rows: np.ndarray         # [B]: the batch rows that sample, in logits order
    req_ids: list[str]              # [B]: their request ids
    # (positions in input_ids, indices into the previous step's draw) of tokens still in
    # flight; None when every input token is known on the host.
    in_flight: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    prompt_scores: Optional[PromptScores] = None
    # [B]: drafts each sampling request verifies (speculative decoding; its logits rows are
    # 1 + that many, in order); None when no request has any.
    num_drafts: Optional[np.ndarray] = None
    # [T]: each token row's LoRA adapter slot (-1: none); None when no row has an adapter.
    lora_slots: Optional[np.ndarray] = None


@dataclass
class PromptScores:
    """Prompt tokens a step scores (prompt_logprobs): the logits of token row r score the prompt
    token after it. Their logits follow the sampling rows' (StepInputs.logits_indices first)."""
    spans: list[tuple[str, int, int, int]]   # (request id, first position, positions, top-k)
    token_rows: torch.Tensor                 # [P] on the device: rows of input_ids
    targets: np.ndarray                      # [P]: the prompt token each row scores
    targets_dev: torch.Tensor                # the same on the device


class InputBatch:
    def __init__(self, max_num_seqs: int, max_model_len: int, max_num_tokens: int, block_size: int,
                 vocab_size: int, eos_token_ids: list[int], device: torch.device, max_drafts: int = 0):
        self.max_rows, self.max_len, self.block_size = max_num_seqs, max_model_len, block_size
        self.vocab_size, self.device = vocab_size, device
        self.eos = list(eos_token_ids)
        self.max_blocks = -(-max_model_len // block_size)
        r = max_num_seqs
        self.req_ids: list[str] = []
        self.row_of: dict[str, int] = {}
        # + 1: a prompt of max_model_len tokens still samples one.
        self.token_ids = np.zeros((r, max_model_len + 1), np.int64)
        self.num_tokens = np.zeros(r, np.int64)         # known tokens
        self.num_computed = np.zeros(r, np.int64)       # tokens whose KV is written
        self.num_prompt = np.zeros(r, np.int64)
        self.block_table = np.zeros((r, self.max_blocks), np.int32)
        self.num_blocks = np.zeros(r, np.int64)
        # The row's newest placeholder: its index in the last launched draw (-1: none in
        # flight) and its position.
        self.pending_src = np.full(r, -1, np.int64)
        self.pending_pos = np.zeros(r, np.int64)
        self.params = np.zeros((r, NUM_PARAMS), np.float32)
        self.min_tokens = np.zeros(r, np.int64)
        self.max_tokens = np.zeros(r, np.int64)
        self.num_logprobs = np.full(r, -1, np.int64)   # -1: none wanted
        self.num_prompt_logprobs = np.full(r, -1, np.int64)   # -1: no prompt tokens to score
        # Tokens that min_tokens holds back (stop ids, EOS unless ignored); -1 pads.
        self.stop_ids = np.full((r, MAX_STOP_STRINGS + len(self.eos)), -1, np.int64)
        self.generators: dict[int, torch.Generator] = {}
        self.grammars: dict[int, Any] = {}              # row -> structured_output.GrammarState
        self.logit_bias: dict[int, tuple[list[int], list[float]]] = {}
        # Multi-LoRA: each row's adapter slot (-1: base model), from lora_slot_for(adapter, the
        # slots rows already use) when the row is added; None: no adapters.
        self.lora_slot = np.full(r, -1, np.int64)
        self.lora_slot_for: Any = None
        self.lora_rows = 0            # rows with an adapter
        self._alloc_buffers(max_num_tokens, max_drafts)

    def _alloc_buffers(self, max_tokens: int, max_drafts: int = 0) -> None:
        pin = self.device.type == "cuda"
        r, mb = self.max_rows, self.max_blocks

        def host(n: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(n, dtype=dtype, pin_memory=pin)

        # One int64 staging area: ids | positions | slots | logits indices | in-flight
        # positions | their draw indices; one int32 area: query_start_loc | seq_lens | block
        # table. Two copies per step.
        # Logits rows: one per sampling request, 1 + its drafts when speculating.
        logit_rows = max(r, min(max_tokens, r * (1 + max_drafts)))
        self._i64_sizes = (max_tokens, max_tokens, max_tokens, logit_rows, r, r)
        self._i32_sizes = (r + 1, r, r * mb)
        # On CUDA two host sets in turn: a step's pinned inputs must not change before its copy
        # has run, and the next step is built while it may still be queued. On a CPU the
        # staging buffers are the inputs themselves, and a step has run when launch returns.
        self._stages = [tuple(host(n, dt) for n, dt in ((sum(self._i64_sizes), torch.int64),
                                                         (sum(self._i32_sizes), torch.int32),
                                                         (r * NUM_PARAMS, torch.float32)))
                        for _ in range(2 if pin else 1)]
        self._stage = 0
        if pin:
            self.dev_i64, self.dev_i32, self.dev_params = (torch.zeros_like(h, device=self.device)
                                                           for h in self._stages[0])
        self._use_stage(0)

    def _use_stage(self, i: int) -> None:
        self._stage = i
        self.host_i64, self.host_i32, self.host_params = self._stages[i]
        if self.device.type != "cuda":
            self.dev_i64, self.dev_i32, self.dev_params = self._stages[i]
        self.np_i64, self.np_i32 = self.host_i64.numpy(), self.host_i32.numpy()
        self.np_params = self.host_params.numpy()

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    # ---- rows in and out ------------------------------------------------------------------

    def update(self, out: SchedulerOutput) -> None:
        for rid in out.finished_req_ids:
            self._remove(rid)
        for new in out.new:
            self._add(new)
        for s in out.scheduled:
            if s.new_block_ids:
                row = self.row_of[s.req_id]
                n = int(self.num_blocks[row])
                self.block_table[row, n:n + len(s.new_block_ids)] = s.new_block_ids
                self.num_blocks[row] = n + len(s.new_block_ids)
            if s.spec_token_ids:
                # Drafts sit after the known tokens, uncounted, until verification lands.
                row = self.row_of[s.req_id]
                n = int(self.num_tokens[row])
                self.token_ids[row, n:n + len(s.spec_token_ids)] = s.spec_token_ids

    def _add(self, new: NewRequest) -> None:
        if new.req_id in self.row_of:
            self._remove(new.req_id)
        if self.num_reqs >= self.max_rows:
            raise ValueError(f"max_num_seqs: the batch already holds {self.max_rows} requests")
        row = self.num_reqs
        self.req_ids.append(new.req_id)
        self.row_of[new.req_id] = row
        n = len(new.token_ids)
        self.token_ids[row, :n] = new.token_ids
        self.num_tokens[row], self.num_prompt[row], self.num_computed[row] = n, new.num_prompt_tokens, 0
        nb = len(new.block_ids)
        self.block_table[row, :nb] = new.block_ids
        self.num_blocks[row] = nb
        self.pending_src[row] = -1
        self.num_prompt_logprobs[row] = new.prompt_logprobs
        self.lora_slot[row] = -1
        if new.lora is not None:
            if self.lora_slot_for is None:
                raise ValueError("adapter: this runner serves no adapters")
            self.lora_slot[row] = self.lora_slot_for(new.lora, self.lora_slot[:row])
            self.lora_rows += 1
        p = new.sampling_params
        if p is None:       # a profiling row: greedy, nothing else
            self.params[row] = (0.0, 1.0, self.vocab_size, 0.0, 1.0, 0.0, 0.0)
            self.min_tokens[row], self.num_logprobs[row] = 0, -1
            self.max_tokens[row] = self.max_len + 1
            self.stop_ids[row] = -1
            return
        top_k = p.top_k if 0 < p.top_k < self.vocab_size else self.vocab_size
        self.params[row] = (p.temperature, p.top_p, top_k, p.min_p, p.repetition_penalty,
                            p.presence_penalty, p.frequency_penalty)
        self.min_tokens[row], self.max_tokens[row] = p.min_tokens, p.max_tokens
        self.num_logprobs[row] = -1 if p.logprobs is None else p.logprobs
        stops = stop_token_ids(p.stop_token_ids, p.ignore_eos, self.eos)
        self.stop_ids[row] = -1
        self.stop_ids[row, :len(stops)] = stops
        if new.generator is not None and p.temperature != 0.0:
            self.generators[row] = new.generator
        if new.grammar is not None:
            self.grammars[row] = new.grammar
        if p.logit_bias:
            self.logit_bias[row] = (list(p.logit_bias), [float(v) for v in p.logit_bias.values()])

    def _remove(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is None:
            return
        last = self.num_reqs - 1
        if self.lora_slot[row] >= 0:
            self.lora_rows -= 1
        extras: tuple[dict[int, Any], ...] = (self.generators, self.grammars, self.logit_bias)
        for extra in extras:
            extra.pop(row, None)
        if row != last:
            # The last row fills the hole, so that rows stay a dense prefix.
            moved = self.req_ids[last]
            n = int(self.num_tokens[last])
            self.token_ids[row, :n] = self.token_ids[last, :n]
            nb = int(self.num_blocks[last])
            self.block_table[row, :nb] = self.block_table[last, :nb]
            for a in (self.num_tokens, self.num_computed, self.num_prompt, self.num_blocks, self.pending_src,
                      self.pending_pos, self.params, self.min_tokens, self.max_tokens, self.num_logprobs,
                      self.num_prompt_logprobs, self.stop_ids, self.lora_slot):
                a[row] = a[last]
            for extra in extras:
                if last in extra:
                    extra[row] = extra.pop(last)
            self.req_ids[row] = moved
            self.row_of[moved] = row
        self.req_ids.pop()

    # ---- one step ----------------------------------------------------------------------------

    def prepare(self, scheduled: list[ScheduledRequest]) -> StepInputs:
        """Flatten a step (in the scheduler's order) into device tensors, with vectorised numpy."""
        if len(self._stages) > 1:
            self._use_stage(1 - self._stage)
        s = len(scheduled)
        rows = np.fromiter((self.row_of[x.req_id] for x in scheduled), np.int64, s)
        n = np.fromiter((x.num_tokens for x in scheduled), np.int64, s)
        start = np.fromiter((x.start_pos for x in scheduled), np.int64, s)
        self.num_computed[rows] = start
        seq_lens = start + n
        drafts = None
        if any(x.spec_token_ids for x in scheduled):
            drafts = np.fromiter((len(x.spec_token_ids) for x in scheduled), np.int64, s)
        bs = self.block_size
        short = seq_lens > self.num_blocks[rows] * bs
        if short.any():
            i = int(np.argmax(short))
            raise ValueError(f"block_ids: request {scheduled[i].req_id} needs {-(-int(seq_lens[i]) // bs)} "
                             f"blocks for {int(seq_lens[i])} tokens, has {int(self.num_blocks[rows[i]])}")
        cu = np.cumsum(n)
        t = int(cu[-1])
        seq_of = np.repeat(np.arange(s), n)
        pos = start[seq_of] + np.arange(t) - (cu - n)[seq_of]
        row_of_tok = rows[seq_of]
        sample = (seq_lens if drafts is None else seq_lens - drafts) == self.num_tokens[rows]
        sample_seq = np.flatnonzero(sample)
        b = len(sample_seq)
        if drafts is not None:
            k = drafts[sample_seq]
            logit_ends = np.repeat(cu[sample_seq], k + 1)
            within = np.arange(int(k.sum()) + b) - np.repeat(np.cumsum(k + 1) - (k + 1), k + 1)
            logit_idx = logit_ends - np.repeat(k + 1, k + 1) + within
        else:
            logit_idx = cu[sample_seq] - 1
        nl = len(logit_idx)
        mb = int(-(-seq_lens.max() // bs))

        # A row with a token in flight computes just that token (it sampled last step).
        src = self.pending_src[rows]
        waiting_for = np.flatnonzero(src >= 0)
        f = len(waiting_for)
        if f and ((n[waiting_for] != 1).any() or (start[waiting_for] != self.pending_pos[rows[waiting_for]]).any()):
            raise ValueError("scheduled: a request with a token in flight must compute exactly that token")

        i64, (o_ids, o_pos, o_slot, o_lg, o_fd, o_fs) = self.np_i64, np.cumsum((0,) + self._i64_sizes[:-1])
        i64[o_ids:o_ids + t] = self.token_ids[row_of_tok, pos]
        i64[o_pos:o_pos + t] = pos
        i64[o_slot:o_slot + t] = self.block_table[row_of_tok, pos // bs].astype(np.int64) * bs + pos % bs
        i64[o_lg:o_lg + nl] = logit_idx
        i64[o_fd:o_fd + f] = cu[waiting_for] - 1
        i64[o_fs:o_fs + f] = src[waiting_for]
        i32, (o_qsl, o_len, o_bt) = self.np_i32, np.cumsum((0,) + self._i32_sizes[:-1])
        i32[o_qsl] = 0
        i32[o_qsl + 1:o_qsl + 1 + s] = cu
        i32[o_len:o_len + s] = seq_lens
        i32[o_bt:o_bt + s * mb] = self.block_table[rows, :mb].reshape(-1)
        scores = self._prompt_scores(scheduled, rows, start, n, cu) if (self.num_prompt_logprobs[rows] >= 0).any() \
            else None
        d64, d32 = self._to_device(self.dev_i64, self.host_i64, o_fs + f), \
            self._to_device(self.dev_i32, self.host_i32, o_bt + s * mb)
        # Advance progress now: this step's KV is written by the forward that follows.
        self.num_computed[rows] = seq_lens
        meta = AttentionMetadata(slot_mapping=d64[o_slot:o_slot + t],
                                 block_tables=d32[o_bt:o_bt + s * mb].view(s, mb),
                                 seq_lens=d32[o_len:o_len + s], query_start_loc=d32[o_qsl:o_qsl + s + 1],
                                 max_seq_len=int(seq_lens.max()))
        return StepInputs(d64[o_ids:o_ids + t], d64[o_pos:o_pos + t], meta, d64[o_lg:o_lg + nl],
                          rows[sample_seq], [scheduled[i].req_id for i in sample_seq],
                          (d64[o_fd:o_fd + f], d64[o_fs:o_fs + f]) if f else None, scores,
                          drafts[sample_seq] if drafts is not None else None,
                          self.lora_slot[row_of_tok] if self.lora_rows else None)

    def _prompt_scores(self, scheduled: list[ScheduledRequest], rows: np.ndarray, start: np.ndarray,
                       n: np.ndarray, cu: np.ndarray) -> Optional[PromptScores]:
        """The positions p of this step whose next token is a prompt token of a row that scores
        its prompt: the logits at p give that token's log-probability."""
        spans, token_rows, targets = [], [], []
        for i in np.flatnonzero(self.num_prompt_logprobs[rows] >= 0).tolist():
            row, first = int(rows[i]), int(start[i])
            end = min(first + int(n[i]), int(self.num_prompt[row]) - 1)
            if end <= first:
                continue
            at = int(cu[i] - n[i])
            spans.append((scheduled[i].req_id, first, end - first, int(self.num_prompt_logprobs[row])))
            token_rows.append(np.arange(at, at + end - first))
            targets.append(self.token_ids[row, first + 1:end + 1])
        if not spans:
            return None
        tgt = np.concatenate(targets)
        return PromptScores(spans, self._upload(np.concatenate(token_rows)), tgt, self._upload(tgt))

    def _upload(self, a: np.ndarray) -> torch.Tensor:
        """A small host array on the device, pinned and non-blocking on CUDA: a plain copy would
        wait for the step in flight, which async scheduling must not."""
        t = torch.from_numpy(np.ascontiguousarray(a))
        return t.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else t

    def _to_device(self, dev: torch.Tensor, host: torch.Tensor, n: int) -> torch.Tensor:
        if dev is not host:
            dev[:n].copy_(host[:n], non_blocking=True)
        return dev

    def mark_sampled(self, rows: np.ndarray) -> np.ndarray:
        """A launched step's sampling rows (in draw order) each gain a placeholder token;
        returns the placeholders' positions."""
        positions = self.num_tokens[rows].copy()
        self.pending_src[rows] = np.arange(len(rows))
        self.pending_pos[rows] = positions
        self.num_tokens[rows] += 1
        return positions

    def fill_sampled(self, req_ids: list[str], positions: np.ndarray, tokens: list[int]) -> np.ndarray:
        """A step's tokens land at their placeholders; returns finish_flags per token (core/stop.py:
        STOP_TOKEN, LENGTH), the stop-token and length checks for the whole batch at once. A
        request whose row has left meanwhile (it ended) gets 0: its token is dropped."""
        row_of = self.row_of
        rows = np.fromiter((row_of.get(r, -1) for r in req_ids), np.int64, len(req_ids))
        flags = np.zeros(len(req_ids), np.int64)
        live = np.flatnonzero(rows >= 0)
        if len(live) < len(rows):
            rows, positions = rows[live], positions[live]
        sampled = np.asarray(tokens, dtype=np.int64)[live]
        self.token_ids[rows, positions] = sampled
        landed = self.pending_pos[rows] == positions
        self.pending_src[rows[landed]] = -1
        num_tokens = positions + 1
        flags[live] = check_stop_batch(sampled, num_tokens, num_tokens - self.num_prompt[rows], self.stop_ids[rows],
                                       self.min_tokens[rows], self.max_tokens[rows], self.max_len)
        return flags

    def fill_speculated(self, req_ids: list[str], emitted: list[list[int]]) -> tuple[list[list[int]], list[int]]:
        """A verified step's tokens (accepted drafts, then the one drawn) land after each row's
        known tokens. Each is checked as fill_sampled checks one, and the list is cut after the
        first that ends the request. The row's KV is valid up to the token before the last
        (num_computed), and its block table keeps only the blocks that KV needs: the
        scheduler frees the rest (KVCacheManager.truncate). Returns (tokens, finish flags)."""
        out, flags = [], []
        bs = self.block_size
        for rid, toks in zip(req_ids, emitted):
            row = self.row_of[rid]
            first = int(self.num_tokens[row])
            t = np.asarray(toks, np.int64)
            num_tokens = first + 1 + np.arange(len(t))
            f = check_stop_batch(t, num_tokens, num_tokens - self.num_prompt[row], self.stop_ids[row][None, :],
                                 self.min_tokens[row], self.max_tokens[row], self.max_len)
            ends = np.flatnonzero(f)
            m = int(ends[0]) + 1 if len(ends) else len(t)
            self.token_ids[row, first:first + m] = t[:m]
            self.num_tokens[row] = first + m
            self.num_computed[row] = first + m - 1
            self.num_blocks[row] = min(int(self.num_blocks[row]), -(-(first + m - 1) // bs))
            out.append(toks[:m])
            flags.append(int(f[m - 1]))
        return out, flags

    # ---- sampling inputs ---------------------------------------------------------------------

    def sampling_batch(self, rows: np.ndarray, last_draw: Optional[torch.Tensor] = None,
                       staged: bool = True) -> SamplingBatch:
        """The sampler's view of the sampling rows: parameters in one device copy, and the
        sparse extras (seeds, logit_bias, min_tokens, penalties) only for rows that use them.
        last_draw: the previous step's tokens on the device, for rows whose token is in flight."""
        b = len(rows)
        p = self.params[rows]
        if staged:
            self.np_params[:b * NUM_PARAMS] = p.reshape(-1)
            dev = self._to_device(self.dev_params, self.host_params, b * NUM_PARAMS)[:b * NUM_PARAMS].view(b, NUM_PARAMS)
        else:   # a second batch in one step (speculative decoding): its own copy, not the staging area
            dev = torch.from_numpy(np.ascontiguousarray(p)).to(self.device)
        greedy = p[:, TEMPERATURE] == 0.0
        batch = SamplingBatch(
            temperature=dev[:, TEMPERATURE], top_p=dev[:, TOP_P], top_k=dev[:, TOP_K], min_p=dev[:, MIN_P],
            all_greedy=bool(greedy.all()), any_greedy=bool(greedy.any()),
            greedy=None if greedy.all() or not greedy.any() else self._upload(greedy),
            top_k_max=int(p[:, TOP_K].max()) if (p[:, TOP_K] < self.vocab_size).any() else 0,
            any_top_p=bool((p[:, TOP_P] < 1.0).any()), any_min_p=bool((p[:, MIN_P] > 0).any()),
            all_top_k=bool((p[:, TOP_K] < self.vocab_size).all()),
            generators=[(i, self.generators[r]) for i, r in enumerate(rows.tolist()) if r in self.generators]
            if self.generators else [])
        out_len = self.num_tokens[rows] - self.num_prompt[rows]
        held = np.flatnonzero(out_len < self.min_tokens[rows])
        if len(held):
            ids = self.stop_ids[rows[held]]
            i, j = np.nonzero(ids >= 0)
            batch.min_tokens_mask = (self._upload(held[i]), self._upload(ids[i, j]))
        if self.logit_bias:
            batch.logit_bias = self._logit_bias(rows)
        pen = np.flatnonzero((p[:, REPETITION] != 1.0) | (p[:, PRESENCE] != 0.0) | (p[:, FREQUENCY] != 0.0))
        if len(pen):
            batch.penalties = self._penalties(rows, pen, dev, last_draw)
        if self.grammars:
            states = [self.grammars.get(r) for r in rows.tolist()]
            if any(st is not None for st in states):
                batch.grammars = states
                batch.outputs = [self.token_ids[r, self.num_prompt[r]:self.num_tokens[r]].tolist()
                                 if st is not None else [] for r, st in zip(rows.tolist(), states)]
        k = self.num_logprobs[rows]
        if (k >= 0).any():
            batch.num_logprobs = k.tolist()
        return batch

    def _logit_bias(self, rows: np.ndarray) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        r, t, v = [], [], []
        for i, row in enumerate(rows.tolist()):
            if row in self.logit_bias:
                ids, vals = self.logit_bias[row]
                r.extend([i] * len(ids))
                t.extend(ids)
                v.extend(vals)
        if not r:
            return None
        return (self._upload(np.array(r, np.int64)), self._upload(np.array(t, np.int64)),
                self._upload(np.array(v, np.float32)))

    def _penalties(self, rows: np.ndarray, pen: np.ndarray, dev: torch.Tensor, last_draw: Optional[torch.Tensor]):
        """(batch indices, prompt+output presence [P, V] bool, output counts [P, V], params).
        A token still in flight is counted from last_draw on the device, not from its place."""
        prow = rows[pen]
        length = int(self.num_tokens[prow].max())
        toks = self.token_ids[prow, :length]
        col = np.arange(length)[None, :]
        flying = self.pending_src[prow] >= 0
        valid = (col < self.num_tokens[prow][:, None]) & ~(flying[:, None] & (col == self.pending_pos[prow][:, None]))
        is_out = valid & (col >= self.num_prompt[prow][:, None])
        v = self.vocab_size
        all_ids = self._upload(np.where(valid, toks, v))
        out_ids = self._upload(np.where(is_out, toks, v))
        ones = torch.ones(all_ids.shape, dtype=torch.float32, device=self.device)
        seen = torch.zeros(len(prow), v + 1, device=self.device).scatter_add_(1, all_ids, ones)[:, :v] > 0
        counts = torch.zeros(len(prow), v + 1, device=self.device).scatter_add_(1, out_ids, ones)[:, :v]
        if flying.any():
            if last_draw is None:
                raise RuntimeError("penalties: a token in flight needs the previous draw")
            i = np.flatnonzero(flying)
            at = (self._upload(i), last_draw[self._upload(self.pending_src[prow[i]])])
            counts.index_put_(at, torch.ones(len(i), device=self.device), accumulate=True)
            seen[at] = True
        idx = self._upload(pen)
        return idx, seen, counts, dev[idx][:, REPETITION:FREQUENCY + 1]
