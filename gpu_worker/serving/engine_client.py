"""What the serving side may ask of an engine: the publisher reads an EngineReport, the gRPC
server drives an EngineClient. AsyncLLM is both; the publisher's test stand-ins (a fake cluster
worker, the routing simulator's workers) are EngineReports.

Everything here is answered from what the engine thread last published, so none of it waits
on a step (serving/async_llm.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncGenerator, Callable, Optional, Protocol

from pagoda.gpu_worker.core.sampling_params import SamplingParams
from pagoda.runtime.tokenization import PromptTokenizer

if TYPE_CHECKING:     # outputs imports torch; the publisher (and the routing simulator's) stays torch-free
    from pagoda.gpu_worker.core.outputs import EngineStats, StreamDelta


@dataclass(frozen=True)
class LoadedModel:
    """The model as loaded, for the worker's start-up line."""
    device: str                 # "cuda:0", "cpu"
    dtype: str                  # "bfloat16", ...
    weight_bytes: int
    quantization: str           # the method, "none" without


class EngineReport(Protocol):
    """What the Redis publisher reads: load figures, KV events and cached hashes per tier, adapters."""
    block_size: int
    max_loras: int          # adapter slots; 0 without --enable-lora

    def stats(self) -> EngineStats: ...

    def take_kv_events(self) -> list[tuple[str, bytes]]: ...

    def take_host_kv_events(self) -> list[tuple[str, bytes]]: ...

    def cached_block_hashes(self) -> list[bytes]: ...

    def cached_hashes_by_tier(self) -> tuple[list[bytes], list[bytes]]: ...

    def lora_adapters(self) -> list[str]: ...

    def lora_resident(self) -> list[str]: ...

    def lora_paths(self) -> dict[str, str]: ...


class EngineClient(EngineReport, Protocol):
    """What the gRPC server drives: request streams, aborts, adapters, shutdown; and what it
    tells callers about the model."""
    tokenizer: PromptTokenizer
    model_name: str
    vocab_size: int
    max_model_len: int
    num_blocks: int
    eos_token_ids: list[int]
    loaded: LoadedModel
    fatal: Optional[BaseException]          # set when the engine can never step again

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 priority: int = 0, cache_salt: str = "", adapter: str = "",
                 tenant: str = "") -> AsyncGenerator[StreamDelta, None]: ...

    async def abort(self, request_id: str) -> bool: ...

    async def call(self, fn: Callable[[Any], Any]) -> Any: ...     # fn(engine) on the engine's thread

    async def load_lora_adapter(self, name: str, path: str) -> list[str]: ...

    async def unload_lora_adapter(self, name: str) -> list[str]: ...

    async def shutdown(self) -> None: ...
