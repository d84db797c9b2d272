"""AsyncLLM: concurrent streams over one engine thread, abort by id, early consumer exit,
errors before the first delta, the waiting-queue bound, shutdown."""
import asyncio
import random
import time

import pytest

from pagoda.gpu_worker.core.config import EngineConfig
from pagoda.gpu_worker.core.sampling_params import SamplingParams
from pagoda.gpu_worker.serving.async_llm import AsyncLLM, QueueFullError

pytestmark = pytest.mark.usefixtures("no_block_leaks", "one_torch_thread")


def rand_ids(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(5, 600) for _ in range(n)]


@pytest.fixture(scope="module")
def engine(tiny_model, one_torch_thread):
    eng = AsyncLLM(EngineConfig(model=tiny_model, device="cpu", num_kv_blocks=96, max_num_seqs=8,
                                max_waiting=64))
    yield eng
    asyncio.run(eng.shutdown())


async def collect(agen):
    return [d async for d in agen]


async def wait_idle(eng, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = eng.stats()
        if s.running == 0 and s.waiting == 0 and s.free_blocks == s.num_blocks:
            return s
        await asyncio.sleep(0.01)
    raise AssertionError(f"engine not idle: {eng.stats()}")


def test_many_concurrent_streams_match_offline(engine, tiny_llm_factory):
    prompts = [rand_ids(5 + 13 * i, i) for i in range(12)]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    offline = tiny_llm_factory("llama", num_kv_blocks=96)
    want = [o.outputs[0] for o in offline.generate(prompts, sp)]

    async def main():
        return await asyncio.gather(*[collect(engine.generate(f"c{i}", p, sp))
                                      for i, p in enumerate(prompts)])

    results = asyncio.run(main())
    for deltas, w in zip(results, want):
        assert [t for d in deltas for t in d.token_ids] == w.token_ids
        assert "".join(d.text for d in deltas) == w.text
        assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
        assert deltas[-1].finish_reason == "length" and deltas[-1].num_output_tokens == 12


def test_n_children_stream_with_indices(engine):
    sp = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    deltas = asyncio.run(collect(engine.generate("multi", rand_ids(40, 1), sp)))
    per = {i: [d for d in deltas if d.index == i] for i in range(3)}
    # Six tokens each (in six deltas, or fewer where steps queued up and were merged).
    assert all(sum(len(d.token_ids) for d in v) == 6 and [d.finished for d in v][-1:] == [True]
               and sum(d.finished for d in v) == 1 for v in per.values())
    assert {d.request_id for d in deltas} == {"multi"}


def test_abort_by_id_ends_stream_and_frees_blocks(engine):
    async def main():
        sp = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        agen = engine.generate("long", rand_ids(50, 2), sp)
        first = await agen.__anext__()
        assert engine.stats().running == 1
        assert await engine.abort("long") is True
        rest = [d async for d in agen]
        assert await engine.abort("long") is False
        return first, rest, await wait_idle(engine)

    first, rest, stats = asyncio.run(main())
    assert first.token_ids and not first.finished
    assert rest[-1].finished and rest[-1].finish_reason == "abort"
    assert len(rest) < 399


def test_consumer_that_stops_early_aborts(engine):
    async def main():
        sp = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        agen = engine.generate("quitter", rand_ids(30, 3), sp)
        await agen.__anext__()
        await agen.aclose()
        await wait_idle(engine)

        async def consume():
            async for _ in engine.generate("cancelled", rand_ids(30, 4), sp):
                pass

        task = asyncio.create_task(consume())
        deadline = time.monotonic() + 10
        while engine.stats().running == 0:
            assert time.monotonic() < deadline and not task.done()
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_idle(engine)
        # The ids can be used again at once.
        again = await collect(engine.generate("quitter", [5, 6], SamplingParams(max_tokens=2)))
        assert again[-1].finished

    asyncio.run(main())


def test_bad_input_raises_before_first_delta_and_others_continue(engine):
    async def main():
        sp = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
        good = asyncio.create_task(collect(engine.generate("ok", rand_ids(20, 5), sp)))
        await asyncio.sleep(0)
        for field, ids, params in [("prompt_token_ids", [], sp),
                                   ("prompt_token_ids", [10**7], sp),
                                   ("temperature", [5], SamplingParams(temperature=-1.0)),
                                   ("max_tokens", [5], SamplingParams(max_tokens=0))]:
            with pytest.raises(ValueError, match=field):
                await collect(engine.generate(f"bad-{field}", ids, params))
        with pytest.raises(ValueError, match="request_id"):
            await collect(engine.generate("ok", [5], sp))
        return await good

    deltas = asyncio.run(main())
    assert sum(len(d.token_ids) for d in deltas) == 30 and deltas[-1].finish_reason == "length"


def test_queue_full_is_refused(tiny_model):
    eng = AsyncLLM(EngineConfig(model=tiny_model, device="cpu", num_kv_blocks=64, max_num_seqs=1,
                                max_waiting=2))

    async def main():
        sp = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
        streams = [eng.generate(f"q{i}", rand_ids(10, i), sp) for i in range(3)]
        tasks = [asyncio.create_task(collect(s)) for s in streams]
        await asyncio.sleep(0)          # each generator has queued its request
        deadline = time.monotonic() + 10
        while eng.stats().waiting + eng.stats().running < 3:
            assert time.monotonic() < deadline and not any(t.done() for t in tasks), tasks
            await asyncio.sleep(0.005)
        assert eng.stats().waiting == 2
        with pytest.raises(QueueFullError):
            await collect(eng.generate("q-extra", [5, 6], sp))
        for i in range(3):
            await eng.abort(f"q{i}")
        results = await asyncio.gather(*tasks)
        assert all(r[-1].finish_reason == "abort" for r in results)
        await wait_idle(eng)
        await eng.shutdown()
        with pytest.raises(RuntimeError):
            await collect(eng.generate("late", [5], sp))

    asyncio.run(main())


@pytest.mark.parametrize("fairness", ["tenant", "fifo"])
def test_a_queue_another_tenant_filled_still_takes_a_tenants_fair_share(tiny_model, fairness):
    """Tenant A's burst fills the queue (1 running + max_waiting 2); A's next request is refused,
    but tenant B's are taken up to B's share of what the worker holds ((2 + 1) / 2 tenants), as
    long as fairness is on: a burst cannot lock a neighbour out. With fifo the bound is flat."""
    eng = AsyncLLM(EngineConfig(model=tiny_model, device="cpu", num_kv_blocks=64, max_num_seqs=1,
                                max_waiting=2, scheduling_fairness=fairness))

    async def main():
        sp = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
        tasks = [asyncio.create_task(collect(eng.generate(f"a{i}", rand_ids(10, i), sp, tenant="A")))
                 for i in range(3)]
        deadline = time.monotonic() + 10
        while eng.stats().waiting + eng.stats().running < 3:
            assert time.monotonic() < deadline and not any(t.done() for t in tasks), tasks
            await asyncio.sleep(0.005)
        with pytest.raises(QueueFullError):
            await collect(eng.generate("a-extra", [5, 6], sp, tenant="A"))
        taken = []
        for i in range(3):
            gen = eng.generate(f"b{i}", [5, 6 + i], sp, tenant="B")
            first = asyncio.create_task(gen.__anext__())
            await asyncio.sleep(0.05)
            if first.done() and isinstance(first.exception(), QueueFullError):
                break
            taken.append((f"b{i}", gen, first))
        assert len(taken) == (2 if fairness == "tenant" else 0)
        for rid in [f"a{i}" for i in range(3)] + [t[0] for t in taken]:
            await eng.abort(rid)
        await asyncio.gather(*tasks)
        for _, gen, first in taken:
            await first
            await collect(gen)
        await wait_idle(eng)
        await eng.shutdown()

    asyncio.run(main())


def test_an_engine_fault_fails_its_streams_and_the_engine_refuses_the_rest(tiny_model):
    """The forward failing is the engine's own fault (gpu_worker/core/faults.py): every stream
    ends with the error, blocks come back, and the engine is dead (fatal; the worker then
    reports NOT_SERVING, tests/test_fault_isolation.py) instead of serving on a broken device."""
    eng = AsyncLLM(EngineConfig(model=tiny_model, device="cpu", num_kv_blocks=64, max_num_seqs=4))
    runner = eng.engine.runner

    def broken(out):
        raise RuntimeError("device lost")

    async def main():
        sp = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
        prompt = rand_ids(40, 9)
        await collect(eng.generate("before", prompt, sp))
        runner.launch = broken
        with pytest.raises(RuntimeError, match="device lost"):
            await collect(eng.generate("victim", prompt, sp))
        await wait_idle(eng)
        # The cache was reset, so nothing half-written is ever reused.
        assert eng.cached_block_hashes() == []
        assert isinstance(eng.fatal, RuntimeError)
        with pytest.raises(RuntimeError, match="shut down|failed"):
            await collect(eng.generate("after", prompt, sp))
        await eng.shutdown()

    asyncio.run(main())
