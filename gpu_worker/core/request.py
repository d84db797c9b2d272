"""One sequence the engine is generating: its tokens, progress, status and block hashes.

A caller's request with n > 1 becomes n of these (children), one per output index.
"""
from __future__ import annotations

import copy
import enum
import itertools
from typing import Optional

from pagoda.gpu_worker.core.outputs import TokenLogprobs
from pagoda.gpu_worker.core.sampling_params import SamplingParams
from pagoda.protos.block_hash import block_hashes

_arrivals = itertools.count()


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort")


class Request:
    def __init__(self, req_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 block_size: int, hash_root: bytes, priority: int = 0,
                 parent_id: Optional[str] = None, index: int = 0, tenant: str = ""):
        self.req_id = req_id                    # unique inside the engine
        self.parent_id = parent_id if parent_id is not None else req_id   # the caller's id
        self.index = index
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(prompt_token_ids)
        self.params = params
        self.priority = priority
        # Who it is served for: admission is fair between tenants (scheduler.py). "" for callers
        # without keys and for the offline LLM API.
        self.tenant = tenant
        # A global counter rather than a clock: ties between requests added in one tick
        # must still order by arrival.
        self.arrival = next(_arrivals)
        self.status = RequestStatus.WAITING
        # Advanced when a step is scheduled: tokens whose KV that step (or an earlier one) writes.
        self.num_computed_tokens = 0
        # Tokens sampled by launched steps that have not come back yet (async scheduling: the
        # next step is scheduled before this one's token is known, with the token in its place).
        self.num_output_placeholders = 0
        self.num_cached_tokens = -1             # set when first admitted
        self.stop_reason: int | str | None = None
        self.logprobs: list[TokenLogprobs] = []
        # Scores of prompt tokens 1.. (the first has no context), filled chunk by chunk; only the
        # first sequence of a request computes them (the others share its prompt).
        self.prompt_logprobs: list[TokenLogprobs] = []
        self.wants_prompt_logprobs = params.prompt_logprobs is not None and index == 0
        self.generator = None
        # Each sequence walks its own copy of the grammar (structured output).
        self.grammar = params.structured_output.new_state() if params.structured_output is not None else None
        # Its grammar's mask for the next token is worked out on the host from this token, so
        # its next step waits until this one's token is back (async scheduling).
        self.waits_for_its_token = self.grammar is not None
        self.block_size = block_size
        self.lora: Optional[object] = None       # its pagoda.gpu_worker.features.lora.LoRAAdapter (engine.add_request)
        self.hash_root = hash_root
        self.block_hashes: list[bytes] = block_hashes(self.all_token_ids, block_size, hash_root)
        # Beam search: a beam's step appends nothing; it leaves (sampled token, its logprobs) here
        # and sits out until its group picks the continuations (gpu_worker/features/beam_search.py).
        self.is_beam = False
        self.beam_width = 0     # set on a beam search's first request only: the slots it fans out to
        self.beam_ready: Optional[tuple[int, TokenLogprobs]] = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> Optional[str]:
        return self.status.value if self.status.finished else None

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.num_tokens % self.block_size == 0:
            # Only the block that just filled up is new; the chain extends from the last hash.
            self.block_hashes = block_hashes(self.all_token_ids, self.block_size,
                                             self.hash_root, self.block_hashes)

    def fork(self, req_id: str, token_id: int) -> "Request":
        """A beam's child: this sequence plus token_id, in the WAITING state with nothing
        computed (the caller shares the parent's KV with it, or lets it recompute)."""
        child = copy.copy(self)
        child.req_id = req_id
        child.output_token_ids = list(self.output_token_ids)
        child.all_token_ids = list(self.all_token_ids)
        child.block_hashes = list(self.block_hashes)
        child.logprobs, child.prompt_logprobs = [], []
        child.status = RequestStatus.WAITING
        child.num_computed_tokens = child.num_output_placeholders = 0
        child.beam_ready = None
        child.beam_width = 0
        child.append_output_token(token_id)
        return child

    def prompt_logprobs_pending(self) -> bool:
        """Prompt tokens are still to be scored: the prompt must be computed, not read from the cache."""
        return self.wants_prompt_logprobs and len(self.prompt_logprobs) < len(self.prompt_token_ids) - 1

    def add_prompt_logprobs(self, start: int, lps: list[TokenLogprobs]) -> None:
        """Scores of prompt tokens start + 1 ..., from one chunk; a chunk computed again (after a
        preemption) adds only what is new."""
        have = len(self.prompt_logprobs)
        if start <= have:
            self.prompt_logprobs.extend(lps[have - start:])

    def uncomputed_prefill_tokens(self) -> int:
        """Known tokens still to be computed, not counting the one pending decode token."""
        known = self.num_tokens - (1 if self.output_token_ids else 0)
        return max(0, known - self.num_computed_tokens)

    def __repr__(self) -> str:
        return (f"Request({self.req_id!r}, {self.status.value}, prompt={self.num_prompt_tokens}, "
                f"out={self.num_output_tokens}, computed={self.num_computed_tokens})")
