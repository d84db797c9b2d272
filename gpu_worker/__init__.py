"""One GPU worker: paged-KV continuous-batching engine, model runner, models and gRPC server.

Offline use: `from gpu_worker import LLM, SamplingParams`.
"""
from gpu_worker.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "AsyncLLM", "EngineConfig"]


def __getattr__(name):
    # Lazy, so `python -m gpu_worker.tiny_model` and the sampling params stay light.
    if name == "LLM":
        from gpu_worker.llm import LLM
        return LLM
    if name == "AsyncLLM":
        from gpu_worker.async_llm import AsyncLLM
        return AsyncLLM
    if name == "EngineConfig":
        from gpu_worker.config import EngineConfig
        return EngineConfig
    raise AttributeError(name)
