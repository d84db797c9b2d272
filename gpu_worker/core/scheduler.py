"""Continuous batching: which requests run this step, and how many tokens each computes.

One token budget per step (max_num_batched_tokens), spent on running requests first, then
on waiting ones; long prompts are prefilled in chunks. When blocks run out a running
request is preempted by recompute: its blocks are freed and it goes back to the front of
the queue (its full blocks usually stay in the prefix cache, so recompute is cheap); in swap
mode its computed blocks are copied to the host tier instead and back when it resumes, with
recompute as the fallback when the host tier cannot take them. Under
the priority policy a waiting request that finds no blocks or sequence slot preempts running
requests of lower priority, lowest first.

A step may be scheduled while the previous one is still running (async scheduling): a request
whose token is in flight counts it as a placeholder (the runner feeds the sampled token in on
the device), is not scheduled again if that token must end it by length (nor, with a grammar,
before the token is back: its next mask depends on it), and keeps its runner row until the token
comes back, even when preempted, so that the token's stop checks still run.

Beams (gpu_worker/features/beam_search.py) run as requests whose step appends nothing: a ready beam sits
in `running` with its KV until its group forks it (`add_forked`). One that must make room leaves
the scheduler altogether (`_release`): its candidates are kept, only its KV is lost. A step in
which nothing could run while ready beams hold the sequence slots releases them, so that their
waiting siblings get in.
"""
from __future__ import annotations

import heapq
from collections import deque
from typing import Iterable

from pagoda.gpu_worker.core.drafter import Drafter, SpecStats
from pagoda.gpu_worker.core.kv_cache_manager import CachedBlock, KVCacheManager
from pagoda.gpu_worker.core.outputs import ModelRunnerOutput, NewRequest, ScheduledRequest, SchedulerOutput
from pagoda.gpu_worker.core.request import Request, RequestStatus
from pagoda.gpu_worker.core.stop import reaches_length


