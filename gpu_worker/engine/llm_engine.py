"""The synchronous engine: validates and queues requests, runs scheduler -> model -> outputs
one step at a time, and turns sampled tokens into stream deltas (stops, detokenization).

Both the offline LLM and the asyncio AsyncLLM drive one of these; it is not thread-safe.
"""
from __future__ import annotations

import itertools
import logging
import time
import weakref
from typing import Iterable, Optional

import torch

from pagoda.gpu_worker.core.config import EngineConfig
from pagoda.gpu_worker.core.detokenizer import Detokenizer
from pagoda.gpu_worker.core.drafter import Drafter
from pagoda.gpu_worker.core.faults import EngineDeadError, RequestFault
from pagoda.gpu_worker.core.kv_cache_manager import KVCacheManager, cdiv
from pagoda.gpu_worker.core.outputs import EngineStats, ModelRunnerOutput, SchedulerOutput, StreamDelta
from pagoda.gpu_worker.core.request import Request, RequestStatus
from pagoda.gpu_worker.core.sampling_params import SamplingParams
from pagoda.gpu_worker.core.scheduler import Scheduler
from pagoda.gpu_worker.core.stop import LENGTH, check_stop, finish_on_token, stop_token_ids
from pagoda.gpu_worker.features import beam_search
from pagoda.gpu_worker.features.beam_search import BeamGroup
from pagoda.gpu_worker.runner.model_runner import InFlight, ModelRunner
from pagoda.protos.block_hash import namespace_root
from pagoda.runtime.heap import freeze_heap

logger = logging.getLogger(__name__)

# Every engine ever built, so tests can check that none leaks blocks.
live_engines: "weakref.WeakSet[LLMEngine]" = weakref.WeakSet()


