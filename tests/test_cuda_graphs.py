"""CUDA-graph decode: the batch-size ladder, padding to the next captured size, and staging a step
into the static buffers. The CPU twin runs the model eagerly over the staged, padded buffers
exactly as a replay reads them; the GPU test compares replays with eager steps."""
import pytest
import torch

from pagoda.gpu_worker.core.config import EngineConfig
from pagoda.gpu_worker.core.sampling_params import SamplingParams
from pagoda.gpu_worker.runner.cuda_graphs import DecodeGraphs, StaticBatch, capture_sizes, padded_size
from tests.plugins.engine import Chunk, fresh_step


@pytest.mark.parametrize("max_seqs", [1, 3, 8, 20, 256, 257])
def test_ladder_and_padding(max_seqs):
    sizes = capture_sizes(max_seqs)
    assert sizes == sorted(set(sizes)) and sizes[0] == 1 and sizes[-1] == max_seqs
    for n in range(1, max_seqs + 1):
        p = padded_size(n, sizes)
        assert p in sizes and p >= n and p - n <= 15
        assert all(s < n for s in sizes if s < p), "not the smallest size that fits"
    assert padded_size(max_seqs + 1, sizes) is None
    if max_seqs == 256:
        assert sizes[:6] == [1, 2, 4, 8, 16, 32] and len(sizes) == 4 + 16


def decode_step(runner, lens, block_sets):
    return [Chunk(f"r{i}", [7 + i], n - 1, blocks) for i, (n, blocks) in enumerate(zip(lens, block_sets))]


def prepare(runner, chunks):
    """(input ids, positions, metadata) of a hand-built step, copied out of the runner's staging
    buffers (the next step reuses them)."""
    import dataclasses
    step = fresh_step(runner, chunks)
    runner.batch.update(step)
    got = runner.batch.prepare(step.scheduled)
    meta = dataclasses.replace(got.meta, **{f.name: getattr(got.meta, f.name).clone()
                                            for f in dataclasses.fields(got.meta)
                                            if isinstance(getattr(got.meta, f.name), torch.Tensor)})
    return got.input_ids.clone(), got.positions.clone(), meta


def test_padded_staged_step_equals_the_unpadded_step(tiny_model, monkeypatch):
    from pagoda.gpu_worker.models import parallel
    from pagoda.gpu_worker.runner.model_runner import ModelRunner
    # Padding must not touch the real rows. The C kernels give each row the same sums whatever the
    # batch (tests/test_cpu_gemv.py); the tuner may pick F.linear for a shape on this machine, whose
    # sgemm blocks 3 and 4 rows differently (last bits), which is not what this test is about.
    monkeypatch.setattr(parallel, "_CPU_GEMM", "c")
    r = ModelRunner(EngineConfig(model=tiny_model, device="cpu", block_size=8, num_kv_blocks=16))
    r.allocate_kv_cache(16)
    gen = torch.Generator().manual_seed(0)
    for k, v in r.kv_caches:  # a pool full of earlier sequences' K/V
        k.copy_(torch.randn(k.shape, generator=gen))
        v.copy_(torch.randn(v.shape, generator=gen))
    ids, pos, meta = prepare(r, decode_step(r, [5, 17, 9], [[3], [4, 5, 6], [7, 8]]))
    before = [(k.clone(), v.clone()) for k, v in r.kv_caches]
    with torch.inference_mode():
        want = r.model(ids, pos, meta)
        after_eager = [(k.clone(), v.clone()) for k, v in r.kv_caches]
        for (k, v), (k0, v0) in zip(r.kv_caches, before):
            k.copy_(k0)
            v.copy_(v0)
        batch = StaticBatch(8, r.max_model_len, r.block_size, torch.device("cpu"))
        batch.stage(torch.zeros(8, dtype=torch.int64), torch.zeros(8, dtype=torch.int64),
                    prepare(r, decode_step(r, [40] * 8, [[1, 2, 3, 4, 5]] * 8))[2])  # stale rows
        batch.stage(ids, pos, meta)
        got = r.model(*batch.views(padded_size(3, capture_sizes(8))))
    assert got.shape[0] == 4
    torch.testing.assert_close(got[:3], want, rtol=1e-5, atol=1e-5)
    # The real rows write their slots (a batch of 4 may round differently from a batch of 3 in
    # the last bit, so those compare with a tolerance); every other slot is untouched.
    written = torch.zeros(r.kv_caches[0][0].shape[:2], dtype=torch.bool).view(-1)
    written[meta.slot_mapping[meta.slot_mapping >= 0]] = True
    written = written.view(r.kv_caches[0][0].shape[:2])
    for (k, v), (k0, v0), (k1, v1) in zip(r.kv_caches, before, after_eager):
        assert torch.equal(k[~written], k0[~written]) and torch.equal(v[~written], v0[~written]), \
            "a padding row wrote the KV cache"
        torch.testing.assert_close(k[written], k1[written], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v[written], v1[written], rtol=1e-5, atol=1e-5)


def test_only_pure_decode_steps_replay(tiny_model):
    from pagoda.gpu_worker.runner.model_runner import ModelRunner
    r = ModelRunner(EngineConfig(model=tiny_model, device="cpu", block_size=8, num_kv_blocks=16))
    assert r.graphs is None and not r.uses_graphs()  # CPU: always eager
    graphs = DecodeGraphs(r.model, 2, r.max_model_len, 8, torch.device("cpu"))  # not captured
    mixed = prepare(r, [Chunk("a", [1, 2], 0, [1]), Chunk("b", [3], 4, [2])])
    assert graphs.run(*mixed) is None
    too_many = prepare(r, decode_step(r, [3, 3, 3], [[1], [2], [3]]))
    assert graphs.run(*too_many) is None


def test_enforce_eager_flag():
    from pagoda.gpu_worker.serving.args import build_parser, engine_config_kwargs
    on = build_parser().parse_args(["--model", "m", "--enforce-eager"])
    assert engine_config_kwargs(on)["enforce_eager"] is True
    assert engine_config_kwargs(build_parser().parse_args(["--model", "m"]))["enforce_eager"] is False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_replay_matches_eager_gpu(tiny_model):
    from pagoda.gpu_worker.runner.model_runner import ModelRunner
    eager = ModelRunner(EngineConfig(model=tiny_model, device="cuda", dtype="float32", num_kv_blocks=64,
                                     max_num_seqs=8, enforce_eager=True))
    graphed = ModelRunner(EngineConfig(model=tiny_model, device="cuda", dtype="float32", num_kv_blocks=64,
                                       max_num_seqs=8))
    for r in (eager, graphed):
        r.allocate_kv_cache(64)
        r.warm_up()
    assert eager.graphs is None and graphed.graphs is not None
    p = SamplingParams()
    prompts = [[5 + i, 9, 11 + i] for i in range(5)]
    outs = []
    for r in (eager, graphed):
        r.forward(fresh_step(r, [Chunk(f"r{i}", t, 0, [i], True, p, t, []) for i, t in enumerate(prompts)]))
        outs.append(r.forward(fresh_step(r, [Chunk(f"r{i}", [3], 3, [i], True, p, prompts[i], [3])
                                             for i in range(5)])))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)
