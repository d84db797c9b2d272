"""One GPU worker: paged-KV continuous-batching engine, model runner, models and gRPC server.

Offline use: `from gpu_worker import LLM, SamplingParams`.
"""
import os
import sys

# OpenMP threads that wait for work sleep at once instead of spinning (libgomp reads this once,
# when torch loads it, so only before the first `import torch`). A spinning thread holds its core
# while the thread it waits for may sit in the run queue: on a CPU shared with other processes
# a decode step of the vs_vllm model took 450 ms of CPU spinning against 80 ms sleeping
# (bench/RESULTS.md, "pagoda vs vLLM"). Set OMP_WAIT_POLICY=ACTIVE for a machine of its own.
if "torch" not in sys.modules:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from gpu_worker.sampling_params import SamplingParams  # noqa: E402

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