class WaitingQueue:
    """FCFS: a deque, preempted requests back at the front. Priority: a heap on
    (priority, arrival), so a preempted request regains its old place by itself."""

    def __init__(self, policy: str):
        self.policy = policy
        self._fcfs: deque[Request] = deque()
        self._heap: list[tuple[int, int, Request]] = []

    def __len__(self) -> int:
        return len(self._fcfs) if self.policy == "fcfs" else len(self._heap)

    def __iter__(self):
        if self.policy == "fcfs":
            return iter(list(self._fcfs))
        return iter([r for _, _, r in sorted(self._heap, key=lambda e: e[:2])])

    def add(self, req: Request, front: bool = False) -> None:
        if self.policy == "fcfs":
            self._fcfs.appendleft(req) if front else self._fcfs.append(req)
        else:
            heapq.heappush(self._heap, (req.priority, req.arrival, req))

    def peek(self) -> Request:
        return self._fcfs[0] if self.policy == "fcfs" else self._heap[0][2]

    def pop(self) -> Request:
        return self._fcfs.popleft() if self.policy == "fcfs" else heapq.heappop(self._heap)[2]

    def remove(self, req: Request) -> None:
        if self.policy == "fcfs":
            self._fcfs.remove(req)
        else:
            self._heap = [e for e in self._heap if e[2] is not req]
            heapq.heapify(self._heap)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 policy: str = "fcfs", max_model_len: int | None = None, drafter: Drafter | None = None,
                 max_loras: int = 0, preemption_mode: str = "recompute"):
        self.kv = kv
        # Multi-LoRA: at most this many distinct adapters hold runner rows at once (the device
        # has that many slots); 0: no adapters.
        self.max_loras = max_loras
        self.preemption_mode = preemption_mode
        self.num_swaps = 0
        # Speculative decoding: a decoding request may compute drafted tokens after its own.
        self.drafter = drafter
        self.drafts: dict[str, list[int]] = {}      # this step's drafts, per request
        self.spec_stats = SpecStats(accepted_per_pos=[0] * drafter.k) if drafter is not None else None
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy
        self.waiting = WaitingQueue(policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.finished_req_ids: set[str] = set()
        # Blocks of each running request that the runner has been told about: a step sends
        # only the ones added since. Absent: the runner holds no row for the request.
        self.blocks_sent: dict[str, int] = {}
        self.num_preemptions = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.num_prompt_tokens = 0

    def add_request(self, req: Request) -> None:
        self.requests[req.req_id] = req
        self.waiting.add(req)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        chunks: dict[str, int] = {}     # req_id -> tokens this step, in batch order
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(len(req.all_token_ids) + req.num_output_placeholders - req.num_computed_tokens, budget)
            if n < 1 or self._ends_in_flight(req) or (req.num_output_placeholders and req.waits_for_its_token):
                i += 1
                continue
            drafts = self.drafter.propose(req, budget - 1) if self.drafter is not None and n == 1 else []
            n += len(drafts)
            while self.kv.allocate_slots(req, n) is None:
                if drafts:      # no room for the drafts: decode plainly before preempting anyone
                    drafts, n = [], 1
                    continue
                victim = self._pick_victim()
                budget += chunks.pop(victim.req_id, 0)
                self.drafts.pop(victim.req_id, None)
                if self.running.index(victim) < i:
                    i -= 1
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                chunks[req.req_id] = n
                if drafts:
                    self.drafts[req.req_id] = drafts
                budget -= n
                i += 1
        # Admitting after a preemption would only take back the blocks just freed.
        if not preempted:
            budget = self._admit(budget, chunks)
        while not chunks and len(self.waiting):
            # Ready beams wait for siblings that cannot get in: they make room.
            ready = next((r for r in reversed(self.running) if r.beam_ready is not None), None)
            if ready is None:
                break
            self._release(ready)
            budget = self._admit(budget, chunks)
        return self._output(chunks)

    def add_forked(self, req: Request, num_computed: int) -> None:
        """A beam's child that already holds its parent's KV for num_computed tokens (the KV
        manager's fork): it runs from the next step on."""
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = num_computed
        self.requests[req.req_id] = req
        self.running.append(req)

    def _release(self, req: Request) -> None:
        """A ready beam leaves the scheduler: its blocks and runner row go, its candidates stay
        with its group (which will continue it, or not, by recompute)."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self.requests.pop(req.req_id, None)
        self.kv.free(req)
        self.blocks_sent.pop(req.req_id, None)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        self.num_preemptions += 1
        if not req.num_output_placeholders:
            self.finished_req_ids.add(req.req_id)

    def _admit(self, budget: int, chunks: dict[str, int]) -> int:
        skipped: list[Request] = []
        try:
            return self._admit_waiting(budget, chunks, skipped)
        finally:
            for req in reversed(skipped):       # back in their places, ahead of the rest
                self.waiting.add(req, front=True)

    def _admit_waiting(self, budget: int, chunks: dict[str, int], skipped: list[Request]) -> int:
        adapters: set | None = None
        while len(self.waiting) and budget > 0:
            req = self.waiting.peek()
            if req.num_output_placeholders:
                break   # preempted with its token still in flight: back once it has landed
            if req.beam_width and len(self.running) + req.beam_width > self.max_num_seqs:
                break   # a new beam search fans out to beam_width sequences: room for all of them
            if req.lora is not None and self.max_loras:
                if adapters is None:
                    adapters = self._adapters_in_batch()
                if req.lora not in adapters and len(adapters) >= self.max_loras:
                    # Every adapter slot is taken by running requests: this one waits for a slot
                    # to free, the requests behind it go on (as vLLM's scheduler does).
                    skipped.append(self.waiting.pop())
                    continue
            swapped = self.kv.is_swapped(req)
            hits: list[CachedBlock] = []
            if swapped:
                num_hit = req.num_computed_tokens
            else:
                hits, num_hit = self.kv.get_computed_blocks(req)
            n = min(req.num_tokens - num_hit, budget)
            if len(self.running) >= self.max_num_seqs or (
                    self.kv.swap_in(req, n) if swapped else self.kv.allocate_slots(req, n, hits)) is None:
                # Under the priority policy a better request takes the place of a worse one.
                victim = self._worse_running(req)
                if victim is None:
                    break
                budget += chunks.pop(victim.req_id, 0)
                self.drafts.pop(victim.req_id, None)
                self._preempt(victim)
                continue
            self.waiting.pop()
            req.num_computed_tokens = num_hit
            req.status = RequestStatus.RUNNING
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
            if not swapped:
                self.prefix_cache_queries += req.num_tokens
                self.prefix_cache_hits += num_hit
            self.running.append(req)
            chunks[req.req_id] = n
            budget -= n
            if adapters is not None and req.lora is not None:
                adapters.add(req.lora)
        return budget

    def _adapters_in_batch(self) -> set:
        """Adapters of the requests that hold runner rows: running ones, and preempted ones whose
        token is still in flight."""
        held = {r.lora for r in self.running if r.lora is not None}
        held |= {r.lora for r in self.waiting if r.lora is not None and r.num_output_placeholders}
        return held

    def _ends_in_flight(self, req: Request) -> bool:
        """The token in flight ends the request by length (core/stop.py): a further step would
        compute past the request's end."""
        if not req.num_output_placeholders:
            return False
        after = req.num_output_placeholders
        return reaches_length(req.num_tokens + after, req.num_output_tokens + after, req.params.max_tokens,
                              self.max_model_len)

    def _worse_running(self, req: Request):
        """The running request of strictly lower priority than req (the lowest), if any."""
        if self.policy != "priority" or not self.running:
            return None
        victim = self._pick_victim()
        return victim if victim.priority > req.priority else None

    def _pick_victim(self) -> Request:
        if self.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival))
        return self.running[-1]

    def _preempt(self, req: Request) -> None:
        if req.beam_ready is not None:
            return self._release(req)
        self.running.remove(req)
        if self.preemption_mode == "swap" and self.kv.swap_out(req):
            self.num_swaps += 1     # its KV comes back from the host: num_computed_tokens stands
        else:
            self.kv.free(req)
            req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        self.blocks_sent.pop(req.req_id, None)
        if not req.num_output_placeholders:     # else when its token lands (update_from_output)
            self.finished_req_ids.add(req.req_id)
        self.waiting.add(req, front=True)

    def _output(self, chunks: dict[str, int]) -> SchedulerOutput:
        scheduled, new = [], []
        requests, req_blocks, blocks_sent = self.requests, self.kv.req_to_blocks, self.blocks_sent
        drafts, self.drafts = self.drafts, {}
        for req_id, n in chunks.items():     # once per request per step: kept lean
            req = requests[req_id]
            start = req.num_computed_tokens
            prompt = len(req.prompt_token_ids)
            if start < prompt:
                self.num_prompt_tokens += min(start + n, prompt) - start
            blocks = req_blocks[req_id]
            sent = blocks_sent.get(req_id)
            if sent is None:
                new.append(NewRequest(req_id, list(req.all_token_ids), prompt, req.params,
                                      [b.block_id for b in blocks], req.generator, req.grammar,
                                      (req.params.prompt_logprobs or 0) if req.prompt_logprobs_pending() else -1,
                                      req.lora))
                sent = len(blocks)
            if len(blocks) > sent:
                added = [b.block_id for b in blocks[sent:]]
                blocks_sent[req_id] = len(blocks)
            else:
                added = []
                blocks_sent[req_id] = sent
            end = start + n
            spec = drafts.get(req_id) if drafts else None
            if spec:
                scheduled.append(ScheduledRequest(req_id, n, start, True, added, spec))
                req.num_computed_tokens = end
                req.num_output_placeholders += 1
                continue
            sample = end == len(req.all_token_ids) + req.num_output_placeholders
            scheduled.append(ScheduledRequest(req_id, n, start, sample, added))
            # Progress counts from now: the next step may be scheduled before this one returns.
            req.num_computed_tokens = end
            if sample:
                req.num_output_placeholders += 1
        out = SchedulerOutput(scheduled=scheduled, new=new, finished_req_ids=self.finished_req_ids,
                              block_copies=self.kv.take_copies(), kv_copies=self.kv.take_tier_copies())
        self.finished_req_ids = set()
        return out

    def update_from_output(self, out: SchedulerOutput, result: ModelRunnerOutput) -> list[Request]:
        """A step's tokens take their placeholders' places; returns the requests that got one, in
        batch order. A request preempted meanwhile keeps its token (recompute includes it); one
        that ended meanwhile (stop string, abort) drops it."""
        advanced = []
        requests, tokens, logprobs = self.requests, result.sampled_token_ids, result.logprobs
        for req_id, (start, lps) in result.prompt_logprobs.items():
            scored = requests.get(req_id)
            if scored is not None:
                scored.add_prompt_logprobs(start, lps)
        preempted = RequestStatus.PREEMPTED
        for s in out.scheduled:             # once per request per step: kept lean
            if not s.sample:
                continue
            req = requests.get(s.req_id)
            if req is None:
                continue
            req.num_output_placeholders -= 1
            token = tokens.get(s.req_id)
            if req.is_beam:
                if token is not None:
                    self._beam_ready(req, token, logprobs[s.req_id])
                continue
            if token is None:
                if s.spec_token_ids and s.req_id in result.spec_token_ids:
                    self._land_speculated(req, s, result)
                    advanced.append(req)
                continue
            req.append_output_token(token)
            if logprobs and s.req_id in logprobs and req.params.logprobs is not None:
                req.logprobs.append(logprobs[s.req_id])
            if req.status is preempted and not req.num_output_placeholders:
                self.finished_req_ids.add(req.req_id)   # its runner row can go now
            advanced.append(req)
        return advanced

    def _beam_ready(self, req: Request, token: int, lps) -> None:
        req.beam_ready = (token, lps)
        if req.status is RequestStatus.PREEMPTED and req.req_id in self.requests:
            self._release(req)      # preempted with its step in flight: no need to run it again
            self.num_preemptions -= 1

    def _land_speculated(self, req: Request, s: ScheduledRequest, result: ModelRunnerOutput) -> None:
        """A verified step's tokens join the request; the slots of its rejected drafts go back:
        its KV is valid up to the last accepted draft (the token drawn after it is computed next
        step), and blocks past that are freed."""
        emitted = result.spec_token_ids[s.req_id]
        for t in emitted:
            req.append_output_token(t)
        req.num_computed_tokens -= len(s.spec_token_ids) + 1 - len(emitted)
        if req.status is RequestStatus.RUNNING:
            kept = self.kv.truncate(req, req.num_computed_tokens)
            if self.blocks_sent.get(req.req_id, 0) > kept:
                self.blocks_sent[req.req_id] = kept
        if self.spec_stats is not None:
            self.spec_stats.record(len(s.spec_token_ids), result.spec_num_accepted.get(s.req_id, 0))

    def finish_requests(self, req_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        done = []
        for req_id in req_ids:
            req = self.requests.pop(req_id, None)
            if req is None:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            req.status = status
            self.kv.free(req)
            self.blocks_sent.pop(req_id, None)
            self.finished_req_ids.add(req_id)
            done.append(req)
        return done

    def num_waiting(self) -> int:
        return len(self.waiting)

    def queued_prefill_tokens(self) -> int:
        return sum(r.uncomputed_prefill_tokens() for r in self.requests.values())
