"""Beam search (gpu_worker/features/beam_search.py): the engine's beams equal a brute-force beam search
over transformers' full logits, width 1 is greedy, beams share KV blocks by reference count
with copy-on-write of the partial block, and nothing leaks (also after an abort)."""
import pytest

from pagoda.gpu_worker.core.outputs import Logprob, TokenLogprobs
from pagoda.gpu_worker.core.sampling_params import SamplingParams
from pagoda.gpu_worker.core.stop import LENGTH, check_stop, stop_token_ids
from pagoda.gpu_worker.features.beam_search import BeamSearchParams, Candidate, beam_score, candidates, select

pytestmark = pytest.mark.usefixtures("no_block_leaks", "one_torch_thread")

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], list(range(20, 45))]


@pytest.fixture(scope="module")
def hf_model(tiny_model):
    import torch
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    return model.eval()


def reference_beam_search(model, prompt, width, max_tokens, eos_ids, length_penalty=1.0, ignore_eos=False):
    """vLLM's beam search written out plainly, every candidate's logits from a full forward of
    its whole sequence (no KV cache): [(tokens with the prompt, cum_logprob)], best first."""
    import torch
    beams, done = [(list(prompt), 0.0)], []
    with torch.no_grad():
        for _ in range(max_tokens):
            if not beams:
                break
            cands = []
            for toks, cum in beams:
                lp = torch.log_softmax(model(torch.tensor([toks])).logits[0, -1].float(), dim=-1)
                vals, ids = lp.topk(2 * width)
                for v, t in zip(vals.tolist(), ids.tolist()):
                    (done if t in eos_ids and not ignore_eos else cands).append((toks + [t], cum + v))
            cands.sort(key=lambda c: c[1], reverse=True)
            beams = cands[:width]
    done += beams

    def score(c):
        toks, cum = c
        return cum / ((len(toks) - (toks[-1] in eos_ids)) ** length_penalty)
    return sorted(done, key=score, reverse=True)[:width]


@pytest.mark.parametrize("setup", [
    dict(block_size=8),                                        # the partial block is copied on fork
    dict(block_size=16, enable_prefix_caching=False),
    dict(block_size=8, num_kv_blocks=16),                      # beams preempted: recomputed
    # Preempted beams swapped to the host tier and back (their shared blocks come back as copies).
    dict(block_size=8, num_kv_blocks=16, preemption_mode="swap", kv_offloading_size=0.01),
    # Searches queue for sequence slots: one starts when all its beams fit.
    dict(block_size=8, max_num_seqs=4, max_num_batched_tokens=64),
])
def test_equals_brute_force_reference(tiny_llm_factory, hf_model, setup):
    llm = tiny_llm_factory(**setup)
    eos = llm.engine.eos_token_ids
    width, max_tokens = 4, 10
    for lp in (1.0, 0.5):
        outs = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=width, max_tokens=max_tokens,
                                                         length_penalty=lp))
        for prompt, out in zip(PROMPTS, outs):
            ref = reference_beam_search(hf_model, prompt, width, max_tokens, eos, lp)
            assert [s.tokens for s in out.sequences] == [t for t, _ in ref]
            for s, (toks, cum) in zip(out.sequences, ref):
                assert s.output_token_ids == toks[len(prompt):]
                assert s.cum_logprob == pytest.approx(cum, abs=1e-3)
                assert s.score == pytest.approx(beam_score(len(toks), toks[-1] in eos, cum, lp), abs=1e-3)
                assert s.text == llm.tokenizer.decode(s.output_token_ids, skip_special_tokens=True)
            scores = [s.score for s in out.sequences]
            assert scores == sorted(scores, reverse=True)
    if "num_kv_blocks" in setup:
        assert llm.engine.scheduler.num_preemptions > 0
    if "preemption_mode" in setup:
        assert llm.engine.scheduler.num_swaps > 0


