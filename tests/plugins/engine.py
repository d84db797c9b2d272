"""Engine fixtures: a leak check for every engine a test builds, and tiny offline LLMs."""
import time

import pytest


def leaked_blocks(engine) -> list[int]:
    """Blocks still referenced although the engine has nothing left to run."""
    return [b.block_id for b in engine.kv.pool.blocks if b.ref_cnt != 0]


@pytest.fixture
def no_block_leaks():
    """After the test, every block of every live engine must be free or cached (ref count 0).

    Waits a little for engines still winding down (an AsyncLLM processes aborts in its own
    thread), then fails naming the engines and blocks that leaked.
    """
    yield
    from gpu_worker.engine import live_engines
    deadline = time.monotonic() + 5.0
    while True:
        busy = [e for e in list(live_engines) if e.has_unfinished_requests()]
        leaks = {e.model_name: leaked_blocks(e) for e in list(live_engines) if leaked_blocks(e)}
        if (not busy and not leaks) or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert not busy, f"engines still have unfinished requests: {[e.scheduler.requests for e in busy]}"
    assert not leaks, f"blocks leaked (ref count > 0 with nothing running): {leaks}"
    for e in list(live_engines):
        pool = e.kv.pool
        assert pool.num_free_blocks() == pool.num_blocks, "free list lost blocks"
        assert e.kv.req_to_blocks == {}


@pytest.fixture(scope="session")
def tiny_llm_factory(tiny_model_factory):
    """tiny_llm_factory(family="llama", **LLM kwargs) -> an offline LLM, cached per session."""
    from gpu_worker.llm import LLM
    cache: dict = {}

    def make(family: str = "llama", **kwargs):
        key = (family, tuple(sorted((k, repr(v)) for k, v in kwargs.items())))
        if key not in cache:
            cache[key] = LLM(tiny_model_factory(family), device="cpu", **kwargs)
        return cache[key]

    return make


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy 2-core machine thread
    hand-offs cost more than the math (tens of times slower); restored afterwards."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
