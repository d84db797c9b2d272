"""Tensor parallelism on CPU (gloo): greedy parity of TP=2 and TP=4 with TP=1 and transformers for
the four native families, refusals that name tensor_parallel_size, sharded loading, and a rank
killed mid-stream taking the worker down cleanly (UNAVAILABLE, NOT_SERVING, lease gone, exit 1).

The tiny models have 4 query heads and 2 KV heads, so TP=4 also covers KV heads replicated over
more ranks than there are KV heads. Each engine set-up runs with prefix caching on, a pool small
enough to preempt, and a small token budget (chunked prefill).
"""
import asyncio
import os
import random
import re
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagoda.gpu_worker.core.kv_cache_manager import cdiv
from pagoda.gpu_worker.core.sampling_params import SamplingParams
from pagoda.gpu_worker.engine.llm import LLM

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]
LENGTHS = [1, 60, 17, 90, 33, 5]
BLOCK = 8


def make_prompts(seed: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(5, 600) for _ in range(n)] for n in LENGTHS]
    prompts[3][:60] = prompts[1]          # a shared prefix: prompt 3 reuses prompt 1's blocks
    gens = [rng.choice([16, 24, 32]) for _ in LENGTHS]
    return prompts, gens


@pytest.fixture(scope="module")
def references(tiny_model_factory):
    """family -> (model dir, prompts, max_tokens, transformers' greedy outputs, TP=1 outputs)."""
    cache = {}

    def get(family):
        if family not in cache:
            import torch
            import transformers
            path = tiny_model_factory(family)
            prompts, gens = make_prompts(FAMILIES.index(family))
            model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            hf = []
            with torch.no_grad():
                for p, g in zip(prompts, gens):
                    ids = torch.tensor([p])
                    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=g, do_sample=False)
                    hf.append(out[0, len(p):].tolist())
            cache[family] = (path, prompts, gens, hf, generate(path, prompts, gens, 1)[0])
        return cache[family]

    return get


def generate(path, prompts, gens, tp):
    """Greedy tokens and engine stats under one set-up: prefix caching, a preempting pool, chunks."""
    largest = max(len(p) + g for p, g in zip(prompts, gens))
    llm = LLM(path, device="cpu", block_size=BLOCK, num_kv_blocks=cdiv(largest, BLOCK) + 2,
              enable_prefix_caching=True, max_num_batched_tokens=48, tensor_parallel_size=tp)
    try:
        outs = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=g) for g in gens])
        return [o.outputs[0].token_ids for o in outs], llm.engine.stats()
    finally:
        llm.engine.runner.close()


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_parity_with_tp1_and_transformers(references, family, tp):
    path, prompts, gens, hf, tp1 = references(family)
    got, stats = generate(path, prompts, gens, tp)
    for i, (g, one, ref) in enumerate(zip(got, tp1, hf)):
        assert g == one, f"prompt {i} ({len(prompts[i])} tokens): TP={tp} diverges from TP=1"
        assert g == ref, f"prompt {i} ({len(prompts[i])} tokens): TP={tp} diverges from transformers"
    assert stats.preemptions > 0 and stats.prefix_cache_hits > 0   # the set-up did what it says
    assert stats.free_blocks == stats.num_blocks


def test_pool_size_is_the_smallest_any_rank_can_hold(tiny_model):
    """Every rank sizes its own pool; all take the minimum (same block ids everywhere)."""
    llm = LLM(tiny_model, device="cpu", num_kv_blocks=40, tensor_parallel_size=2)
    runner = llm.engine.runner
    try:
        assert llm.engine.num_blocks == 40
        for mine, agreed in ((1000, 40), (5, 5)):     # rank 1 holds 40 either way
            runner._local_num_blocks = lambda n=mine: n
            assert runner.num_blocks_for() == agreed
    finally:
        runner.close()