def test_temperature_adds_the_sampled_token_as_a_candidate(tiny_llm_factory, hf_model, monkeypatch):
    """temperature > 0 (vLLM's BeamSearchParams): each beam's step also samples a token at that
    temperature, and a sampled token outside the top 2 * beam_width joins them as a candidate,
    scored by its raw log-probability; the beams still rank by raw log-probability, so the search
    runs to the end with ranked, full-length beams. At temperature 0 the sampled token is the top
    one and nothing joins."""
    import torch

    from pagoda.gpu_worker.features import beam_search
    llm = tiny_llm_factory(block_size=8)
    real = beam_search.candidates

    def search(temperature):
        seen = []

        def watch(offered):
            cands = real(offered)
            seen.append((offered, cands))
            return cands
        monkeypatch.setattr(beam_search, "candidates", watch)
        out = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=3, max_tokens=10, temperature=temperature,
                                                        ignore_eos=True))
        monkeypatch.setattr(beam_search, "candidates", real)
        joined = 0
        for offered, cands in seen:
            for i, (cum, sampled, lps) in enumerate(offered):
                top = [lp.token_id for lp in lps.top]
                assert len(top) == 6
                if sampled not in top:
                    joined += 1
                    assert Candidate(i, sampled, cum + lps.sampled.logprob) in cands
                    assert lps.sampled.logprob <= min(lp.logprob for lp in lps.top)
                elif temperature == 0:
                    assert sampled == top[0]
        return out, joined

    out, joined = search(1.5)
    # At 1.5 about one step in five samples outside the top 6 on the tiny model (84 beam steps
    # here): none at all would mean the temperature never reached the sampler.
    assert joined > 0
    for prompt, o in zip(PROMPTS, out):
        assert len(o.sequences) == 3 and all(len(s.output_token_ids) == 10 for s in o.sequences)
        assert [s.score for s in o.sequences] == sorted((s.score for s in o.sequences), reverse=True)
        # Raw log-probabilities (transformers' full forward), not the temperature's.
        for s in o.sequences:
            with torch.no_grad():
                lp = torch.log_softmax(hf_model(torch.tensor([s.tokens])).logits[0].float(), dim=-1)
            raw = sum(lp[len(prompt) - 1 + j, t].item() for j, t in enumerate(s.output_token_ids))
            assert s.cum_logprob == pytest.approx(raw, abs=1e-3)
    assert search(0.0)[1] == 0


def test_width_one_is_greedy(tiny_llm_factory):
    llm = tiny_llm_factory(block_size=8)
    # vLLM's prompt dicts are taken too.
    by_dict = llm.beam_search([{"prompt_token_ids": PROMPTS[0]}, {"prompt": "hello"}],
                              BeamSearchParams(beam_width=2, max_tokens=4))
    assert [s.tokens for s in by_dict[0].sequences] == \
        [s.tokens for s in llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=2, max_tokens=4))[0].sequences]
    assert by_dict[1].prompt_token_ids == llm.tokenizer.encode_text("hello")
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    beams = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=1, max_tokens=24, ignore_eos=True))
    for g, b in zip(greedy, beams):
        assert [s.output_token_ids for s in b.sequences] == [g.outputs[0].token_ids]


def _run_watching(engine, rid, params, prompt, on_step=None):
    engine.add_request(rid, prompt, params)
    deltas, peak_ref, peak_held, steps = [], 0, 0, 0
    while engine.has_unfinished_requests():
        deltas += engine.step()
        steps += 1
        peak_ref = max(peak_ref, max(b.ref_cnt for b in engine.kv.pool.blocks))
        peak_held = max(peak_held, engine.num_blocks - engine.kv.pool.num_free_blocks())
        if on_step is not None and on_step(steps):
            break
    return deltas, peak_ref, peak_held


