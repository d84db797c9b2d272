"""One GPU worker: paged-KV continuous-batching engine, model runner, models and gRPC server.

Offline use: `from pagoda.gpu_worker import LLM, SamplingParams`.
"""
import os
import sys

# OpenMP threads that wait for work spin only briefly, then sleep (libgomp reads this once, when
# torch loads it, so only before the first `import torch`). libgomp's default spin (300,000
# iterations, about a millisecond) holds a core while the thread it waits for may sit in the run
# queue: on a CPU shared with other processes a decode step of the vs_vllm model took 450 ms of
# CPU spinning against 80 ms sleeping. Sleeping at once (OMP_WAIT_POLICY=PASSIVE) costs a
# wake-up per parallel region instead, up to half a millisecond on a virtual machine, and a
# step has dozens: 1,000 iterations (microseconds; libgomp's own figure when threads outnumber
# cores) cover the gaps between back-to-back regions, 15-35% less wall time per step than
# PASSIVE (bench/RESULTS.md, "pagoda vs vLLM"). Setting OMP_WAIT_POLICY or GOMP_SPINCOUNT
# (ACTIVE for a machine of its own) takes over.
if "torch" not in sys.modules and not {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & set(os.environ):
    os.environ["GOMP_SPINCOUNT"] = "1000"

from pagoda.gpu_worker.core.config import EngineConfig  # noqa: E402
from pagoda.gpu_worker.core.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "AsyncLLM", "EngineConfig"]


def __getattr__(name):
    # Every `python -m pagoda.gpu_worker...` (the worker's flag parsing, tiny_model) runs this
    # file first; the engines load torch and the model stack, so they come only when named.
    if name == "LLM":
        from pagoda.gpu_worker.engine.llm import LLM  # lazy: torch and the engine, only when asked for
        return LLM
    if name == "AsyncLLM":
        from pagoda.gpu_worker.serving.async_llm import AsyncLLM  # lazy: torch and the engine, only when asked for
        return AsyncLLM
    raise AttributeError(name)
