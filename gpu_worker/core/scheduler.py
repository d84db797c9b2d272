"""Continuous batching: which requests run this step, and how many tokens each computes.

One token budget per step (max_num_batched_tokens), spent on running requests first, then
on waiting ones; long prompts are prefilled in chunks. When blocks run out a running
request is preempted by recompute: its blocks are freed and it goes back to the front of
the queue (its full blocks usually stay in the prefix cache, so recompute is cheap); in swap
mode its computed blocks are copied to the host tier instead and back when it resumes, with
recompute as the fallback when the host tier cannot take them. Under
the priority policy a waiting request that finds no blocks or sequence slot preempts running
requests of lower priority, lowest first.

Tenant fairness (the default; `fairness="fifo"` turns it off): each tenant waits in its own
queue, and among requests of the same priority the next one admitted is the head of the tenant
that runs the fewest sequences (those admitted earlier in the same step included), FIFO within a
tenant. A tenant's burst of a thousand requests therefore holds up another tenant's single
request by at most one step's admission, and two busy tenants converge on equal shares of the
sequence slots. A preemption victim likewise comes from the tenant running the most sequences.
Priority still comes first in both.

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
from collections import Counter, deque
from typing import Iterable, Mapping

from pagoda.gpu_worker.core.drafter import Drafter, SpecStats
from pagoda.gpu_worker.core.kv_cache_manager import CachedBlock, KVCacheManager
from pagoda.gpu_worker.core.outputs import ModelRunnerOutput, NewRequest, ScheduledRequest, SchedulerOutput
from pagoda.gpu_worker.core.request import Request, RequestStatus
from pagoda.gpu_worker.core.stop import reaches_length


class WaitingQueue:
    """Requests waiting for admission: one queue per tenant with tenant fairness, one for all
    without. FCFS: a deque per queue, preempted requests back at its front. Priority: a heap per
    queue on (priority, arrival), so a preempted request regains its old place by itself.

    The next request is the head of one queue: the one whose head has the best priority (priority
    policy), then whose tenant runs the fewest sequences (`load`, from the scheduler), then whose
    head arrived first. Picking costs O(tenants waiting), whatever the number of requests."""

    def __init__(self, policy: str, fair: bool = True):
        self.policy = policy
        self.fair = fair
        self._fcfs: dict[str, deque[Request]] = {}
        self._heaps: dict[str, list[tuple[int, int, Request]]] = {}
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self):
        """Every waiting request, tenant by tenant (each tenant's in its own order)."""
        if self.policy == "fcfs":
            return iter([r for q in self._fcfs.values() for r in q])
        return iter([r for h in self._heaps.values() for _, _, r in sorted(h, key=lambda e: e[:2])])

    def _key(self, req: Request) -> str:
        return req.tenant if self.fair else ""

    def add(self, req: Request, front: bool = False) -> None:
        key = self._key(req)
        if self.policy == "fcfs":
            q = self._fcfs.setdefault(key, deque())
            q.appendleft(req) if front else q.append(req)
        else:
            heapq.heappush(self._heaps.setdefault(key, []), (req.priority, req.arrival, req))
        self._len += 1

    def _head(self, key: str) -> Request:
        return self._fcfs[key][0] if self.policy == "fcfs" else self._heaps[key][0][2]

    def _pick(self, load: Mapping[str, int]) -> str:
        queues = self._fcfs if self.policy == "fcfs" else self._heaps
        if len(queues) == 1:
            return next(iter(queues))
        by_priority = self.policy == "priority"
        best, best_rank = "", None
        for key in queues:
            head = self._head(key)
            rank = (head.priority if by_priority else 0, load.get(key, 0), head.arrival)
            if best_rank is None or rank < best_rank:
                best, best_rank = key, rank
        return best

    def peek(self, load: Mapping[str, int] = {}) -> Request:
        return self._head(self._pick(load))

    def pop(self, load: Mapping[str, int] = {}) -> Request:
        """The request peek(load) returns, taken out."""
        key = self._pick(load)
        if self.policy == "fcfs":
            q = self._fcfs[key]
            req = q.popleft()
            if not q:
                del self._fcfs[key]
        else:
            h = self._heaps[key]
            req = heapq.heappop(h)[2]
            if not h:
                del self._heaps[key]
        self._len -= 1
        return req

    def remove(self, req: Request) -> None:
        key = self._key(req)
        if self.policy == "fcfs":
            q = self._fcfs[key]
            q.remove(req)
            if not q:
                del self._fcfs[key]
        else:
            h = [e for e in self._heaps.get(key, ()) if e[2] is not req]
            if len(h) == len(self._heaps.get(key, ())):
                return      # not waiting (as before: nothing to do)
            if h:
                heapq.heapify(h)
                self._heaps[key] = h
            else:
                del self._heaps[key]
        self._len -= 1


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 policy: str = "fcfs", max_model_len: int | None = None, drafter: Drafter | None = None,
                 max_loras: int = 0, preemption_mode: str = "recompute", fairness: str = "tenant"):
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
        # tenant: admission and preemption even out the sequences each tenant runs (WaitingQueue);
        # fifo: one queue for all, in arrival (or priority) order.
        self.fair = fairness == "tenant"
        self.waiting = WaitingQueue(policy, self.fair)
        self.running: list[Request] = []
        self.running_per_tenant: Counter[str] = Counter()     # tenant -> its sequences in `running`
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
        self._run(req)

    def _release(self, req: Request) -> None:
        """A ready beam leaves the scheduler: its blocks and runner row go, its candidates stay
        with its group (which will continue it, or not, by recompute)."""
        if req.status is RequestStatus.RUNNING:
            self._unrun(req)
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
        load = self.running_per_tenant      # with tenant fairness, the least loaded tenant goes next
        while len(self.waiting) and budget > 0:
            req = self.waiting.peek(load)
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
                    skipped.append(self.waiting.pop(load))
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
            self.waiting.pop(load)
            req.num_computed_tokens = num_hit
            req.status = RequestStatus.RUNNING
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
            if not swapped:
                self.prefix_cache_queries += req.num_tokens
                self.prefix_cache_hits += num_hit
            self._run(req)
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
        """Lowest priority first (priority policy); among equals, with tenant fairness, a sequence
        of the tenant running the most; then the latest arrival (priority) or the last admitted."""
        running, load = self.running, self.running_per_tenant
        fair = self.fair and len(load) > 1
        if self.policy == "priority":
            return max(running, key=lambda r: (r.priority, load[r.tenant] if fair else 0, r.arrival))
        if not fair:
            return running[-1]
        most = max(load.values())
        return next(r for r in reversed(running) if load[r.tenant] == most)

    def _run(self, req: Request) -> None:
        self.running.append(req)
        self.running_per_tenant[req.tenant] += 1

    def _unrun(self, req: Request) -> None:
        self.running.remove(req)
        load = self.running_per_tenant
        load[req.tenant] -= 1
        if not load[req.tenant]:
            del load[req.tenant]

    def _preempt(self, req: Request) -> None:
        if req.beam_ready is not None:
            return self._release(req)
        self._unrun(req)
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
                self._unrun(req)
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