def test_beams_share_blocks_and_copy_only_the_partial_one(tiny_llm_factory):
    llm = tiny_llm_factory(block_size=8, num_kv_blocks=256)
    engine = llm.engine
    prompt = list(range(30, 70))        # 5 full blocks shared by every beam
    params = SamplingParams(n=4, use_beam_search=True, max_tokens=20, temperature=0.0)
    copies = engine.kv.num_copies
    deltas, peak_ref, peak_held = _run_watching(engine, "share", params, prompt)
    assert peak_ref >= 4, "the prompt's blocks are held by all 4 beams at once"
    # Unshared, 4 beams of 60 tokens hold 4 * 8 blocks; shared, the prompt's 5 are held once.
    assert peak_held <= 4 * 8 - 3 * 5
    # Copy-on-write copies partial blocks only: at most one per beam per step.
    assert 0 < engine.kv.num_copies - copies <= 4 * 20
    finals = [d for d in deltas if d.finished]
    assert sorted(d.index for d in finals) == [0, 1, 2, 3]
    assert all(d.cumulative_logprob is not None and len(d.token_ids) == 20 for d in finals)
    assert engine.kv.req_to_blocks == {}


def test_copy_on_write_keeps_siblings_apart(tiny_llm_factory, hf_model):
    """Without sharing (every block copied on fork) the beams are the same: the copies keep
    each beam's KV its own, whichever sibling writes first."""
    llm = tiny_llm_factory(block_size=8, num_kv_blocks=256)
    params = BeamSearchParams(beam_width=3, max_tokens=12)
    shared = llm.beam_search(PROMPTS[:2], params)
    llm.engine.kv.share_on_fork = False
    try:
        copied = llm.beam_search(PROMPTS[:2], params)
    finally:
        llm.engine.kv.share_on_fork = True
    assert [[s.tokens for s in o.sequences] for o in shared] == [[s.tokens for s in o.sequences] for o in copied]


def test_abort_mid_search_frees_everything(tiny_llm_factory):
    llm = tiny_llm_factory(block_size=8)
    engine = llm.engine
    params = SamplingParams(n=2, best_of=4, use_beam_search=True, max_tokens=50)
    held = []

    def abort_at(step):
        if step == 5:
            held.append(engine.num_blocks - engine.kv.pool.num_free_blocks())
            engine.abort_request("gone")
        return False
    deltas, _, _ = _run_watching(engine, "gone", params, PROMPTS[2], abort_at)
    assert held and held[0] > 0
    finals = [d for d in deltas if d.finished]
    assert sorted(d.index for d in finals) == [0, 1] and {d.finish_reason for d in finals} == {"abort"}
    assert "gone" not in engine.beam_groups and "gone" not in engine.children
    assert engine.kv.req_to_blocks == {}
    # The engine goes on serving: the same id again, to the end.
    out = llm.generate([PROMPTS[0]], SamplingParams(n=2, best_of=4, use_beam_search=True, max_tokens=6))
    assert [len(c.token_ids) for c in out[0].outputs] == [6, 6]


def test_n_of_best_of_returns_the_best_n(tiny_llm_factory):
    llm = tiny_llm_factory(block_size=8)
    four = llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=4, max_tokens=8))[0].sequences
    two = llm.generate([PROMPTS[0]], SamplingParams(n=2, best_of=4, use_beam_search=True, max_tokens=8))[0]
    assert [c.token_ids for c in two.outputs] == [s.output_token_ids for s in four[:2]]
    assert [c.cumulative_logprob for c in two.outputs] == pytest.approx([s.cum_logprob for s in four[:2]])


def _lps(pairs, sampled):
    return TokenLogprobs(Logprob(sampled, dict(pairs).get(sampled, -9.0)), [Logprob(t, v) for t, v in pairs])


