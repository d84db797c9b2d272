"""Fewer stream messages per token (gpu_worker/serving/coalesce.py): deltas that queue up go out merged,
and --stream-interval N holds a sequence's tokens until N wait (first at once, last flushes).

What a stream says must not change: with any interval, over a real worker on loopback, the
chunks concatenate to what interval 1 sends (text, token ids, logprobs, finish and stop reason,
usage), with stop strings, n = 2 and prompt logprobs; an abort mid-stream flushes what was held.
"""
import asyncio
import time

import grpc
import pytest

from pagoda.clients import AsyncPagodaClient, PagodaClient
from pagoda.gpu_worker.core.outputs import Logprob, StreamDelta, TokenLogprobs
from pagoda.gpu_worker.serving.coalesce import Coalescer, merge
from pagoda.protos.pagoda.v1 import pagoda_pb2 as pb
from pagoda.protos.pagoda.v1 import pagoda_pb2_grpc as pb_grpc

PROMPT = "The quick brown fox jumps over the lazy dog."


def delta(index, tokens, text, finished=False, lps=None, prompt_lps=None, out=0):
    return StreamDelta("r", index, list(tokens), text, lps, finished, "length" if finished else None, None,
                       7, 3, out, prompt_lps)


def lp(t):
    return TokenLogprobs(Logprob(t, -0.5 * t), [Logprob(t, -0.5 * t), Logprob(t + 1, -1.0)])


# ---- the rules, on hand-made deltas ------------------------------------------------------

def test_merge_concatenates_and_takes_running_figures_from_the_later():
    a = delta(0, [1, 2], "ab", lps=[lp(1), lp(2)], prompt_lps=[lp(9)], out=2)
    b = StreamDelta("r", 0, [3], "c", [lp(3)], True, "stop", "c", 7, 4, 3)
    m = merge(a, b)
    assert (m.token_ids, m.text, m.logprobs, m.prompt_logprobs) == ([1, 2, 3], "abc", [lp(1), lp(2), lp(3)], [lp(9)])
    assert (m.finished, m.finish_reason, m.stop_reason, m.num_output_tokens, m.num_cached_tokens) == \
        (True, "stop", "c", 3, 4)
    # No logprobs asked: None stays None (the worker sends none), not [].
    assert merge(delta(0, [1], "a"), delta(0, [2], "b")).logprobs is None
    assert a.token_ids == [1, 2] and a.text == "ab"        # inputs untouched


def test_interval_one_merges_only_what_queued_per_sequence():
    c = Coalescer(1)
    assert [(d.index, d.token_ids) for d in c.push([delta(0, [1], "a")])] == [(0, [1])]
    # Three steps queued while the last message was out: one delta per sequence.
    out = c.push([delta(0, [2], "b"), delta(1, [5], "x"), delta(0, [3], "c"), delta(1, [6], "y")])
    assert [(d.index, d.token_ids, d.text) for d in out] == [(0, [2, 3], "bc"), (1, [5, 6], "xy")]
    assert c.push([]) == []


def test_interval_holds_until_n_tokens_first_at_once_last_flushes():
    c = Coalescer(3)
    sent = [c.push([delta(0, [t], str(t), out=t)]) for t in range(1, 7)]
    assert [[d.token_ids for d in s] for s in sent] == [[[1]], [], [], [[2, 3, 4]], [], []]
    last = c.push([delta(0, [7], "7", finished=True, out=7)])
    assert [(d.token_ids, d.text, d.finished, d.num_output_tokens) for d in last] == [([5, 6, 7], "567", True, 7)]
    # An abort (no new token, finished) flushes what is held too.
    c = Coalescer(4)
    c.push([delta(0, [1], "a")])
    assert c.push([delta(0, [2], "b")]) == []
    assert [(d.token_ids, d.finished) for d in c.push([delta(0, [], "", finished=True)])] == [([2], True)]


def test_interval_counts_per_sequence_and_a_big_delta_goes_at_once():
    c = Coalescer(2)
    assert len(c.push([delta(0, [1], "a"), delta(1, [1], "a")])) == 2      # both firsts
    assert c.push([delta(0, [2], "b")]) == []
    out = c.push([delta(1, [2, 3], "bc"), delta(0, [3], "c")])            # index 1: two tokens at once
    assert sorted((d.index, d.token_ids) for d in out) == [(0, [2, 3]), (1, [2, 3])]


def test_interval_below_one_is_refused_naming_it():
    from pagoda.gpu_worker.core.config import EngineConfig
    from pagoda.gpu_worker.serving.args import build_parser
    with pytest.raises(ValueError, match="stream_interval"):
        Coalescer(0)
    with pytest.raises(ValueError, match="stream_interval"):
        EngineConfig(model="/nowhere/m", stream_interval=0)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--model", "m", "--stream-interval", "0"])
    assert build_parser().parse_args(["--model", "m"]).stream_interval == 1
    assert build_parser().parse_args(["--model", "m", "--stream-interval", "8"]).stream_interval == 8


# ---- a consumer that is behind, in process -----------------------------------------------

