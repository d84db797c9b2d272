"""The host KV tier end to end on CPU (both pools CPU tensors): a prefix evicted from the device
pool comes back from the host and counts as cached, greedy outputs equal those without the tier,
swap preemption equals recompute, an abort mid-reload leaks nothing."""
import pytest

from pagoda.gpu_worker.core.config import EngineConfig
from pagoda.gpu_worker.core.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("no_block_leaks", "one_torch_thread")

GREEDY = dict(temperature=0.0)
BLOCK_BYTES = 4096            # the tiny llama's K and V for one block of 8 tokens, fp32
HOST_64 = 64 * BLOCK_BYTES / 2**30


def ids(n, seed):
    import random
    rng = random.Random(seed)
    return [rng.randrange(5, 600) for _ in range(n)]


def prefix_hashes(engine, tokens):
    from pagoda.protos.block_hash import block_hashes, namespace_root
    return block_hashes(tokens, engine.block_size, namespace_root(engine.model_name))


def run_engine(engine, max_steps=3000):
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return
        engine.step()
    raise AssertionError("engine did not finish")


def evict_prefix(llm, prefix):
    """Serve `prefix` + a suffix, then enough other prompts to push it out of the device pool."""
    sp = SamplingParams(max_tokens=4, **GREEDY)
    llm.generate([prefix + ids(5, 1)], sp)
    for s in range(3):
        llm.generate([ids(60, 10 + s)], sp)


def test_prefix_evicted_from_the_device_comes_back_from_the_host(tiny_llm_factory):
    tier = tiny_llm_factory("llama", num_kv_blocks=16, block_size=8, kv_offloading_size=HOST_64)
    device_only = tiny_llm_factory("llama", num_kv_blocks=16, block_size=8)
    plain = tiny_llm_factory("llama", num_kv_blocks=16, block_size=8, enable_prefix_caching=False)
    assert tier.engine.num_host_blocks == 64
    prefix = ids(48, 0)
    again = prefix + ids(7, 2)
    sp = SamplingParams(max_tokens=12, **GREEDY)
    for llm in (tier, device_only):
        evict_prefix(llm, prefix)
    first = prefix_hashes(tier.engine, prefix)
    assert not set(first) & set(tier.engine.cached_block_hashes())
    assert set(first) <= set(tier.engine.kv.host.cached)
    runner = tier.engine.runner
    before = runner.copied_blocks
    out = tier.generate([again], sp)[0]
    ref = plain.generate([again], sp)[0]
    assert out.num_cached_tokens == 48               # six blocks of 8, all from the host
    assert device_only.generate([again], sp)[0].num_cached_tokens == 0
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert runner.copied_blocks - before >= 6
    # Back on the device: the next hit needs no copy.
    before = runner.copied_blocks
    assert tier.generate([again], sp)[0].outputs[0].token_ids == ref.outputs[0].token_ids
    assert not [c for c in tier.engine.kv.take_tier_copies() if not c.to_host]