def test_selection_completes_eos_and_ranks_the_rest():
    eos = [2]
    offered = [(-1.0, 7, _lps([(7, -0.1), (2, -0.2), (8, -3.0)], 7)),
               (-2.0, 9, _lps([(2, -0.05), (9, -0.5), (4, -0.6)], 9))]
    cands = candidates(offered)

    def flags(ignore_eos):
        return [check_stop(c.token, 10, 1, stop_token_ids((), ignore_eos, eos), 0, 16, 64) for c in cands]
    run, done = select(cands, flags(False), 2)
    assert [(c.parent, c.token, f) for c, f in run] == [(0, 7, 0), (1, 9, 0)]
    assert sorted((c.parent, c.token) for c in done) == [(0, 2), (1, 2)]
    run, done = select(cands, flags(True), 2)
    assert done == [] and [(c.parent, c.token) for c, _ in run] == [(0, 7), (0, 2)]
    # A candidate that reaches max_tokens runs on only to complete by length.
    run, _ = select(cands, [LENGTH] * len(cands), 1)
    assert run == [(cands[0], LENGTH)]
    # A sampled token outside the top list is a candidate too (temperature > 0, as vLLM).
    assert Candidate(0, 5, -1.0 - 9.0) in candidates([(-1.0, 5, _lps([(7, -0.1)], 5))])
    # vLLM's score: length counts the prompt and not a final EOS.
    assert beam_score(10, True, -9.0, 1.0) == -1.0 and beam_score(10, False, -9.0, 0.0) == -9.0


@pytest.mark.parametrize("kwargs, field", [
    (dict(n=3, best_of=2), "best_of"),
    (dict(n=2, best_of=3, use_beam_search=False), "best_of"),
    (dict(n=17), "n"),
    (dict(n=2, best_of=40), "best_of"),
    (dict(top_p=0.5), "top_p"),
    (dict(top_k=5), "top_k"),
    (dict(min_p=0.1), "min_p"),
    (dict(presence_penalty=1.0), "presence_penalty"),
    (dict(stop=["x"]), "stop"),
    (dict(logprobs=2), "logprobs"),
    (dict(seed=1), "seed"),
    (dict(length_penalty=float("nan")), "length_penalty"),
])
def test_bad_beam_params_name_the_field(tiny_llm_factory, kwargs, field):
    llm = tiny_llm_factory(block_size=8)
    params = SamplingParams(**{"use_beam_search": True, "n": 2, **kwargs})
    with pytest.raises(ValueError, match=f"^{field}:"):
        llm.generate([PROMPTS[0]], params)


def test_engine_limits_name_the_field(tiny_llm_factory):
    llm = tiny_llm_factory(block_size=8, max_num_seqs=4, num_kv_blocks=32)
    with pytest.raises(ValueError, match="^best_of: beam width 8 exceeds max_num_seqs=4"):
        llm.generate([PROMPTS[0]], SamplingParams(n=2, best_of=8, use_beam_search=True))
    with pytest.raises(ValueError, match="^max_tokens:"):
        llm.generate([PROMPTS[0]], SamplingParams(n=4, use_beam_search=True, max_tokens=100))


def _check_copy_blocks(llm):
    """ModelRunner.copy_blocks copies whole blocks, every layer's K and V, byte for byte, and
    touches no other block."""
    import torch
    runner = llm.engine.runner
    for k, v in runner.kv_caches:
        for t in (k, v):
            t.view(torch.uint8).random_(0, 120)     # bytes below 120: no fp8 NaN patterns
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    runner.copy_blocks([(3, 7), (5, 1), (3, 2)])
    for (k0, v0), (k, v) in zip(before, runner.kv_caches):
        for t0, t in ((k0, k), (v0, v)):
            a, b = t0.view(torch.uint8), t.view(torch.uint8)
            assert torch.equal(b[7], a[3]) and torch.equal(b[1], a[5]) and torch.equal(b[2], a[3])
            untouched = [i for i in range(t.shape[0]) if i not in (1, 2, 7)]
            assert torch.equal(b[untouched], a[untouched])


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_copy_blocks_cpu(tiny_model, kv_dtype):
    from pagoda.gpu_worker.engine.llm import LLM
    _check_copy_blocks(LLM(tiny_model, device="cpu", block_size=8, num_kv_blocks=16, kv_cache_dtype=kv_dtype))


