"""Scheduler: token budget and chunked prefill, preemption, priorities, max_num_seqs, abort."""
from pagoda.gpu_worker.core.kv_cache_manager import KVCacheManager
from pagoda.gpu_worker.core.outputs import ModelRunnerOutput
from pagoda.gpu_worker.core.request import Request, RequestStatus
from pagoda.gpu_worker.core.sampling_params import SamplingParams
from pagoda.gpu_worker.core.scheduler import Scheduler
from pagoda.protos.block_hash import namespace_root

BS = 4
ROOT = namespace_root("m")


def make(num_blocks=32, max_num_seqs=8, budget=64, policy="fcfs", caching=True):
    kv = KVCacheManager(num_blocks, BS, caching)
    return Scheduler(kv, max_num_seqs, budget, policy)


def req(rid, n_prompt, priority=0, base=None):
    base = hash(rid) % 1000 if base is None else base
    return Request(rid, [base + i for i in range(n_prompt)], SamplingParams(), BS, ROOT,
                   priority=priority)


def run_step(s, token=7):
    out = s.schedule()
    sampled = {x.req_id: token for x in out.scheduled if x.sample}
    s.update_from_output(out, ModelRunnerOutput(sampled_token_ids=sampled))
    return out


def chunks(out):
    return [(x.req_id, x.num_tokens, x.start_pos, x.sample) for x in out.scheduled]


def test_chunked_prefill_respects_budget_then_decodes():
    s = make(budget=8)
    s.add_request(req("a", 20))
    assert chunks(run_step(s)) == [("a", 8, 0, False)]
    assert chunks(run_step(s)) == [("a", 8, 8, False)]
    out = run_step(s)
    assert chunks(out) == [("a", 4, 16, True)]
    assert s.kv.block_ids(s.requests["a"]) == [0, 1, 2, 3, 4]
    assert s.requests["a"].output_token_ids == [7]
    assert chunks(run_step(s)) == [("a", 1, 20, True)]
    assert s.num_prompt_tokens == 20


def test_running_first_then_waiting_share_the_budget():
    s = make(budget=10)
    s.add_request(req("a", 6))
    s.add_request(req("b", 6))
    assert chunks(run_step(s)) == [("a", 6, 0, True), ("b", 4, 0, False)]
    assert chunks(run_step(s)) == [("a", 1, 6, True), ("b", 2, 4, True)]
    s.add_request(req("c", 12))
    assert chunks(run_step(s)) == [("a", 1, 7, True), ("b", 1, 6, True), ("c", 8, 0, False)]


def test_max_num_seqs_limits_admission():
    s = make(max_num_seqs=2)
    for r in "abc":
        s.add_request(req(r, 3))
    assert [x[0] for x in chunks(run_step(s))] == ["a", "b"]
    assert s.num_waiting() == 1
    s.finish_requests(["a"], RequestStatus.FINISHED_STOPPED)
    assert [x[0] for x in chunks(run_step(s))] == ["b", "c"]


def test_preempts_last_admitted_and_admits_nobody_that_step():
    # 5 blocks of 4 tokens.
    s = make(num_blocks=5, budget=64)
    s.add_request(req("a", 7))
    s.add_request(req("b", 7))
    run_step(s)                        # a, b: 7 prompt tokens in 2 blocks each, 1 sampled
    s.add_request(req("c", 3))
    out = run_step(s)                  # a, b decode into their 2nd blocks; c takes the last one
    assert [x[0] for x in chunks(out)] == ["a", "b", "c"]
    assert s.kv.pool.num_free_blocks() == 0
    s.add_request(req("d", 3))
    out = run_step(s)
    # a needs a 3rd block: the last admitted (c) is preempted. b then needs one too and is
    # itself the last running request, so it goes as well.
    assert chunks(out) == [("a", 1, 8, True)]
    assert s.num_preemptions == 2
    assert s.requests["c"].status == RequestStatus.PREEMPTED
    assert s.requests["b"].status == RequestStatus.PREEMPTED
    assert out.finished_req_ids == {"b", "c"}
    # Nothing admitted in a step that preempted, and the preempted keep their arrival order
    # ahead of d.
    assert s.requests["d"].status == RequestStatus.WAITING
    assert [r.req_id for r in s.waiting] == ["b", "c", "d"]
    assert s.requests["b"].num_computed_tokens == 0
    assert s.kv.block_ids(s.requests["a"]) == [0, 1, 4]
    assert s.kv.pool.num_free_blocks() == 2