def uses_async_scheduling(config: EngineConfig, device_type: str) -> bool:
    """on, or auto on CUDA; never with speculation, which proposes from the tokens the last
    step returned (auto means off with it; "on" is refused by EngineConfig)."""
    if config.speculative_config is not None:
        return False
    return config.async_scheduling == "on" or (config.async_scheduling == "auto" and device_type == "cuda")


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.runner = ModelRunner(config)
        self.tokenizer = self.runner.tokenizer
        self.model_name: str = config.served_model_name or config.model
        self.vocab_size = self.runner.vocab_size
        self.max_model_len = self.runner.max_model_len
        self.eos_token_ids = list(self.runner.eos_token_ids)
        self.block_size = config.block_size
        self.num_blocks = self.runner.num_blocks_for()
        self.runner.allocate_kv_cache(self.num_blocks)
        self.runner.warm_up()  # kernels compile now, not on the first requests
        self.max_num_batched_tokens = config.token_budget(self.max_model_len)
        self.num_host_blocks = self.runner.num_host_blocks()
        self.runner.allocate_host_cache(self.num_host_blocks)
        self.kv = KVCacheManager(self.num_blocks, self.block_size, config.enable_prefix_caching,
                                 self.num_host_blocks)
        spec = config.speculative_config
        drafter = Drafter(spec, self.max_model_len) if spec is not None else None
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, self.max_num_batched_tokens,
                                   config.scheduling_policy, self.max_model_len, drafter,
                                   config.max_loras if config.enable_lora else 0, config.preemption_mode,
                                   config.scheduling_fairness)
        self.detokenizers: dict[str, Detokenizer] = {}
        self.children: dict[str, list[Request]] = {}    # caller id -> its live sequences
        self.beam_groups: dict[str, BeamGroup] = {}     # caller id -> its beam search
        self.pending: list[StreamDelta] = []            # abort notices for the next step
        self.faults: list[RequestFault] = []            # requests a stage of a step ended alone
        self.dead: BaseException | None = None          # the engine's own fault: it serves no more
        self.generation_tokens = 0
        self.request_prompt_tokens = self.request_cached_tokens = 0
        self.num_steps, self.step_seconds = 0, 0.0
        self.in_flight: tuple[SchedulerOutput, Optional[InFlight]] | None = None   # launched, not collected
        self.async_scheduling = uses_async_scheduling(config, self.runner.device.type)
        self._serial = itertools.count()
        live_engines.add(self)
        freeze_heap()
        capacity = self.num_blocks * self.block_size
        logger.info("KV cache: %d blocks of %d tokens = %d tokens; max concurrency at "
                    "max_model_len=%d: %.2f requests; token budget per step %d",
                    self.num_blocks, self.block_size, capacity, self.max_model_len,
                    capacity / self.max_model_len, self.max_num_batched_tokens)
        if self.num_host_blocks:
            logger.info("host KV tier: %d blocks = %d tokens (%.2f GiB); preemption by %s",
                        self.num_host_blocks, self.num_host_blocks * self.block_size,
                        config.kv_offloading_size, config.preemption_mode)

    # ---- requests in -------------------------------------------------------------------

    def validate_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                         priority: int = 0, cache_salt: str = "", adapter: str = "",
                         check_id: bool = True, tenant: str = "") -> None:
        """Raise ValueError naming the bad field; touches no state. Without check_id it reads
        nothing that changes, so AsyncLLM can call it from the event loop's thread."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine failed and serves no more requests: {self.dead!r}")
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id: must be a non-empty string")
        if check_id and request_id in self.children:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise ValueError("sampling_params: must be a SamplingParams")
        ids = prompt_token_ids
        if not isinstance(ids, (list, tuple)) or not ids:
            raise ValueError("prompt_token_ids: the prompt must contain at least one token")
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size:
                raise ValueError(f"prompt_token_ids: token id {t!r} is outside the vocabulary "
                                 f"[0, {self.vocab_size})")
        if len(ids) > self.max_model_len:
            raise ValueError(f"prompt_token_ids: the prompt has {len(ids)} tokens, more than "
                             f"max_model_len={self.max_model_len}")
        params.validate(self.vocab_size)
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority: must be an integer (got {priority!r})")
        if not isinstance(cache_salt, str):
            raise ValueError("cache_salt: must be a string")
        if not isinstance(tenant, str):
            raise ValueError(f"tenant: must be a string (got {tenant!r})")
        if adapter:
            self._check_adapter(adapter)
        # The last sampled token is never written to the cache, hence the - 1.
        final_len = min(len(ids) + params.max_tokens, max(self.max_model_len, len(ids) + 1)) - 1
        if cdiv(len(ids), self.block_size) > self.num_blocks:
            raise ValueError(f"prompt_token_ids: the prompt needs {cdiv(len(ids), self.block_size)} "
                             f"KV blocks but the pool has {self.num_blocks}")
        if cdiv(final_len, self.block_size) > self.num_blocks:
            raise ValueError(f"max_tokens: prompt plus max_tokens needs {cdiv(final_len, self.block_size)} "
                             f"KV blocks but the pool has {self.num_blocks}")
        if params.use_beam_search:
            self._validate_beam_search(ids, params)

    def _validate_beam_search(self, ids: list[int], params: SamplingParams) -> None:
        width, name = params.beam_width, "best_of" if params.best_of is not None else "n"
        if self.config.speculative_config is not None:
            raise ValueError("use_beam_search: not served with speculative decoding on (--speculative-config)")
        if width > self.config.max_num_seqs:
            raise ValueError(f"{name}: beam width {width} exceeds max_num_seqs={self.config.max_num_seqs} "
                             "(every beam is a running sequence)")
        # The prompt's blocks are shared; at worst each beam holds its own blocks past it.
        need = cdiv(len(ids), self.block_size) + width * (cdiv(params.max_tokens, self.block_size) + 1)
        if need > self.num_blocks:
            raise ValueError(f"max_tokens: {width} beams of prompt plus max_tokens may need {need} KV "
                             f"blocks but the pool has {self.num_blocks}")

    def _check_adapter(self, adapter: str) -> None:
        lora = self.runner.lora
        if not isinstance(adapter, str):
            raise ValueError("adapter: must be a string")
        if lora is None:
            raise ValueError(f"adapter: this worker serves no adapters (got {adapter!r})")
        if adapter not in lora.adapters:
            known = ", ".join(sorted(lora.adapters)) or "none"
            raise ValueError(f"adapter: unknown LoRA adapter {adapter!r} (loaded: {known})")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    priority: int = 0, cache_salt: str = "", adapter: str = "", tenant: str = "") -> None:
        """tenant: whom it is served for; admission is fair between tenants (core/scheduler.py)."""
        self.validate_request(request_id, prompt_token_ids, params, priority, cache_salt, adapter, tenant=tenant)
        lora = self.runner.lora.adapters[adapter] if adapter and self.runner.lora is not None else None
        root = namespace_root(self.model_name, lora.cache_key if lora is not None else "", cache_salt)
        serial = next(self._serial)
        if params.use_beam_search:
            return self._add_beam_search(request_id, prompt_token_ids, params, priority, root, serial, adapter,
                                         tenant)
        seqs = []
        for i in range(params.n):
            # A serial in the internal id keeps a reused caller id apart from the runner's
            # state for the previous request of that name.
            req = Request(f"{request_id}#{i}.{serial}", prompt_token_ids, params, self.block_size,
                          root, priority=priority, parent_id=request_id, index=i, tenant=tenant)
            req.lora = lora
            if params.seed is not None:
                req.generator = self._generator(params.seed + i)
            self.detokenizers[req.req_id] = Detokenizer(
                self.tokenizer, req.prompt_token_ids, params.stop,
                params.include_stop_str_in_output, params.skip_special_tokens)
            seqs.append(req)
        self.children[request_id] = seqs
        # Children go in in order: the first one's prompt blocks become cache hits for the rest.
        for req in seqs:
            self.scheduler.add_request(req)

    # ---- LoRA adapters (the engine's thread) ---------------------------------------------

    def lora_adapters(self) -> list[str]:
        """Names of the adapters requests may use, in load order."""
        return list(self.runner.lora.adapters) if self.runner.lora is not None else []

    def load_lora_adapter(self, name: str, path: str = "", adapter=None) -> None:
        """Register an adapter (read from `path`, or already read: `adapter`, a LoRAAdapter);
        it reaches a device slot with its first request."""
        lora = self.runner.lora
        if lora is None:
            raise ValueError("lora_name: this worker runs without --enable-lora")
        if not isinstance(name, str) or not name or name == self.model_name:
            raise ValueError(f"lora_name: must be a non-empty name other than the base model's (got {name!r})")
        if adapter is None:
            lora.load(name, path)
        else:
            lora.add(adapter)

    def unload_lora_adapter(self, name: str) -> None:
        lora = self.runner.lora
        if lora is None:
            raise ValueError("lora_name: this worker runs without --enable-lora")
        lora.remove(name)

    def _add_beam_search(self, request_id: str, ids: list[int], params: SamplingParams, priority: int,
                         root: bytes, serial: int, adapter: str = "", tenant: str = "") -> None:
        """One request for the prompt; its step's top 2 * width tokens start the beams (every
        beam a copy of it: same adapter, priority, tenant, cache namespace)."""
        width = params.beam_width
        inner = SamplingParams(temperature=params.temperature, max_tokens=self.max_model_len,
                               ignore_eos=True, logprobs=2 * width)
        req = Request(f"{request_id}#beam.{serial}.0", ids, inner, self.block_size, root,
                      priority=priority, parent_id=request_id, tenant=tenant)
        req.is_beam = req.waits_for_its_token = True
        req.beam_width = width
        req.lora = self.runner.lora.adapters[adapter] if adapter and self.runner.lora is not None else None
        group = BeamGroup(request_id, list(ids), width, params.n, params.max_tokens,
                          stop_token_ids((), params.ignore_eos, self.eos_token_ids), params.length_penalty,
                          beams=[req], cum={req.req_id: 0.0})
        group.forks = serial
        self.beam_groups[request_id] = group
        self.children[request_id] = [req]
        self.scheduler.add_request(req)

    def _step_beams(self) -> list[StreamDelta]:
        """Every group whose live beams are all ready takes its next step: the best
        continuations fork from their parents (KV shared), the parents end; a group that is
        done returns its best beams."""
        deltas: list[StreamDelta] = []
        for group in list(self.beam_groups.values()):
            if all(b.beam_ready is not None for b in group.beams):
                try:
                    deltas.extend(self._advance(group))
                except Exception as e:      # a per-request stage: this search alone fails
                    self._fail(group.request_id, "beam search scoring", e)
        return deltas

    def _advance(self, group: BeamGroup) -> list[StreamDelta]:
        parents = group.beams
        if group.steps == 0 and parents[0].num_cached_tokens >= 0:
            group.num_cached_tokens = parents[0].num_cached_tokens
        offered = [(group.cum[b.req_id], *b.beam_ready) for b in parents]
        cands = beam_search.candidates(offered)
        # A candidate is its parent plus one token; beam search takes no min_tokens (refused).
        flags = [check_stop(c.token, parents[c.parent].num_tokens + 1, parents[c.parent].num_output_tokens + 1,
                            group.stop_ids, 0, group.max_tokens, self.max_model_len) for c in cands]
        running, done = beam_search.select(cands, flags, group.width)
        # Scoring (the request's length_penalty meets its data) before any fork: an error here
        # leaves the group as it was, for _fail to end whole.
        for c in done:
            group.finish_beam(parents[c.parent].all_token_ids + [c.token], c.cum_logprob, self.eos_token_ids, True)
        for c, f in running:
            if f & LENGTH:
                group.finish_beam(parents[c.parent].all_token_ids + [c.token], c.cum_logprob,
                                  self.eos_token_ids, False)
        group.steps += 1
        self.generation_tokens += len(parents)
        children: list[tuple[Request, int]] = []    # (child, tokens of KV it shares)
        for c, f in running:
            parent = parents[c.parent]
            if f & LENGTH:
                continue
            group.forks += 1
            child = parent.fork(f"{group.request_id}#beam.{group.forks}", c.token)
            held = parent.req_id in self.scheduler.requests and parent.status is RequestStatus.RUNNING
            children.append((child, self.kv.fork(parent, child) if held else 0))
            group.cum[child.req_id] = c.cum_logprob
        self._note_sharing(group, [ch for ch, _ in children])
        self.scheduler.finish_requests([p.req_id for p in parents], RequestStatus.FINISHED_STOPPED)
        for p in parents:
            group.cum.pop(p.req_id, None)
        group.beams = [ch for ch, _ in children]
        for child, shared in children:
            if shared and len(self.scheduler.running) < self.config.max_num_seqs:
                self.scheduler.add_forked(child, shared)
            else:       # no KV, or no sequence slot free: it waits and recomputes its prefix
                self.kv.free(child)
                self.scheduler.add_request(child)
        if group.beams:
            self.children[group.request_id] = group.beams
            return []
        return self._end_beam_search(group)

    def _note_sharing(self, group: BeamGroup, beams: list[Request]) -> None:
        """The most blocks two of the group's beams share (tests and bench/beam.py read it)."""
        tables = [self.kv.req_to_blocks.get(b.req_id, []) for b in beams]
        ids = [b.block_id for t in tables for b in t]
        shared = len(ids) - len(set(ids))
        group.max_shared_blocks = max(group.max_shared_blocks, shared)

    def _end_beam_search(self, group: BeamGroup, aborted: bool = False) -> list[StreamDelta]:
        self.beam_groups.pop(group.request_id, None)
        self.children.pop(group.request_id, None)
        self.scheduler.finish_requests([b.req_id for b in group.beams], RequestStatus.FINISHED_ABORTED)
        n_prompt = len(group.prompt_token_ids)
        if aborted:
            return [StreamDelta(group.request_id, i, [], "", None, True, "abort", None, n_prompt,
                                group.num_cached_tokens, 0) for i in range(group.n)]
        out = []
        for i, seq in enumerate(group.best()):
            detok = Detokenizer(self.tokenizer, group.prompt_token_ids)
            shown = seq.output_token_ids[:-1] if seq.finish_reason == "stop" else seq.output_token_ids
            for t in shown:
                detok.add_token(t, check_stop=False)
            detok.flush()
            seq.text = detok.take_delta(True)
            stop_reason = None
            out.append(StreamDelta(group.request_id, i, seq.output_token_ids, seq.text, None, True,
                                   seq.finish_reason, stop_reason, n_prompt, group.num_cached_tokens,
                                   len(seq.output_token_ids), cumulative_logprob=seq.cum_logprob))
        return out

    def _generator(self, seed: int):
        return torch.Generator(device=self.runner.device).manual_seed(seed)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            group = self.beam_groups.get(rid)
            if group is not None:
                self.pending.extend(self._end_beam_search(group, aborted=True))
                continue
            seqs = self.children.pop(rid, [])
            self.scheduler.finish_requests([r.req_id for r in seqs], RequestStatus.FINISHED_ABORTED)
            for req in seqs:
                self.pending.append(self._delta(req, [], self.detokenizers.pop(req.req_id).take_delta(True)))

    # ---- one step ----------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.pending) or self.in_flight is not None

    def step(self) -> list[StreamDelta]:
        """One turn. With async scheduling, pipelined: step N+1 is scheduled and launched while
        step N is still in flight (its sampled tokens are placeholders, fed in on the device),
        then N is collected (its tokens; requests that a stop token or their length ends leave
        the scheduler) and turned into text and deltas. On CUDA the launch returns before the
        GPU is done, so the GPU goes from N to N+1 without waiting for the host. A request that
        a stop token or a stop string ends at N was already in N+1: its token from N+1 is dropped
        when it comes back. Under tensor parallelism N is collected before N+1 is scheduled
        (every rank takes its inputs from rank 0's host). Without async scheduling, a step is
        launched, collected and turned into deltas in the same turn."""
        t0 = time.perf_counter()
        deltas, self.pending = self.pending, []
        prev, self.in_flight = self.in_flight, None
        collected: list[tuple[Request, int, int]] = []
        if prev is not None and self.runner.tp is not None:
            collected, prev = self._collect(prev), None
        if self.scheduler.has_unfinished():
            out = self.scheduler.schedule()
            if out.scheduled:
                self.in_flight = (out, self._guarded(self.runner.launch, out))
            else:
                # Nothing fits this step; the runner hears about departures next time. Copies
                # queued meanwhile (a swap-out) run now, before any later step's.
                self.scheduler.finished_req_ids |= out.finished_req_ids
                if out.kv_copies:
                    self._guarded(self.runner.copy_tier_blocks, out.kv_copies)
        if prev is not None:
            collected = self._collect(prev)
        if not self.async_scheduling and self.in_flight is not None:
            collected += self._collect(self.in_flight)
            self.in_flight = None
        failed = {f.request_id for f in self.faults}
        for req, flags, n in collected:
            if failed and req.parent_id in failed:
                continue            # a sibling's stage failed the request this step
            try:        # a per-request stage: an error ends this request alone
                deltas.append(self._on_token(req, flags) if n == 1 else self._on_tokens(req, flags, n))
            except Exception as e:
                self._fail(req.parent_id, "stop checks and detokenization", e)
                failed.add(req.parent_id)
        if self.beam_groups:
            deltas.extend(self._step_beams())
        if self.in_flight is not None and not any(s.req_id in self.scheduler.requests
                                                  for s in self.in_flight[0].scheduled):
            self._collect(self.in_flight)   # every request in it has ended: nothing to wait for
            self.in_flight = None
        if collected or self.in_flight is not None:
            self.step_seconds += time.perf_counter() - t0
        return deltas

    def _collect(self, step: tuple[SchedulerOutput, Optional[InFlight]]) -> list[tuple[Request, int, int]]:
        """A launched step's requests that got tokens, with their finish flags
        (core/stop.py: STOP_TOKEN / LENGTH) and how many tokens (more than one: speculation)."""
        out, launched = step
        result: ModelRunnerOutput = self._guarded(self.runner.finish, launched)
        self.num_steps += 1
        culprits = [(r, e) for r, e in ((self.scheduler.requests.get(rid), e) for rid, e in result.failed.items())
                    if r is not None]
        advanced = self.scheduler.update_from_output(out, result)
        for req, e in culprits:
            self._fail(req.parent_id, "sampling (transforms, logits processors, grammar)", e)
        if culprits:
            gone = {req.parent_id for req, _ in culprits}
            advanced = [r for r in advanced if r.parent_id not in gone]
        flags, spec = result.finish_flags, result.spec_token_ids
        collected = [(req, flags.get(req.req_id, 0), len(spec[req.req_id]) if req.req_id in spec else 1)
                     for req in advanced]
        self.generation_tokens += sum(n for _, _, n in collected) if spec else len(advanced)
        for req, _, n in collected:
            if len(req.output_token_ids) == n:      # its first tokens: its prompt counts, once
                self.request_prompt_tokens += len(req.prompt_token_ids)
                self.request_cached_tokens += max(0, req.num_cached_tokens)
        ended = [req.req_id for req, f, _ in collected if f]
        if ended:   # out of the scheduler before the next step is scheduled; text comes later
            self.scheduler.finish_requests(ended, RequestStatus.FINISHED_LENGTH)
        return collected

    def _fail(self, request_id: str, stage: str, cause: BaseException) -> None:
        """End one caller request alone: a per-request stage of the step raised for it
        (core/faults.py). Its sequences leave the scheduler (blocks freed); the caller gets a
        RequestFault (take_faults) instead of more deltas."""
        logger.warning("request %s failed alone in %s: %r", request_id, stage, cause)
        group = self.beam_groups.pop(request_id, None)
        seqs = list(group.beams) if group is not None else list(self.children.get(request_id, []))
        self.children.pop(request_id, None)
        self.scheduler.finish_requests([r.req_id for r in seqs], RequestStatus.FINISHED_ABORTED)
        for r in seqs:
            self.detokenizers.pop(r.req_id, None)
        self.faults.append(RequestFault(request_id, stage, cause))

    def take_faults(self) -> list[RequestFault]:
        """The requests ended alone since the last call, each with its error."""
        faults, self.faults = self.faults, []
        return faults

    def _guarded(self, fn, arg):
        """A stage of the engine itself (the forward, block copies): its error is nobody's
        request's, so every request fails and the engine is dead."""
        try:
            return fn(arg)
        except Exception as e:
            self.dead = e
            # This step's full blocks were named before their KV was written, so the cache
            # can no longer be trusted: end every request and start it clean.
            self.in_flight = None
            self.abort_request(list(self.children))
            if not self.kv.pool.reset_prefix_cache():
                logger.error("prefix cache not reset: blocks still held after aborting every request")
            raise

    def _on_token(self, req: Request, flags: int) -> StreamDelta:
        """One new token of a running request: text, stop strings, and the end the runner's
        vectorised checks found (flags: core/stop.py's STOP_TOKEN / LENGTH)."""
        token = req.output_token_ids[-1]
        p = req.params
        detok = self.detokenizers[req.req_id]
        status = finish_on_token(req, token, flags, len(req.output_token_ids), detok)
        logprobs = [req.logprobs[-1]] if p.logprobs is not None and req.logprobs else None
        # The prompt's scores go out once, with the first token (the last prompt chunk's step).
        prompt_lps = req.prompt_logprobs if req.wants_prompt_logprobs and len(req.output_token_ids) == 1 else None
        if status is None:      # the common case, without the property calls of _delta
            return StreamDelta(req.parent_id, req.index, [token], detok.take_delta(False), logprobs, False,
                               None, None, len(req.prompt_token_ids), max(0, req.num_cached_tokens),
                               len(req.output_token_ids), prompt_lps)
        detok.flush()
        self._finish(req, status)
        return self._delta(req, [token], detok.take_delta(True), logprobs, prompt_lps)

    def _on_tokens(self, req: Request, flags: int, n: int) -> StreamDelta:
        """n new tokens of a speculating request, in one delta: as _on_token for each, up to the
        first that ends it (the runner cut the tokens after a stop token or the length limit; a
        stop string may end it earlier, and the tokens after that one are dropped)."""
        detok = self.detokenizers[req.req_id]
        new = req.output_token_ids[-n:]
        status = None
        for j, token in enumerate(new):
            last = j == n - 1
            # The runner's flags are the last token's: it cut the tokens after one that ends.
            status = finish_on_token(req, token, flags if last else 0, len(req.output_token_ids) - n + j + 1, detok)
            if status is not None:
                if not last:
                    del req.output_token_ids[j + 1 - n:], req.all_token_ids[j + 1 - n:]
                new = new[:j + 1]
                break
        if status is None:
            return StreamDelta(req.parent_id, req.index, new, detok.take_delta(False), None, False,
                               None, None, len(req.prompt_token_ids), max(0, req.num_cached_tokens),
                               len(req.output_token_ids))
        detok.flush()
        self._finish(req, status)
        return self._delta(req, new, detok.take_delta(True))

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if req.req_id in self.scheduler.requests:   # running, or preempted since its step
            self.scheduler.finish_requests([req.req_id], status)
        else:       # already out of the scheduler (_collect); the final reason is decided here
            req.status = status
        del self.detokenizers[req.req_id]
        seqs = self.children.get(req.parent_id)
        if seqs is not None:
            seqs.remove(req)
            if not seqs:
                del self.children[req.parent_id]

    def _delta(self, req: Request, token_ids: list[int], text: str,
               logprobs=None, prompt_logprobs=None) -> StreamDelta:
        return StreamDelta(
            request_id=req.parent_id, index=req.index, token_ids=token_ids, text=text,
            logprobs=logprobs, finished=req.is_finished, finish_reason=req.finish_reason,
            stop_reason=req.stop_reason, num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=max(0, req.num_cached_tokens), num_output_tokens=req.num_output_tokens,
            prompt_logprobs=prompt_logprobs)

    # ---- introspection -----------------------------------------------------------------

    def stats(self) -> EngineStats:
        s = self.scheduler
        free = self.kv.pool.num_free_blocks()
        return EngineStats(
            running=len(s.running), waiting=s.num_waiting(),
            queued_prefill_tokens=s.queued_prefill_tokens(), num_blocks=self.num_blocks,
            free_blocks=free, kv_usage=1.0 - free / self.num_blocks,
            prefix_cache_queries=s.prefix_cache_queries, prefix_cache_hits=s.prefix_cache_hits,
            preemptions=s.num_preemptions, prompt_tokens=s.num_prompt_tokens,
            generation_tokens=self.generation_tokens,
            tokens_stored=sum(r.num_computed_tokens for r in s.running),
            blocks_held=self.num_blocks - free, block_size=self.block_size, num_steps=self.num_steps,
            step_seconds=self.step_seconds, max_num_batched_tokens=self.max_num_batched_tokens,
            request_prompt_tokens=self.request_prompt_tokens, request_cached_tokens=self.request_cached_tokens,
            **self._spec_stats(), **self._tier_stats(), **self._lora_stats())

    def _lora_stats(self) -> dict:
        if self.runner.lora is None:
            return {}
        s = self.scheduler

        def names(reqs) -> tuple[str, ...]:
            return tuple(sorted({r.lora.name for r in reqs if r.lora is not None}))
        return dict(max_lora=self.runner.lora.max_loras, running_lora_adapters=names(s.running),
                    waiting_lora_adapters=names(s.waiting))

    def _spec_stats(self) -> dict:
        st = self.scheduler.spec_stats
        if st is None:
            return {}
        return dict(spec_num_drafts=st.num_drafts, spec_num_draft_tokens=st.num_draft_tokens,
                    spec_num_accepted_tokens=st.num_accepted_tokens,
                    spec_accepted_per_pos=tuple(st.accepted_per_pos or ()))

    def _tier_stats(self) -> dict:
        host = self.kv.host
        if host is None:
            return {}
        blocks, seconds = self.runner.copy_rate()
        return dict(host_blocks=host.num_blocks, host_cached_blocks=len(host.cached),
                    swaps=self.scheduler.num_swaps, kv_copied_blocks=blocks, kv_copy_seconds=seconds)

    def take_kv_events(self) -> list[tuple[str, bytes]]:
        return self.kv.pool.take_events()

    def cached_block_hashes(self) -> list[bytes]:
        return self.kv.pool.cached_hashes()

    def take_host_kv_events(self) -> list[tuple[str, bytes]]:
        """The host tier's block events since the last call (none without a tier)."""
        return self.kv.host.take_events() if self.kv.host is not None else []

    def cached_hashes_by_tier(self) -> tuple[list[bytes], list[bytes]]:
        """(device, host) cached hashes."""
        return self.cached_block_hashes(), list(self.kv.host.cached) if self.kv.host is not None else []