def test_async_scheduling_gives_the_same_beams(tiny_llm_factory):
    """Pipelined steps (async scheduling): a beam is never scheduled before its step is back, so
    the search is the same as with collect-first steps."""
    params = BeamSearchParams(beam_width=4, max_tokens=12)
    sync = tiny_llm_factory(block_size=8).beam_search(PROMPTS, params)
    piped = tiny_llm_factory(block_size=8, async_scheduling="on").beam_search(PROMPTS, params)
    assert [[s.tokens for s in o.sequences] for o in piped] == [[s.tokens for s in o.sequences] for o in sync]


def test_beam_search_on_cuda_matches_cpu(tiny_model):
    """The CUDA twin (bench/gpu_check.sh): block copies on the device, Triton attention over
    shared blocks, async scheduling (auto: on) holding beams until their step is back; the
    beams equal the CPU engine's, and copy_blocks is exact there too (fp8 included)."""
    import torch
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from pagoda.gpu_worker.engine.llm import LLM
    params = BeamSearchParams(beam_width=4, max_tokens=16)
    cpu = LLM(tiny_model, device="cpu", block_size=16).beam_search(PROMPTS, params)
    cuda_llm = LLM(tiny_model, device="cuda", dtype="float32", block_size=16, num_kv_blocks=128)
    got = cuda_llm.beam_search(PROMPTS, params)
    assert [[s.tokens for s in o.sequences] for o in got] == [[s.tokens for s in o.sequences] for o in cpu]
    for g, c in zip(got, cpu):
        assert [s.cum_logprob for s in g.sequences] == pytest.approx([s.cum_logprob for s in c.sequences], abs=1e-3)
    assert cuda_llm.engine.kv.num_copies > 0
    _check_copy_blocks(cuda_llm)
    _check_copy_blocks(LLM(tiny_model, device="cuda", block_size=16, num_kv_blocks=16, kv_cache_dtype="fp8",
                           enforce_eager=True))


def test_fork_shares_blocks_and_copies_the_partial_one_on_write():
    from pagoda.gpu_worker.core.kv_cache_manager import KVCacheManager
    from pagoda.gpu_worker.core.request import Request
    from pagoda.protos.block_hash import namespace_root
    kv = KVCacheManager(16, 4)
    parent = Request("p", [1, 2, 3, 4, 5, 6], SamplingParams(), 4, namespace_root("m"))
    assert [b.block_id for b in kv.allocate_slots(parent, 6)] == [0, 1]
    parent.num_computed_tokens = 6
    c1, c2 = parent.fork("c1", 9), parent.fork("c2", 10)
    assert kv.fork(parent, c1) == kv.fork(parent, c2) == 6
    kv.free(parent)
    assert [b.ref_cnt for b in kv.pool.blocks[:3]] == [2, 2, 0]
    for c in (c1, c2):
        c.num_computed_tokens = 6
    # c1 writes position 6 into the shared partial block 1: it gets a copy (block 2) first.
    assert kv.block_ids(c1) == [0, 1] and [b.block_id for b in kv.allocate_slots(c1, 1)] == [0, 2]
    assert [b.ref_cnt for b in kv.pool.blocks[:3]] == [2, 1, 1]
    # c2 is now block 1's only holder: it writes in place, nothing copied.
    assert [b.block_id for b in kv.allocate_slots(c2, 1)] == [0, 1]
    assert kv.take_copies() == [(1, 2)] and kv.num_copies == 1
    # A fork at a block boundary copies nothing: the next token starts a new block.
    for c, t in ((c1, 11), (c2, 12)):
        c.append_output_token(t)
        c.num_computed_tokens = 8
    g = c1.fork("g", 13)
    kv.fork(c1, g)
    g.num_computed_tokens = 8
    assert [b.block_id for b in kv.allocate_slots(g, 1)] == [0, 2, 3] and kv.take_copies() == []
    for r in (c1, c2, g):
        kv.free(r)
    assert kv.pool.num_free_blocks() == 16 and kv.req_to_blocks == {}
    # No block free for the copy: allocate_slots fails cleanly, nothing changed.
    small = KVCacheManager(2, 4)
    parent = Request("p", [1, 2, 3, 4, 5, 6], SamplingParams(), 4, namespace_root("m"))
    small.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    child = parent.fork("c", 9)
    small.fork(parent, child)
    child.num_computed_tokens = 6
    assert small.allocate_slots(child, 1) is None and small.block_ids(child) == [0, 1]
    assert small.pending_copies == [] and [b.ref_cnt for b in small.pool.blocks] == [2, 2]