def test_preempted_request_recomputes_prompt_and_outputs():
    s = make(num_blocks=3, budget=64, caching=False)
    s.add_request(req("a", 4))
    s.add_request(req("b", 4))
    run_step(s)                        # a: 1 block + sample, b: 1 block + sample
    out = run_step(s)                  # a needs block 2 (ok); b needs another: none, b preempted
    assert chunks(out) == [("a", 1, 4, True)]
    assert s.requests["b"].status == RequestStatus.PREEMPTED
    s.finish_requests(["a"], RequestStatus.FINISHED_STOPPED)
    out = run_step(s)
    # Recompute covers the prompt and the token sampled before preemption.
    assert chunks(out) == [("b", 5, 0, True)]
    assert [n.token_ids for n in out.new] == [s.requests["b"].all_token_ids[:5]]


def test_self_preemption_when_victim_is_the_request():
    s = make(num_blocks=2, budget=64, caching=False)
    s.add_request(req("a", 4))
    s.add_request(req("b", 4))
    run_step(s)
    # a gets nothing free -> preempts the last running (b), then fits.
    out = run_step(s)
    assert chunks(out) == [("a", 1, 4, True)]
    assert s.requests["b"].status == RequestStatus.PREEMPTED and s.num_preemptions == 1


def test_priority_admission_order_and_victim():
    s = make(num_blocks=4, budget=64, policy="priority", max_num_seqs=8, caching=False)
    s.add_request(req("low", 4, priority=5))
    s.add_request(req("high", 4, priority=0))
    s.add_request(req("mid", 4, priority=2))
    out = run_step(s)
    assert [x[0] for x in chunks(out)] == ["high", "mid", "low"]
    # Each needs a second block; only one free: the lowest priority (largest value) goes.
    out = run_step(s)
    assert s.requests["low"].status == RequestStatus.PREEMPTED
    assert [x[0] for x in chunks(out)] == ["high", "mid"]
    assert [r.req_id for r in s.waiting] == ["low"]


def test_priority_victim_already_scheduled_this_step_returns_its_budget():
    s = make(num_blocks=3, budget=64, policy="priority", caching=False)
    s.add_request(req("x", 4, priority=9))
    run_step(s)
    s.add_request(req("y", 4, priority=0))
    run_step(s)                        # running order: x, y
    out = run_step(s)                  # x fits, y needs a block: x (priority 9) is the victim
    assert chunks(out) == [("y", 1, 4, True)]
    assert s.requests["x"].status == RequestStatus.PREEMPTED
    assert all(b.ref_cnt in (0, 1) for b in s.kv.pool.blocks)
    assert sum(b.ref_cnt for b in s.kv.pool.blocks) == 2


def test_equal_priority_ties_break_by_arrival():
    s = make(policy="priority", max_num_seqs=1)
    for r in ("p", "q", "r"):
        s.add_request(req(r, 2, priority=1))
    assert [x[0] for x in chunks(run_step(s))] == ["p"]
    assert [r.req_id for r in s.waiting] == ["q", "r"]


