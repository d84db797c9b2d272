"""Async output processing (engine.step with async_output): a step's text, stop strings and deltas
are worked out after the next step is launched. On CUDA the launch returns while the GPU runs; on a
CPU the same order runs synchronously, which is what these tests check: outputs equal the
synchronous engine's, stop strings found a step late drop the extra token, aborts of a request in
flight, and the order itself."""
import random

import pytest

from gpu_worker.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("no_block_leaks", "one_torch_thread")


def rand_ids(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(5, 600) for _ in range(n)]


def summary(outs):
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason,
              [(lp.sampled.token_id, round(lp.sampled.logprob, 4)) for lp in c.logprobs or []])
             for c in o.outputs] for o in outs]


def test_auto_is_off_on_a_cpu(tiny_llm_factory):
    assert tiny_llm_factory("llama", num_kv_blocks=64).engine.async_output is False
    assert tiny_llm_factory("llama", num_kv_blocks=64, async_output="on").engine.async_output is True


@pytest.mark.parametrize("num_kv_blocks", [256, 14])   # 14 blocks of 16: requests preempt each other
def test_outputs_equal_the_synchronous_engine(tiny_llm_factory, num_kv_blocks):
    sync = tiny_llm_factory("llama", num_kv_blocks=num_kv_blocks, max_num_seqs=8)
    pipe = tiny_llm_factory("llama", num_kv_blocks=num_kv_blocks, max_num_seqs=8, async_output="on")
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
    got = summary(pipe.generate(prompts, params))
    assert got == want
    assert want[0][0][2] == "stop" and want[1][0][2] == "stop" and want[2][0][2] == "length"
    assert pipe.engine.in_flight is None and not pipe.engine.has_unfinished_requests()


def test_next_step_is_launched_before_this_steps_text(tiny_llm_factory):
    llm = tiny_llm_factory("llama", num_kv_blocks=64, async_output="on")
    engine, runner, log = llm.engine, llm.engine.runner, []
    launch, on_token = runner.launch, engine._on_token

    def logged_launch(out):
        log.append("launch")
        return launch(out)

    def logged_on_token(req, flags):
        log.append("text")
        return on_token(req, flags)

    runner.launch, engine._on_token = logged_launch, logged_on_token
    try:
        llm.generate([rand_ids(12, 1)], SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0))
    finally:
        del runner.launch, engine._on_token
    # Step k's token is turned into text only after step k+1 is launched; the last comes alone.
    assert log == ["launch", "launch", "text", "launch", "text", "launch", "text", "text"]


def test_stop_string_in_flight_drops_the_extra_token_and_frees_blocks(tiny_llm_factory):
    llm = tiny_llm_factory("llama", num_kv_blocks=64, async_output="on")
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
    llm = tiny_llm_factory("llama", num_kv_blocks=64, async_output="on")
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
def test_cuda_async_output_equals_synchronous(tiny_model):
    """On CUDA auto means on: the launch returns while the GPU runs, and the outputs still equal the
    synchronous engine's (the CPU twin above checks the same order without a GPU)."""
    from gpu_worker.llm import LLM
    prompts = [rand_ids(20 + 5 * i, 40 + i) for i in range(4)]
    params = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0, logprobs=1)
    runs = {}
    for mode in ("auto", "off"):
        llm = LLM(tiny_model, device="cuda", dtype="float32", num_kv_blocks=64, async_output=mode)
        assert llm.engine.async_output is (mode == "auto")
        runs[mode] = summary(llm.generate(prompts, params))
    assert runs["auto"] == runs["off"]
