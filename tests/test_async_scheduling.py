"""Async scheduling (engine.step with async_scheduling): step N+1 is scheduled and launched before
step N's tokens are back (they are placeholders, fed in on the device), and N's text, stop strings
and deltas are worked out after that. On CUDA the launch returns while the GPU runs; on a CPU the
same order runs synchronously, which is what these tests check: outputs equal the synchronous
engine's (preemption of requests with a token in flight included), tokens found to end a request
a step late are dropped, no step computes past a length the token in flight reaches, requests
that sample from their history go back to the collect-first order, aborts, and the order itself."""
import random

import pytest

from pagoda.gpu_worker.core.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("no_block_leaks", "one_torch_thread")


def rand_ids(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(5, 600) for _ in range(n)]


def summary(outs):
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason,
              [(lp.sampled.token_id, round(lp.sampled.logprob, 4)) for lp in c.logprobs or []])
             for c in o.outputs] for o in outs]


def test_auto_is_off_on_a_cpu(tiny_llm_factory):
    assert tiny_llm_factory("llama", num_kv_blocks=64).engine.async_scheduling is False
    assert tiny_llm_factory("llama", num_kv_blocks=64, async_scheduling="on").engine.async_scheduling is True


@pytest.mark.parametrize("num_kv_blocks", [256, 14])   # 14 blocks of 16: requests preempt each other
def test_outputs_equal_the_synchronous_engine(tiny_llm_factory, num_kv_blocks, monkeypatch):
    # The C linears sum each row alike whatever the batch; the tuner's choice can differ by row
    # bucket (oneDNN at one, the C GEMM at another), and the two orders of steps batch rows
    # differently: a logprob then differs in its last bit, which is not what this is about.
    from pagoda.gpu_worker.models import parallel
    monkeypatch.setattr(parallel, "_CPU_GEMM", "c")
    sync = tiny_llm_factory("llama", num_kv_blocks=num_kv_blocks, max_num_seqs=8)
    pipe = tiny_llm_factory("llama", num_kv_blocks=num_kv_blocks, max_num_seqs=8, async_scheduling="on")
    prompts = [rand_ids(20 + 7 * i, i) for i in range(6)]
    probe = sync.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0))
    text, toks = probe[0].outputs[0].text, probe[1].outputs[0].token_ids
    params = [
        SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0, stop=[text[5:8]]),   # a stop string
        SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[toks[6]]),             # a stop token
        SamplingParams(max_tokens=9, ignore_eos=True, temperature=0.0, logprobs=2),           # length
        SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0, min_tokens=12,
                       stop_token_ids=[toks[3]], stop=[text[2:4]]),                            # held by min_tokens
        SamplingParams(max_tokens=16, ignore_eos=True, temperature=1.0, seed=7, n=2),          # seeded, n > 1
        SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.0, stop=[text[5:8]],
                       include_stop_str_in_output=True),
    ]
    want = summary(sync.generate(prompts, params))
    preempt, in_flight = pipe.engine.scheduler._preempt, []

    def logged_preempt(req):
        in_flight.append(req.num_output_placeholders)
        preempt(req)

    pipe.engine.scheduler._preempt = logged_preempt
    got = summary(pipe.generate(prompts, params))
    assert got == want
    if num_kv_blocks == 14:     # the small pool preempts requests whose token is still in flight
        assert any(in_flight)
    assert want[0][0][2] == "stop" and want[1][0][2] == "stop" and want[2][0][2] == "length"
    assert pipe.engine.in_flight is None and not pipe.engine.has_unfinished_requests()


def step_log(llm, params, prompt=None):
    engine, runner, log = llm.engine, llm.engine.runner, []
    launch, finish, on_token = runner.launch, runner.finish, engine._on_token

    def logged_launch(out):
        log.append("launch")
        return launch(out)

    def logged_finish(step):
        log.append("collect")
        return finish(step)

    def logged_on_token(req, flags):
        log.append("text")
        return on_token(req, flags)

    runner.launch, runner.finish, engine._on_token = logged_launch, logged_finish, logged_on_token
    try:
        out = llm.generate([prompt or rand_ids(12, 1)], params)
    finally:
        del runner.launch, runner.finish, engine._on_token
    return log, out


def test_next_step_is_launched_before_this_one_is_collected(tiny_llm_factory):
    llm = tiny_llm_factory("llama", num_kv_blocks=64, async_scheduling="on")
    log, out = step_log(llm, SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0))
    # Step k+1 is launched before step k's tokens are collected and turned into text. The 4th
    # token ends the request by length, so no 5th step is launched while it is in flight.
    assert log == ["launch", "launch", "collect", "text", "launch", "collect", "text",
                   "launch", "collect", "text", "collect", "text"]
    assert len(out[0].outputs[0].token_ids) == 4 and llm.engine.num_steps == 4