def test_abort_frees_blocks_running_and_waiting():
    s = make(num_blocks=8, max_num_seqs=1)
    s.add_request(req("a", 9))
    s.add_request(req("b", 9))
    run_step(s)
    assert s.kv.pool.num_free_blocks() == 5
    done = s.finish_requests(["a", "b", "nope"], RequestStatus.FINISHED_ABORTED)
    assert [r.req_id for r in done] == ["a", "b"]
    assert all(r.status == RequestStatus.FINISHED_ABORTED for r in done)
    assert s.kv.pool.num_free_blocks() == 8
    assert all(b.ref_cnt == 0 for b in s.kv.pool.blocks)
    assert not s.has_unfinished() and s.num_waiting() == 0 and s.running == []
    out = s.schedule()
    assert out.scheduled == [] and out.finished_req_ids == {"a", "b"}


def test_prefix_hit_skips_cached_blocks_and_counts_tokens():
    s = make(budget=64)
    s.add_request(req("a", 10, base=0))
    run_step(s)
    s.add_request(req("b", 11, base=0))
    out = run_step(s)
    assert ("b", 3, 8, True) in chunks(out)
    assert s.requests["b"].num_cached_tokens == 8
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (21, 8)


def test_priority_waiting_request_preempts_lower_priority_for_a_sequence_slot():
    s = make(policy="priority", max_num_seqs=2, caching=False)
    s.add_request(req("low", 4, priority=5))
    s.add_request(req("mid", 4, priority=2))
    run_step(s)
    s.add_request(req("high", 4, priority=0))
    s.add_request(req("same", 4, priority=2))
    out = run_step(s)
    # high takes low's slot (low's decode chunk is dropped); "same" (equal to mid) preempts nobody.
    assert chunks(out) == [("mid", 1, 4, True), ("high", 4, 0, True)]
    assert s.requests["low"].status == RequestStatus.PREEMPTED and s.num_preemptions == 1
    assert out.finished_req_ids == {"low"}
    assert [r.req_id for r in s.waiting] == ["same", "low"]


def test_priority_waiting_request_preempts_lower_priority_for_blocks():
    s = make(num_blocks=3, policy="priority", caching=False)
    s.add_request(req("low", 8, priority=5))
    run_step(s)                        # low holds 2 blocks (8 tokens + a sampled one)
    s.add_request(req("high", 9, priority=1))
    out = run_step(s)                  # low grows into block 3; high needs 3: low must go
    assert chunks(out) == [("high", 9, 0, True)]
    assert s.requests["low"].status == RequestStatus.PREEMPTED
    assert s.kv.pool.num_free_blocks() == 0


def test_no_admission_in_a_step_that_preempted_even_when_one_would_fit():
    # Under the priority policy the better waiting request is first in line, and after the
    # preemption one block is free for it; it still waits a step (it would only take back
    # the block the preemption just freed).
    s = make(num_blocks=4, policy="priority", caching=False)
    s.add_request(req("a", 7, priority=1))
    s.add_request(req("b", 3, priority=1))
    run_step(s)                        # a: 2 blocks, b: 1 block
    run_step(s)                        # both decode inside their blocks
    s.add_request(req("c", 2, priority=0))
    out = run_step(s)                  # a takes the last free block; b then preempts itself
    assert chunks(out) == [("a", 1, 8, True)]
    assert s.requests["b"].status == RequestStatus.PREEMPTED
    assert s.kv.pool.num_free_blocks() == 1 and s.waiting.peek().req_id == "c"
    assert s.requests["c"].status == RequestStatus.WAITING
    out = run_step(s)
    assert chunks(out) == [("a", 1, 9, True), ("c", 2, 0, True)]


