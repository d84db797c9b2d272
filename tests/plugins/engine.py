"""Engine fixtures: a leak check for every engine a test builds, tiny offline LLMs, and
hand-built runner steps."""
import time
from dataclasses import dataclass, field

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
    from pagoda.gpu_worker.engine.llm_engine import live_engines
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
        host = e.kv.host
        if host is not None:      # every host slot free or cached: none held by a swap or pinned
            assert not host.swapped and not host.pinned and not e.kv.swapped_tokens
            assert len(host.free) + len(host.cached) == host.num_blocks, "host tier lost slots"


@pytest.fixture(scope="session")
def tiny_llm_factory(tiny_model_factory):
    """tiny_llm_factory(family="llama", **LLM kwargs) -> an offline LLM, cached per session."""
    from pagoda.gpu_worker.engine.llm import LLM
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


@dataclass
class Chunk:
    """A hand-built share of a step, self-contained: the tokens computed (token_ids, sitting
    at start_pos), the whole block table, and the prompt/output that penalties read."""
    req_id: str
    token_ids: list
    start_pos: int
    block_ids: list
    sample: bool = True
    params: object = None
    prompt: list = None
    output: list = field(default_factory=list)
    generator: object = None


def fresh_step(runner, chunks):
    """A SchedulerOutput in which every chunk's request enters the runner's persistent batch
    afresh (rows left from earlier steps are dropped), so tests can hand-build each step."""
    from pagoda.gpu_worker.core.outputs import NewRequest, ScheduledRequest, SchedulerOutput
    from pagoda.gpu_worker.core.sampling_params import SamplingParams
    new, scheduled = [], []
    for c in chunks:
        prompt = list(c.prompt if c.prompt is not None else c.token_ids)
        known, n_prompt = prompt + list(c.output), len(prompt)
        end = c.start_pos + len(c.token_ids)
        if known[c.start_pos:end] != list(c.token_ids) or (end == len(known)) != c.sample:
            # Only the chunk's tokens matter to the model; pad the rest of the row.
            known = [0] * c.start_pos + list(c.token_ids) + ([] if c.sample else [0])
            n_prompt = len(known)
        new.append(NewRequest(c.req_id, known, n_prompt, c.params or SamplingParams(temperature=0.0),
                              list(c.block_ids), c.generator))
        scheduled.append(ScheduledRequest(c.req_id, len(c.token_ids), c.start_pos, c.sample, []))
    return SchedulerOutput(scheduled, new=new, finished_req_ids=set(runner.batch.req_ids))