@pytest.mark.usefixtures("no_block_leaks", "one_torch_thread")
def test_a_consumer_behind_gets_one_merged_delta(tiny_model):
    from pagoda.gpu_worker.core.config import EngineConfig
    from pagoda.gpu_worker.core.sampling_params import SamplingParams
    from pagoda.gpu_worker.serving.async_llm import AsyncLLM
    # No prefix cache: the second request's prefill then computes what the first one's did, so
    # their logprobs are equal to the bit (a cache hit would prefill one row, through the
    # small-batch linear, whose sums round differently from the 20-row GEMM's).
    eng = AsyncLLM(EngineConfig(model=tiny_model, device="cpu", num_kv_blocks=32, enable_prefix_caching=False))
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)

    async def main():
        fast = [d async for d in eng.generate("fast", list(range(5, 25)), sp)]
        slow = []
        stream = eng.generate("slow", list(range(5, 25)), sp)
        slow.append(await stream.__anext__())
        deadline = time.monotonic() + 10
        while eng.stats().running or eng.stats().waiting:    # every step done, nothing read
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)        # the last step's delta crosses over after its stats
        slow += [d async for d in stream]
        await eng.shutdown()
        return fast, slow

    fast, slow = asyncio.run(main())
    # Even the reader that keeps up may find two steps queued on a busy machine; the one that
    # stops reading gets everything since in one delta.
    assert len(fast) > 2 and len(slow) == 2 and sum(len(d.token_ids) for d in slow) == 12
    assert [t for d in slow for t in d.token_ids] == [t for d in fast for t in d.token_ids]
    assert "".join(d.text for d in slow) == "".join(d.text for d in fast)
    assert [x for d in slow for x in d.logprobs] == [x for d in fast for x in d.logprobs]
    assert (slow[-1].finished, slow[-1].finish_reason, slow[-1].num_output_tokens) == (True, "length", 12)


# ---- real workers on loopback: interval 1 against 4 -----------------------------------------

@pytest.fixture(scope="module")
def workers(start_worker_module, tiny_model):
    flags = dict(num_kv_blocks=48, block_size=16, max_model_len=512)
    return {n: start_worker_module(tiny_model, stream_interval=n, **flags) for n in (1, 4)}


def stream(address, req):
    with grpc.insecure_channel(address) as ch:
        return list(pb_grpc.GenerationStub(ch).Generate(req, timeout=60))


def folded(chunks):
    """Per index: everything the stream said about that sequence, chunking aside."""
    out = {}
    for r in chunks:
        s = out.setdefault(r.index, dict(text="", ids=[], lps=[], plps=[], fin=[]))
        s["text"] += r.text
        s["ids"] += list(r.token_ids)
        s["lps"] += [x.SerializeToString() for x in r.logprobs]
        s["plps"] += [x.SerializeToString() for x in r.prompt_logprobs]
        if r.finished:
            s["fin"].append((r.finish_reason, r.WhichOneof("stop_reason"), r.stop_str, r.stop_token_id,
                             r.usage.SerializeToString()))
    return out


def request(**sampling):
    return pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingParams(**sampling))


def check_interval_chunks(chunks, n):
    per = {}
    for r in chunks:
        per.setdefault(r.index, []).append(r)
    for rs in per.values():
        # The rest held until n wait (the first goes at once, but may carry two tokens when both
        # steps queued before its send: the unit tests above pin that rule down).
        assert all(len(r.token_ids) >= n for r in rs[1:-1])
        assert [r.finished for r in rs] == [False] * (len(rs) - 1) + [True]
    return per


@pytest.mark.slow
def test_chunks_concatenate_to_what_interval_one_sends(workers):
    # A stop string the greedy output is known to reach (found in an unstopped run), so that the
    # detokenizer holds text back and the stream ends on it.
    plain = "".join(r.text for r in stream(workers[1].address, request(temperature=0.0, max_tokens=40,
                                                                       ignore_eos=True)))
    stop = plain[len(plain) // 2:len(plain) // 2 + 3]
    assert len(stop) == 3
    cases = [request(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop], logprobs=2),
             request(temperature=0.8, seed=7, n=2, max_tokens=23, ignore_eos=True, logprobs=1, prompt_logprobs=1),
             request(temperature=0.0, max_tokens=1, ignore_eos=True)]
    for req in cases:
        one, four = stream(workers[1].address, req), stream(workers[4].address, req)
        assert folded(four) == folded(one)
        per = check_interval_chunks(four, 4)
        want = req.sampling.max_tokens
        if req.sampling.stop:
            assert folded(one)[0]["fin"][0][:3] == (pb.FINISH_REASON_STOP, "stop_str", stop)
        else:
            assert all(len(folded(one)[i]["ids"]) == want for i in per)
        if req.sampling.HasField("prompt_logprobs"):     # on index 0's first chunk, as before
            assert len(per[0][0].prompt_logprobs) == len(folded(one)[0]["plps"]) > 0


@pytest.mark.slow
def test_abort_mid_stream_flushes_what_was_held(workers):
    w = workers[4]

    async def run():
        async with AsyncPagodaClient(w.address, retries=0) as c:
            chunks = []
            async for ch in c.generate(PROMPT, max_tokens=400, ignore_eos=True, request_id="abort-held"):
                chunks.append(ch)
                if len(chunks) == 2:
                    assert await c.abort("abort-held") is True
            return chunks

    chunks = asyncio.run(run())
    last = chunks[-1]
    assert last.finished and last.finish_reason == "abort"
    assert last.usage is not None and 0 < last.usage.completion_tokens < 400
    # Every token the engine counted reached the caller, none stayed held in the worker.
    assert sum(len(c.token_ids) for c in chunks) == last.usage.completion_tokens
    with PagodaClient(w.address, retries=0) as c:
        deadline = time.monotonic() + 10
        while (load := c.load()).running or load.free_blocks != load.num_blocks:
            assert time.monotonic() < deadline, load
            time.sleep(0.05)