def test_output_carries_only_what_changed():
    s = make(num_blocks=6, budget=64, caching=False)
    s.add_request(req("a", 3))
    out = run_step(s)
    assert [(n.req_id, n.token_ids, n.num_prompt_tokens, n.block_ids) for n in out.new] == \
        [("a", s.requests["a"].prompt_token_ids, 3, [0])]
    assert [x.new_block_ids for x in out.scheduled] == [[]]
    out = run_step(s)                  # a decodes inside block 0: nothing new at all
    assert out.new == [] and [x.new_block_ids for x in out.scheduled] == [[]]
    out = run_step(s)                  # a's fifth token opens block 1
    assert out.new == [] and [x.new_block_ids for x in out.scheduled] == [[1]]
    s.add_request(req("b", 4))
    out = run_step(s)
    assert [n.req_id for n in out.new] == ["b"] and [x.new_block_ids for x in out.scheduled] == [[], []]
    # Preempted, then back: it leaves the batch and enters again, with its whole table and
    # every token so far (the runner drops the old row before adding the new one).
    s._preempt(s.requests["b"])
    out = run_step(s)
    assert out.finished_req_ids == {"b"}
    assert [(n.req_id, len(n.token_ids), n.block_ids) for n in out.new] == [("b", 5, s.kv.block_ids(s.requests["b"]))]
    s.finish_requests(["a"], RequestStatus.FINISHED_STOPPED)
    out = run_step(s)
    assert out.finished_req_ids == {"a"} and [x.req_id for x in out.scheduled] == ["b"]


# ---- async scheduling: a step scheduled while the previous one's tokens are in flight ----

def land(s, out, token=7):
    """The tokens of a step scheduled earlier come back."""
    sampled = {x.req_id: token for x in out.scheduled if x.sample}
    return s.update_from_output(out, ModelRunnerOutput(sampled_token_ids=sampled))


def test_token_in_flight_is_a_placeholder_for_the_next_step():
    s = make()
    s.add_request(req("a", 6))
    first = s.schedule()
    assert chunks(first) == [("a", 6, 0, True)]
    a = s.requests["a"]
    assert (a.num_computed_tokens, a.num_output_placeholders) == (6, 1)
    second = s.schedule()               # before the first step's token is back
    assert chunks(second) == [("a", 1, 6, True)]
    assert (a.num_computed_tokens, a.num_output_placeholders) == (7, 2)
    assert [r.req_id for r in land(s, first, token=11)] == ["a"]
    assert a.output_token_ids == [11] and a.num_output_placeholders == 1
    land(s, second, token=12)
    assert a.output_token_ids == [11, 12] and a.num_output_placeholders == 0


def test_no_step_past_the_end_that_a_token_in_flight_reaches():
    s = make(budget=64)
    s.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=2), BS, ROOT))
    s.max_model_len = 6
    s.add_request(Request("b", [4, 5, 6, 7], SamplingParams(max_tokens=50), BS, ROOT))
    one = s.schedule()
    two = s.schedule()                  # a and b each have their 1st token in flight
    assert [x[0] for x in chunks(two)] == ["a", "b"]
    # a's 2nd token (max_tokens) and b's 2nd (its 6th token: max_model_len) are in flight:
    # neither is scheduled again until they land and end the requests.
    assert chunks(s.schedule()) == []
    land(s, one)
    land(s, two)
    assert [len(s.requests[r].output_token_ids) for r in "ab"] == [2, 2]


def test_preempted_with_a_token_in_flight_keeps_its_row_until_the_token_lands():
    s = make(num_blocks=4, budget=64)
    s.add_request(req("a", 8))
    s.add_request(req("b", 8))
    first = s.schedule()                # a, b: 2 blocks each, the pool is full
    assert s.kv.pool.num_free_blocks() == 0
    second = s.schedule()               # a needs a 3rd block for its placeholder: b goes
    assert chunks(second) == [("a", 1, 8, True)]
    b = s.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_output_placeholders == 1
    # b's first token is in flight: its runner row stays (its stop checks need it), and it is
    # not admitted again before the token lands.
    assert second.finished_req_ids == set()
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)    # the whole pool is free again
    assert chunks(s.schedule()) == []
    land(s, first, token=9)
    assert b.output_token_ids == [9] and b.num_output_placeholders == 0
    again = s.schedule()
    assert again.finished_req_ids == {"b"}
    assert [(x[0], x[3]) for x in chunks(again)] == [("b", True)]    # prompt and token recomputed