def test_swap_preemption_equals_recompute(tiny_llm_factory):
    prompts = [ids(20, 30 + i) for i in range(4)]
    sp = SamplingParams(max_tokens=40, ignore_eos=True, **GREEDY)
    outs = {}
    for mode in ("recompute", "swap"):
        llm = tiny_llm_factory("llama", num_kv_blocks=16, block_size=8, max_num_seqs=4,
                               kv_offloading_size=HOST_64, preemption_mode=mode)
        s = llm.engine.scheduler
        before = (s.num_preemptions, s.num_swaps)
        outs[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
        assert s.num_preemptions > before[0]
        assert (s.num_swaps > before[1]) == (mode == "swap")
    ref = tiny_llm_factory("llama", num_kv_blocks=64, block_size=8)
    want = [o.outputs[0].token_ids for o in ref.generate(prompts, sp)]
    assert outs["recompute"] == want and outs["swap"] == want


def test_swap_with_async_scheduling_equals_recompute(tiny_llm_factory):
    """Pipelined steps: a victim may have a token in flight when it is swapped out."""
    prompts = [ids(20, 40 + i) for i in range(4)]
    sp = SamplingParams(max_tokens=40, ignore_eos=True, **GREEDY)
    llm = tiny_llm_factory("llama", num_kv_blocks=16, block_size=8, max_num_seqs=4, async_scheduling="on",
                           kv_offloading_size=HOST_64, preemption_mode="swap")
    llm.engine.runner.copy_chunk = 2        # runs of copies split into batches of two blocks
    before = llm.engine.scheduler.num_swaps
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    assert llm.engine.scheduler.num_swaps > before
    ref = tiny_llm_factory("llama", num_kv_blocks=64, block_size=8)
    assert got == [o.outputs[0].token_ids for o in ref.generate(prompts, sp)]


def test_abort_mid_reload_leaks_nothing_and_the_cache_stays_right(tiny_llm_factory):
    llm = tiny_llm_factory("llama", num_kv_blocks=16, block_size=8, kv_offloading_size=HOST_64,
                           async_scheduling="on")
    plain = tiny_llm_factory("llama", num_kv_blocks=16, block_size=8, enable_prefix_caching=False)
    prefix = ids(48, 5)
    evict_prefix(llm, prefix)
    engine = llm.engine
    sp = SamplingParams(max_tokens=12, **GREEDY)
    engine.add_request("x", prefix + ids(7, 6), sp)
    before = engine.runner.copied_blocks
    engine.step()                  # admitted: its reload queued and launched, its step in flight
    assert engine.scheduler.requests and engine.in_flight is not None
    assert engine.runner.copied_blocks - before >= 6
    engine.abort_request("x")
    run_engine(engine)
    again = prefix + ids(9, 7)
    out = llm.generate([again], sp)[0]
    assert out.num_cached_tokens == 48
    assert out.outputs[0].token_ids == plain.generate([again], sp)[0].outputs[0].token_ids


def test_bad_tier_settings_name_the_field():
    for kwargs, field in (({"kv_offloading_size": -1}, "kv_offloading_size"),
                          ({"kv_offloading_size": float("nan")}, "kv_offloading_size"),
                          ({"preemption_mode": "drop"}, "preemption_mode"),
                          ({"preemption_mode": "swap"}, "preemption_mode"),
                          ({"kv_offloading_size": 1, "tensor_parallel_size": 2}, "kv_offloading_size")):
        with pytest.raises(ValueError, match=field):
            EngineConfig(model="m", **kwargs)


def test_flags_parse_and_bad_values_name_the_flag(capsys):
    from pagoda.gpu_worker.serving.args import build_parser, engine_config_kwargs
    p = build_parser()
    ns = p.parse_args(["--model", "m", "--kv-offloading-size", "2.5", "--preemption-mode", "swap"])
    kw = engine_config_kwargs(ns)
    assert (kw["kv_offloading_size"], kw["preemption_mode"]) == (2.5, "swap")
    assert engine_config_kwargs(p.parse_args(["--model", "m"]))["kv_offloading_size"] == 0
    for argv in (["--kv-offloading-size", "-1"], ["--kv-offloading-size", "lots"], ["--preemption-mode", "drop"]):
        with pytest.raises(SystemExit):
            p.parse_args(["--model", "m", *argv])
        assert argv[0] in capsys.readouterr().err


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_cuda_copy_path_matches_the_cpu_twin(tiny_model):
    """The CUDA twin: pinned host pool, copies on their own stream behind an event. A prefix that
    comes back from the host, and swap preemption under async scheduling, give the greedy output
    of an engine without any cache, on the GPU."""
    from pagoda.gpu_worker.engine.llm import LLM
    kw = dict(device="cuda", num_kv_blocks=16, block_size=8, max_model_len=512)
    tier = LLM(tiny_model, kv_offloading_size=HOST_64, max_num_seqs=4, preemption_mode="swap", **kw)
    plain = LLM(tiny_model, enable_prefix_caching=False, **kw)
    runner = tier.engine.runner
    assert runner.copy_stream is not None and runner.host_pool.is_pinned()
    prefix = ids(48, 0)
    evict_prefix(tier, prefix)
    again = prefix + ids(7, 2)
    sp = SamplingParams(max_tokens=12, **GREEDY)
    out = tier.generate([again], sp)[0]
    assert out.num_cached_tokens == 48
    assert out.outputs[0].token_ids == plain.generate([again], sp)[0].outputs[0].token_ids
    prompts = [ids(20, 30 + i) for i in range(4)]
    sp = SamplingParams(max_tokens=40, ignore_eos=True, **GREEDY)
    before = tier.engine.scheduler.num_swaps
    got = [o.outputs[0].token_ids for o in tier.generate(prompts, sp)]
    assert tier.engine.scheduler.num_swaps > before
    assert got == [o.outputs[0].token_ids for o in plain.generate(prompts, sp)]
    blocks, seconds = runner.copy_rate()
    __import__("torch").cuda.synchronize()
    assert runner.copy_rate()[0] >= blocks > 0 and runner.copy_rate()[1] > 0


@pytest.mark.timeout(120)
def test_bench_quick(tmp_path):
    """bench/kv_tier.py --quick runs end to end: only the tier finds the tenants' prompts."""
    import json
    import os
    import subprocess
    import sys
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, os.path.join(repo, "bench", "kv_tier.py"), "--quick", "--model-dir",
                           str(tmp_path / "model"), "--json", str(tmp_path / "r.json")],
                          cwd=repo, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.load(open(tmp_path / "r.json"))["figures"]
    warm = slice(8, None)        # the second round
    assert sum(figures["device only"]["cached_tokens"][warm]) == 0
    assert all(k == 96 for k in figures["host tier"]["cached_tokens"][warm])
    assert figures["host tier"]["copied_blocks"] > 0 and figures["device only"]["copied_blocks"] == 0


def test_tier_metrics_are_exported_only_with_a_tier(tiny_llm_factory):
    from prometheus_client import generate_latest

    from pagoda.gpu_worker.serving.metrics import WorkerMetrics
    tier = tiny_llm_factory("llama", num_kv_blocks=16, block_size=8, kv_offloading_size=HOST_64)
    evict_prefix(tier, ids(48, 0))
    for prefix in ("pagoda", "vllm"):
        text = generate_latest(WorkerMetrics(tier.engine.stats, "m", prefix).registry).decode()
        blocks = [ln for ln in text.splitlines() if ln.startswith("pagoda:num_host_kv_blocks{")]
        assert blocks and float(blocks[0].split()[-1]) == 64
        copied = [ln for ln in text.splitlines() if ln.startswith("pagoda:kv_tier_copied_blocks_total")]
        assert copied and float(copied[0].split()[-1]) == tier.engine.stats().kv_copied_blocks > 0
        assert "pagoda:num_swaps_total" in text
    plain = tiny_llm_factory("llama", num_kv_blocks=16, block_size=8)
    assert "host_kv" not in generate_latest(WorkerMetrics(plain.engine.stats, "m").registry).decode()
