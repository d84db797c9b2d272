"""Typed, narrow objects passed between the engine's layers and to its callers.

Scheduler -> ModelRunner: SchedulerOutput. ModelRunner -> engine: ModelRunnerOutput.
Engine -> callers: RequestOutput (whole, offline API) and StreamDelta (async streaming).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from pagoda.gpu_worker.core.host_tier import KVCopy
from pagoda.gpu_worker.core.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequest:
    """A request entering the runner's persistent batch (first admission, or again after
    preemption): everything the runner keeps in its row until the request leaves."""
    req_id: str
    token_ids: list[int]          # every known token: prompt, then outputs so far
    num_prompt_tokens: int
    sampling_params: Optional[SamplingParams]     # None: a profiling row (greedy, plain)
    block_ids: list[int]          # the whole block table after this step's allocation
    generator: Optional[torch.Generator] = None   # per-request, when a seed is given
    grammar: Any = None           # structured_output.GrammarState, when the output is constrained
    prompt_logprobs: int = -1     # top-k per prompt token to score; -1: none (already scored, or not asked)
    lora: Any = None              # the pagoda.gpu_worker.features.lora.LoRAAdapter its rows run with; None: the base model


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: only what the runner cannot know by itself."""
    req_id: str
    num_tokens: int               # tokens to compute this step
    start_pos: int                # = tokens already in the KV cache for this request
    sample: bool                  # True when this chunk ends the known tokens: sample one token
    new_block_ids: list[int]      # blocks appended to the request's table this step
    # Drafted tokens verified this step (speculative decoding): they follow the known tokens,
    # counted in num_tokens. -1s: the runner's draft model fills them in.
    spec_token_ids: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]             # in batch order
    new: list[NewRequest] = field(default_factory=list)
    # Requests that left the batch since the last step (finished, aborted, preempted):
    # the runner frees their rows before adding this step's new requests.
    finished_req_ids: set[str] = field(default_factory=set)
    # (src, dst) block copies to do before the forward: copy-on-write of blocks forked
    # sequences shared (beam search).
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # Block copies between the device pool and the host tier, to run in this order before the
    # step's forward (gpu_worker/core/host_tier.py).
    kv_copies: list[KVCopy] = field(default_factory=list)


@dataclass
class Logprob:
    token_id: int
    logprob: float


@dataclass
class TokenLogprobs:
    """Log-probability of the sampled token plus the top-k alternatives."""
    sampled: Logprob
    top: list[Logprob]


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: dict[str, int]             # only for requests scheduled with sample=True
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    # Requests whose token ends them (core/stop.py: STOP_TOKEN / LENGTH bits); absent: goes on,
    # unless a stop string completes.
    finish_flags: dict[str, int] = field(default_factory=dict)
    # Requests whose chunk scored prompt tokens: (the chunk's first position p, scores of the
    # prompt tokens p + 1, p + 2, ...).
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    # Speculating requests: every token the step emitted (accepted drafts, then one drawn),
    # cut after a stop token or the length limit; they are absent from sampled_token_ids.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    spec_num_accepted: dict[str, int] = field(default_factory=dict)   # drafts accepted, before any cut
    # Requests whose own parameters or data made a per-request stage raise (core/faults.py);
    # they got no token, and the engine ends them alone.
    failed: dict[str, BaseException] = field(default_factory=dict)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: Optional[str] = None      # "stop" | "length" | "abort"
    stop_reason: int | str | None = None     # the stop token id or stop string that matched
    logprobs: Optional[list[TokenLogprobs]] = None
    cumulative_logprob: Optional[float] = None   # beam search: the beam's summed log-probability


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    # With prompt_logprobs: None for the first prompt token (nothing to score it with), then one
    # entry per prompt token, as vLLM returns them.
    prompt_logprobs: Optional[list[Optional[TokenLogprobs]]] = None


@dataclass(slots=True)
class StreamDelta:
    """What one engine step added to one sequence (index among n) of a request."""
    request_id: str
    index: int
    token_ids: list[int]
    text: str
    logprobs: Optional[list[TokenLogprobs]]
    finished: bool
    finish_reason: Optional[str]
    stop_reason: int | str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    # Scores of prompt tokens 1.. (see Request.prompt_logprobs), on index 0's first delta.
    prompt_logprobs: Optional[list[TokenLogprobs]] = None
    cumulative_logprob: Optional[float] = None   # beam search: set on each beam's one delta


@dataclass(frozen=True)
class EngineStats:
    """A snapshot after one engine turn: immutable, so any thread may read it."""
    running: int
    waiting: int
    queued_prefill_tokens: int        # prompt tokens not yet computed, over running + waiting
    num_blocks: int
    free_blocks: int                  # free or evictable (cached with ref count 0)
    kv_usage: float                   # 1 - free_blocks / num_blocks
    prefix_cache_queries: int         # tokens looked up, cumulative
    prefix_cache_hits: int            # tokens found, cumulative
    preemptions: int
    prompt_tokens: int                # cumulative, computed prompt tokens
    generation_tokens: int            # cumulative
    tokens_stored: int                # KV of computed tokens, summed over running requests
    blocks_held: int                  # blocks some request holds (num_blocks - free_blocks)
    block_size: int
    num_steps: int = 0                # cumulative steps that ran the model
    step_seconds: float = 0.0         # cumulative wall time of those steps (the publisher fits rates to it)
    max_num_batched_tokens: int = 0   # token budget of one step
    # vLLM's prompt_tokens: each request's whole prompt, computed or cached, counted once when its
    # first token comes (prompt_tokens above counts prefill computed, recompute after preemption too).
    request_prompt_tokens: int = 0    # cumulative
    request_cached_tokens: int = 0    # cumulative, of those: served from the prefix cache
    # Speculative decoding, cumulative (vLLM's spec_decode_* counters); None when it is off.
    spec_num_drafts: Optional[int] = None
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()
    # Host KV tier (0 blocks: none): blocks it holds for the prefix cache, preemptions that
    # swapped, and the copies between tiers, cumulative (blocks, seconds).
    host_blocks: int = 0
    host_cached_blocks: int = 0
    swaps: int = 0
    kv_copied_blocks: int = 0
    kv_copy_seconds: float = 0.0
    # Multi-LoRA (max_lora 0: off): --max-loras, and the adapters of running and waiting requests.
    max_lora: int = 0
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()

    @property
    def kv_utilisation(self) -> float:
        """Stored tokens over the slots of the blocks held: how full the held blocks are."""
        return self.tokens_stored / (self.blocks_held * self.block_size) if self.blocks_held else 0.0