def test_each_rank_loads_only_its_shard(tiny_model_factory):
    """Sharded shapes per rank, and the shards laid side by side are the checkpoint."""
    import torch

    from pagoda.gpu_worker.models.parallel import Shard, shard_slice
    from pagoda.gpu_worker.runner.loader import iter_weights, load_hf_config, load_model
    path = tiny_model_factory("qwen2")     # q/k/v biases, tied embeddings
    cfg = load_hf_config(path)
    full = dict(iter_weights(path))
    for size in (2, 4):
        shards = [dict(iter_weights(path, lambda n, r=r: shard_slice(cfg, n, Shard(r, size)))) for r in range(size)]
        for name, tensor in full.items():
            spec = shard_slice(cfg, name, Shard(0, size))
            if spec is None:
                assert all(torch.equal(s[name], tensor) for s in shards), name
            elif ("k_proj" in name or "v_proj" in name) and size == 4:
                # 2 KV heads over 4 ranks: ranks 0,1 read head 0 and ranks 2,3 head 1.
                assert torch.equal(torch.cat([shards[0][name], shards[2][name]], spec[0]), tensor), name
            else:
                assert torch.equal(torch.cat([s[name] for s in shards], spec[0]), tensor), name
                assert shards[0][name].numel() == tensor.numel() // size, name
        model = load_model(path, cfg, torch.device("cpu"), torch.float32, Shard(1, size))
        attn = model.layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads) == (4 // size, max(2 // size, 1))
        assert model.embed_tokens.weight.shape[0] == cfg.vocab_size // size


@pytest.mark.parametrize("overrides, size, what", [
    (dict(num_attention_heads=4, num_key_value_heads=2), 3, "attention heads"),
    (dict(intermediate_size=130), 4, "intermediate_size"),
    (dict(num_attention_heads=8, num_key_value_heads=3, head_dim=8), 2, "KV heads"),
])
def test_unsplittable_shapes_are_refused_naming_the_field(tiny_model_factory, overrides, size, what):
    path = tiny_model_factory("llama", **overrides)
    with pytest.raises(ValueError, match=f"tensor_parallel_size: {size} .*{what}"):
        LLM(path, device="cpu", tensor_parallel_size=size)


def test_vocab_not_divisible_more_ranks_than_gpus_and_bad_sizes_are_refused():
    from types import SimpleNamespace

    import torch

    from pagoda.gpu_worker.core.config import EngineConfig
    from pagoda.gpu_worker.models.registry import check_tensor_parallel
    cfg = SimpleNamespace(num_attention_heads=64, num_key_value_heads=64, intermediate_size=4096, vocab_size=65536,
                          architectures=["LlamaForCausalLM"])
    with pytest.raises(ValueError, match="tensor_parallel_size: 2 does not divide the model's 65535 vocab_size"):
        check_tensor_parallel(SimpleNamespace(**{**vars(cfg), "vocab_size": 65535}), 2, "cpu")
    more = 2 ** max(1, torch.cuda.device_count()).bit_length()    # a power of two above the GPU count
    with pytest.raises(ValueError, match=f"tensor_parallel_size: {more} ranks need {more} GPUs"):
        check_tensor_parallel(cfg, more, "cuda")
    check_tensor_parallel(cfg, more, "cpu")    # on CPU ranks are processes: any count that divides
    for bad in (0, -1, True, "2"):
        with pytest.raises(ValueError, match="tensor_parallel_size: must be a positive integer"):
            EngineConfig(model="x", tensor_parallel_size=bad)


def test_rank_commands_travel_typed_and_call_the_method_they_name():
    """What rank 0 broadcasts: each command pickles as sent (tensors on the CPU), comes back on
    the rank's device and calls the one runner method it stands for."""
    import pickle

    import torch

    from pagoda.gpu_worker.models.attention import AttentionMetadata
    from pagoda.gpu_worker.runner import distributed as d

    class Runner:
        device = torch.device("cpu")

        def __init__(self):
            self.calls: list[tuple] = []

        def run_model(self, ids, pos, meta, logits_indices):
            self.calls.append(("run_model", ids.tolist(), pos.tolist(), meta.seq_lens.tolist(), logits_indices.tolist()))

        def allocate_kv_cache(self, num_blocks):
            self.calls.append(("allocate_kv_cache", num_blocks))

        def agreed_num_blocks(self):
            self.calls.append(("agreed_num_blocks",))

        def copy_blocks(self, copies):
            self.calls.append(("copy_blocks", copies))

    i32 = torch.tensor([2], dtype=torch.int32)
    meta = AttentionMetadata(torch.tensor([0, 1]), i32.view(1, 1), i32, torch.tensor([0, 2], dtype=torch.int32), 2)
    commands = [d.RunModel(torch.tensor([5, 6]), torch.tensor([0, 1]), meta, torch.tensor([1])),
                d.AllocateKVCache(7), d.AgreeNumBlocks(), d.CopyBlocks([(1, 2)])]
    runner = Runner()
    for command in commands:
        got = pickle.loads(pickle.dumps(d._to_cpu(command)))
        assert type(got) is type(command)
        d._to_device(got, runner.device).apply(runner)
    assert runner.calls == [("run_model", [5, 6], [0, 1], [2], [1]), ("allocate_kv_cache", 7),
                            ("agreed_num_blocks",), ("copy_blocks", [(1, 2)])]
    assert isinstance(pickle.loads(pickle.dumps(d.Stop())), d.Stop)


def _rank_pids(log: str) -> list[int]:
    m = re.search(r"tensor parallel: \d+ ranks \(pids \[([\d, ]+)\]\)", log)
    assert m, log[-2000:]
    return [int(p) for p in m.group(1).split(",")]


@pytest.mark.slow
def test_killed_rank_ends_streams_unavailable_and_worker_exits_nonzero(start_worker, tiny_model, redis_server):
    import redis

    from pagoda.clients import AsyncPagodaClient
    from pagoda.protos import redis_schema as rs
    # Slow steps keep the stream running while the rank is killed.
    w = start_worker(tiny_model, tensor_parallel_size=2, redis_url=redis_server.url, worker_id="tp-dies",
                     env={"PAGODA_TEST_STEP_DELAY_S": "0.05"})
    r = redis.Redis.from_url(redis_server.url)
    deadline = time.monotonic() + 10
    while r.get(rs.lease_key("tp-dies")) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert r.get(rs.lease_key("tp-dies")) is not None
    ranks = _rank_pids(w.log())
    assert len(ranks) == 1, f"expected one rank process, found {ranks}"

    async def run():
        async with AsyncPagodaClient(w.address, retries=0) as c:
            channel = grpc.aio.insecure_channel(w.address)
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            stream = c.generate("The quick brown fox", max_tokens=1000, ignore_eos=True, temperature=0.0)
            got = [await stream.__anext__()]
            os.kill(ranks[0], signal.SIGKILL)
            killed = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for chunk in stream:
                    got.append(chunk)
            ended = time.monotonic() - killed
            status = (await watch.read()).status
            await channel.close()
            return err.value, ended, status, killed

    err, ended, status, killed = asyncio.run(run())
    assert err.code() == grpc.StatusCode.UNAVAILABLE, err
    assert "rank" in err.details()
    assert ended < 10
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING
    code = w.proc.wait(10 - (time.monotonic() - killed) + 5)
    assert code != 0
    assert r.get(rs.lease_key("tp-dies")) is None     # withdrawn, not left to expire
    assert "rank 1 exited" in w.log()


def test_beam_search_under_tp2_equals_tp1(tiny_model):
    """Every rank does the copy-on-write block copies (ModelRunner.copy_blocks, sent with the
    step): beams under TP=2 equal TP=1's."""
    from pagoda.gpu_worker.features.beam_search import BeamSearchParams
    prompts, params = [[5, 6, 7, 8, 9, 10], list(range(20, 45))], BeamSearchParams(beam_width=4, max_tokens=12)
    want = LLM(tiny_model, device="cpu", block_size=BLOCK).beam_search(prompts, params)
    llm = LLM(tiny_model, device="cpu", block_size=BLOCK, num_kv_blocks=64, tensor_parallel_size=2)
    try:
        got = llm.beam_search(prompts, params)
        assert llm.engine.kv.num_copies > 0
    finally:
        llm.engine.runner.close()
    assert [[s.tokens for s in o.sequences] for o in got] == [[s.tokens for s in o.sequences] for o in want]
