"""The routing simulator runs end to end, and what it measures is the real router's view.

One test runs `bench/routing.py --quick` as a user would; the other checks that the path the
simulator relies on (simulated worker -> real Publisher -> redis-server -> real Cluster ->
BlockIndex) mirrors each simulated worker's cache exactly, and that the simulated block pool
conserves its blocks.
"""
import asyncio
import json
import os
import subprocess
import sys

from bench.sim.bus import MODEL, RedisBus
from bench.sim.policies import RouterPolicy
from bench.sim.simulate import SimConfig, Simulation
from bench.sim.worker import CostModel, SimWorker
from bench.sim.workloads import make_workload
from pagoda.protos.block_hash import namespace_root

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_routing_quick_runs_and_prefix_aware_wins_on_shared_prompts(tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "bench/routing.py", "--quick", "--json", str(out),
                           "--plot", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "### shared_prompts" in proc.stdout and "### no_sharing" in proc.stdout
    assert "### hot_prompt" in proc.stdout and "### many_tenants" in proc.stdout
    results = {(r["workload"], r["policy"]): r for r in json.loads(out.read_text())}
    assert len(results) == 24
    shared = {p: results["shared_prompts", p] for p in ("round_robin", "prefix_aware", "oracle")}
    # 32 system prompts over 4 small caches: only affinity keeps them resident.
    assert shared["prefix_aware"]["hit_rate"] > 1.5 * shared["round_robin"]["hit_rate"]
    assert shared["prefix_aware"]["regret"] < shared["round_robin"]["regret"]
    assert shared["oracle"]["hit_rate"] > shared["round_robin"]["hit_rate"]
    for p in ("round_robin", "least_loaded", "prefix_aware", "oracle"):
        assert results["no_sharing", p]["hit_rate"] == 0.0
        assert results["shared_prompts", p]["requests"] == 80
        assert results["shared_prompts", p]["imbalance"] >= 1.0
    assert results["shared_prompts", "prefix_aware"]["decision_cpu_p50_us"] > 0
    # One system prompt, 64 chat clients: spread over the workers as round robin does, and keeping
    # each conversation where its history is.
    hot = {p: results["hot_prompt", p] for p in ("round_robin", "prefix_aware")}
    assert hot["prefix_aware"]["throughput"] >= 0.95 * hot["round_robin"]["throughput"]
    assert hot["prefix_aware"]["hit_rate"] > hot["round_robin"]["hit_rate"]
    assert hot["prefix_aware"]["requests"] == 80 and hot["prefix_aware"]["imbalance"] < 1.5
    # Tenants' prompts beyond one cache: only affinity keeps them resident, and TTFT follows.
    tenants = {p: results["many_tenants", p] for p in ("round_robin", "prefix_aware")}
    assert tenants["prefix_aware"]["hit_rate"] > 2 * tenants["round_robin"]["hit_rate"]
    assert tenants["prefix_aware"]["ttft_p90"] < 0.6 * tenants["round_robin"]["ttft_p90"]
    for png in ("routing_hit_rate.png", "routing_ttft_p99.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_router_index_mirrors_simulated_caches_through_redis(redis_server):
    cfg = SimConfig(num_blocks=512)          # small pools: evictions must reach the router too
    cost = CostModel()
    root = namespace_root(MODEL)
    firsts = make_workload("shared_prompts", 2, 60, seed=3, rate_fn=lambda p, o: 2 / cost.request_cost(p, o))
    workers = [SimWorker(cfg.num_blocks, cfg.block_size, root, cost) for _ in range(2)]
    loop = asyncio.new_event_loop()
    bus = RedisBus(redis_server.url, 2, workers, loop, cfg.heartbeat_s, cfg.snapshot_s)
    policy = RouterPolicy("prefix_aware", redis_server.url, loop, seed=0)
    try:
        sim = Simulation(firsts, workers, policy, bus, cfg, root)
        sim.run()
        assert len(sim.done) == 60
        assert sum(r.hit for r in sim.done) > 0
        for w in workers:
            assert not w.ref and not w.running and not w.waiting
            assert w.free + len(w.lru) == cfg.num_blocks
            assert w.evictions > 0, "the pool never filled: the test would not cover removals"
        bus.publish(workers, 1e6, force=True)
        policy.sync(1e6)
        policy.index.expire_speculation(float("inf"))
        # Reports carry simulated time, the clock of the router side's credits: on wall time the
        # results depended on how fast the machine ran the simulation.
        assert {w.lease.ts for w in policy.cluster.workers.values()} == {1e6}
        for i, w in enumerate(workers):
            cached = w.cached_block_hashes()
            assert policy.index.blocks_of(f"sim-{i}") == len(cached)
            assert all(policy.index.overlap([h], [f"sim-{i}"])[f"sim-{i}"] == 1 for h in cached)
    finally:
        policy.close()
        bus.close()
        loop.close()


def test_v1_token_cost_policy_runs_on_the_router_view_for_comparison(redis_server):
    from bench.sim.policies import TokenCostPolicy
    cfg, cost, root = SimConfig(num_blocks=512), CostModel(), namespace_root(MODEL)
    firsts = make_workload("shared_prompts", 2, 40, seed=4, rate_fn=lambda p, o: 2 / cost.request_cost(p, o))
    workers = [SimWorker(cfg.num_blocks, cfg.block_size, root, cost) for _ in range(2)]
    loop = asyncio.new_event_loop()
    bus = RedisBus(redis_server.url, 2, workers, loop, cfg.heartbeat_s, cfg.snapshot_s)
    policy = TokenCostPolicy(redis_server.url, loop, seed=0)
    try:
        sim = Simulation(firsts, workers, policy, bus, cfg, root)
        sim.run()
        result = sim.result("v1_tokens", "shared_prompts")
        assert result.requests == 40 and result.hit_rate > 0 and result.decision_cpu_p50_us > 0
        assert {r.worker for r in sim.done} == {0, 1}
    finally:
        policy.close()
        bus.close()
        loop.close()
