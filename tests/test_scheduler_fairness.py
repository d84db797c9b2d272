"""Tenant fairness in the scheduler: one tenant's burst cannot starve another's request, FIFO within
a tenant, priority before fairness, the busiest tenant preempted first; fifo mode keeps arrival order."""
import pytest

from pagoda.gpu_worker.core.config import EngineConfig
from pagoda.gpu_worker.core.kv_cache_manager import KVCacheManager
from pagoda.gpu_worker.core.outputs import ModelRunnerOutput
from pagoda.gpu_worker.core.request import Request, RequestStatus
from pagoda.gpu_worker.core.sampling_params import SamplingParams
from pagoda.gpu_worker.core.scheduler import Scheduler
from pagoda.protos.block_hash import namespace_root

BS = 4
ROOT = namespace_root("m")


def make(fairness="tenant", num_blocks=4096, max_num_seqs=8, budget=4096, policy="fcfs"):
    return Scheduler(KVCacheManager(num_blocks, BS, True), max_num_seqs, budget, policy, fairness=fairness)


_bases = iter(range(0, 10**9, 100))


def req(rid, tenant, n_prompt=4, priority=0):
    base = next(_bases)         # distinct prompts: no prefix-cache sharing between requests
    return Request(rid, [base + i for i in range(n_prompt)], SamplingParams(), BS, ROOT,
                   priority=priority, tenant=tenant)


def step(s):
    """One step with every sampled token landing; returns the ids of the requests it admitted."""
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput(sampled_token_ids={x.req_id: 7 for x in out.scheduled if x.sample}))
    return [n.req_id for n in out.new]


def finish(s, req_ids):
    s.finish_requests(req_ids, RequestStatus.FINISHED_STOPPED)


def burst(s, tenant, n, prefix=None):
    for i in range(n):
        s.add_request(req(f"{prefix or tenant}{i}", tenant))


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_burst_of_1024_does_not_hold_up_another_tenant(policy):
    s = make(policy=policy)
    burst(s, "A", 1024)
    assert step(s) == [f"A{i}" for i in range(8)]       # the batch is full of A's
    s.add_request(req("B0", "B"))
    assert step(s) == []                                # no slot free: nobody gets in
    finish(s, ["A3"])
    # The very next step that admits anything admits B's request, not A's 9th.
    assert step(s) == ["B0"]
    finish(s, ["A0", "A1"])
    assert step(s) == ["A8", "A9"]                      # then A's, in their order


def test_fifo_mode_keeps_arrival_order():
    s = make(fairness="fifo")
    burst(s, "A", 1024)
    assert step(s) == [f"A{i}" for i in range(8)]
    s.add_request(req("B0", "B"))
    finish(s, ["A3"])
    assert step(s) == ["A8"]                            # B waits behind the whole burst
    assert [r.req_id for r in s.waiting][:2] == ["A9", "A10"]


def test_fifo_within_a_tenant_and_shares_converge():
    s = make()
    burst(s, "A", 6)
    burst(s, "B", 6)
    # Both run nothing: A's head arrived first, then the least-running tenant alternates.
    assert step(s) == ["A0", "B0", "A1", "B1", "A2", "B2", "A3", "B3"]
    finish(s, ["A0", "A1", "A2", "A3"])                 # A runs 0, B runs 4: A's next four
    assert step(s) == ["A4", "A5", "B4", "B5"]


def test_no_starvation_of_the_bursting_tenant():
    """B floods too: each tenant gets half the slots, and A's burst still progresses."""
    s = make()
    burst(s, "A", 1024)
    step(s)
    burst(s, "B", 1024)
    admitted = {"A": 0, "B": 0}
    for _ in range(20):
        finish(s, [r.req_id for r in list(s.running)])
        for rid in step(s):
            admitted[rid[0]] += 1
    assert admitted == {"A": 80, "B": 80}
    # Each tenant's in its own order.
    assert [r.req_id for r in s.running if r.tenant == "A"] == [f"A{i}" for i in range(8 + 76, 8 + 80)]
    assert [r.req_id for r in s.running if r.tenant == "B"] == [f"B{i}" for i in range(76, 80)]


def test_an_interactive_tenant_does_not_starve_the_burst():
    """B sends one request at a time: A keeps every other slot."""
    s = make()
    burst(s, "A", 1024)
    step(s)
    done_a = 8
    for i in range(10):
        s.add_request(req(f"B{i}", "B"))
        finish(s, [r.req_id for r in list(s.running)])
        admitted = step(s)
        assert f"B{i}" in admitted and len(admitted) == 8
        done_a += len(admitted) - 1
    assert done_a == 78 and s.num_waiting() == 1024 - 78


def test_priority_beats_fairness():
    s = make(policy="priority")
    burst(s, "A", 7)
    step(s)                                             # A runs 7 of 8 slots
    s.add_request(req("B-low", "B", priority=5))
    s.add_request(req("A-high", "A", priority=0))
    assert step(s) == ["A-high"]                        # better priority first, however busy A is
    finish(s, ["A0"])
    assert step(s) == ["B-low"]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("fairness", ["tenant", "fifo"])
def test_preemption_victim_is_from_the_busiest_tenant(policy, fairness):
    # 5 blocks of 4 tokens; 4 requests of one block each, every one needs a second to decode.
    s = make(fairness, num_blocks=5, policy=policy)
    for rid, tenant in (("a1", "A"), ("a2", "A"), ("a3", "A"), ("b1", "B")):
        s.add_request(req(rid, tenant, n_prompt=4))
    step(s)
    out = s.schedule()
    ran = [x.req_id for x in out.scheduled]
    preempted = sorted(r.req_id for r in s.requests.values() if r.status is RequestStatus.PREEMPTED)
    if fairness == "tenant":
        # a2 needs a block: A runs 3, B 1, so A's last admitted goes; then b1 needs one: A still
        # runs 2 to B's 1, so a2 goes. One sequence each runs on.
        assert (ran, preempted) == (["a1", "b1"], ["a2", "a3"])
    else:
        # The last admitted goes first: B's only request, then a3 itself.
        assert (ran, preempted) == (["a1", "a2"], ["a3", "b1"])


def test_bad_fairness_value_names_the_field():
    with pytest.raises(ValueError, match="scheduling_fairness: must be tenant or fifo"):
        EngineConfig(model="x", scheduling_fairness="round-robin")