def test_penalties_count_the_token_in_flight(tiny_llm_factory):
    """Penalties count every output token, the one still in flight included (read from the
    previous draw on the device): the pipelined order holds and the outputs equal the
    synchronous engine's. This prompt's greedy output repeats its third token twice, which a
    repetition penalty breaks only if the token just sampled (in flight) is counted."""
    sync = tiny_llm_factory("llama", num_kv_blocks=64)
    llm = tiny_llm_factory("llama", num_kv_blocks=64, async_scheduling="on")
    prompt = rand_ids(12, 59)
    plain = sync.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0))
    assert plain[0].outputs[0].token_ids[2] == plain[0].outputs[0].token_ids[3]
    for params in (SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0, repetition_penalty=1.5),
                   SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0, seed=3, frequency_penalty=2.0,
                                  presence_penalty=1.0, repetition_penalty=1.2)):
        log, out = step_log(llm, params, prompt)
        assert log[:4] == ["launch", "launch", "collect", "text"]
        want = sync.generate([prompt], params)
        assert summary(out) == summary(want)
    greedy_penalised = sync.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0,
                                                              repetition_penalty=1.5))
    assert greedy_penalised[0].outputs[0].token_ids[3] != plain[0].outputs[0].token_ids[3]


def test_stop_string_in_flight_drops_the_extra_token_and_frees_blocks(tiny_llm_factory):
    llm = tiny_llm_factory("llama", num_kv_blocks=64, async_scheduling="on")
    engine = llm.engine
    prompt = rand_ids(16, 3)
    full = llm.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0))[0].outputs[0]
    stop = full.text[3:6]
    engine.add_request("s", prompt, SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0, stop=[stop]))
    deltas, steps = [], engine.num_steps
    while engine.has_unfinished_requests():
        deltas += engine.step()
    tokens = [t for d in deltas for t in d.token_ids]
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason == stop
    assert tokens == full.token_ids[:len(tokens)] and len(tokens) < 12
    assert engine.num_steps - steps == len(tokens) + 1    # one step ran on after the stop string, unseen
    assert engine.kv.req_to_blocks == {}
    # A step holding only ended requests is collected at once: the engine is idle when the
    # caller has every final output.
    out = llm.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0, stop=[stop]))
    assert out[0].outputs[0].finish_reason == "stop" and not engine.has_unfinished_requests()


def test_abort_while_a_step_is_in_flight(tiny_llm_factory):
    llm = tiny_llm_factory("llama", num_kv_blocks=64, async_scheduling="on")
    engine = llm.engine
    engine.add_request("a", rand_ids(16, 4), SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0))
    engine.add_request("b", rand_ids(16, 5), SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0))
    first = engine.step()
    assert first == [] and engine.in_flight is not None
    engine.abort_request("a")
    deltas = list(first)
    while engine.has_unfinished_requests():
        deltas += engine.step()
    a = [d for d in deltas if d.request_id == "a"]
    b = [d for d in deltas if d.request_id == "b"]
    assert [d.finish_reason for d in a] == ["abort"] and a[0].token_ids == []
    assert sum(len(d.token_ids) for d in b) == 3 and b[-1].finish_reason == "length"


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_cuda_async_scheduling_equals_synchronous(tiny_model):
    """On CUDA auto means on: the launch returns while the GPU runs, and the outputs still equal the
    synchronous engine's (the CPU twin above checks the same order without a GPU)."""
    from pagoda.gpu_worker.engine.llm import LLM
    prompts = [rand_ids(20 + 5 * i, 40 + i) for i in range(4)]
    params = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0, logprobs=1)
    runs = {}
    for mode in ("auto", "off"):
        llm = LLM(tiny_model, device="cuda", dtype="float32", num_kv_blocks=64, async_scheduling=mode)
        assert llm.engine.async_scheduling is (mode == "auto")
        runs[mode] = summary(llm.generate(prompts, params))
    assert runs["auto"] == runs["off"]


def test_a_stop_string_in_the_token_of_a_request_preempted_while_it_was_in_flight(tiny_llm_factory):
    """Two 30-token prompts fill a 4-block pool; at step 4 a needs a third block and b is
    preempted while its third token is still in flight. That token lands in the same turn and
    completes b's stop string: b must end there (and leave the waiting queue), not be recomputed."""
    sync = tiny_llm_factory("llama", num_kv_blocks=64)
    pipe = tiny_llm_factory("llama", num_kv_blocks=4, max_num_seqs=2, async_scheduling="on")
    greedy = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)
    for seed in range(20):
        a, b = rand_ids(30, 100 + seed), rand_ids(30, 200 + seed)
        texts = [sync.generate([b], SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0))[0].outputs[0].text
                 for n in (2, 3)]
        stop = texts[1][len(texts[0]):]
        if stop and stop not in texts[0] and texts[1].find(stop) == len(texts[0]):
            break
    else:
        pytest.fail("no prompt whose third token alone completes a stop string")
    engine = pipe.engine
    preempt, seen = engine.scheduler._preempt, []

    def logged_preempt(req):
        seen.append((req.prompt_token_ids == b, req.num_output_tokens, req.num_output_placeholders))
        preempt(req)

    engine.scheduler._preempt = logged_preempt
    try:
        outs = pipe.generate([a, b], [greedy, SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0,
                                                              stop=[stop])])
    finally:
        del engine.scheduler._preempt
    assert seen == [(True, 2, 1)]       # b, with 2 tokens out and its third in flight
    got = outs[1].outputs[0]
    assert got.finish_reason == "stop" and got.stop_reason == stop and len(got.token_ids) == 3
    assert outs[0].outputs[0].token_ids == sync.generate([a], greedy)[0].outputs[0].token_ids
    assert not engine.has_unfinished_requests() and engine.scheduler.num_waiting() == 0