def test_ready_beams_make_room_when_nothing_else_can_run():
    """The scheduler's way out: every sequence slot is held by ready beams and their sibling
    waits; the last ready beam leaves (blocks and row freed, its candidates kept)."""
    from pagoda.gpu_worker.core.kv_cache_manager import KVCacheManager
    from pagoda.gpu_worker.core.outputs import ModelRunnerOutput
    from pagoda.gpu_worker.core.request import Request, RequestStatus
    from pagoda.gpu_worker.core.scheduler import Scheduler
    from pagoda.protos.block_hash import namespace_root
    s = Scheduler(KVCacheManager(32, 4), 2, 64)
    beams = [Request(f"b{i}", [1 + i, 2, 3], SamplingParams(logprobs=2), 4, namespace_root("m")) for i in range(3)]
    for b in beams:
        b.is_beam = True
        s.add_request(b)
    out = s.schedule()
    assert [x.req_id for x in out.scheduled] == ["b0", "b1"]
    lps = TokenLogprobs(Logprob(7, -0.1), [Logprob(7, -0.1), Logprob(8, -2.0)])
    s.update_from_output(out, ModelRunnerOutput({"b0": 7, "b1": 7}, logprobs={"b0": lps, "b1": lps}))
    assert beams[0].beam_ready == (7, lps) and beams[0].output_token_ids == []   # nothing appended
    out = s.schedule()
    assert [x.req_id for x in out.scheduled] == ["b2"]
    assert "b1" not in s.requests and beams[1].status is RequestStatus.PREEMPTED
    assert beams[1].beam_ready == (7, lps) and s.kv.block_ids(beams[1]) == [] and "b1" in out.finished_req_ids
    assert [r.req_id for r in s.running] == ["b0", "b2"]


def test_a_released_parent_continues_by_recompute(tiny_llm_factory):
    """A ready beam that left the scheduler (its KV gone) still has its continuations: its
    children recompute their prefix. The beams are those of an undisturbed search."""
    # A 184-token prompt prefilled in 64-token chunks leaves 2 tokens of budget to the 4 beams
    # in its last chunk's step: 2 beams run, 2 wait, so ready beams are parked there.
    llm = tiny_llm_factory(block_size=8, max_num_batched_tokens=64)
    engine = llm.engine
    params = SamplingParams(n=4, use_beam_search=True, max_tokens=8)
    other = SamplingParams(temperature=0.0, max_tokens=4)

    def run(release: bool):
        engine.add_request("beam", PROMPTS[0], params)
        # A fresh prompt each run: a cached one would need no chunks.
        engine.add_request("other", list(range(100 + release, 284 + release)), other)
        finals, released = {}, []
        while engine.has_unfinished_requests():
            for d in engine.step():
                if d.finished and d.request_id == "beam":
                    finals[d.index] = d.token_ids
            parked = [r for r in engine.scheduler.running if r.beam_ready is not None]
            if release and parked and not released:
                engine.scheduler._release(parked[0])
                released.append(parked[0].req_id)
        return [finals[i] for i in range(4)], released

    plain, _ = run(False)
    disturbed, released = run(True)
    assert released and disturbed == plain
