"""Multi-LoRA: the batched ops against their oracle, PEFT loading and its refusals, device slots
(LRU, no stale weights), and greedy parity with the PEFT-merged checkpoint, several adapters and
the base model in one batch."""
import json
import math
import os
import shutil

import numpy as np
import pytest
import torch

from pagoda.gpu_worker.core.config import EngineConfig
from pagoda.gpu_worker.core.sampling_params import SamplingParams
from pagoda.gpu_worker.testing.tiny_model import make_tiny_lora
from pagoda.kernels.reference import lora_expand_ref, lora_gather_ref, lora_segments, lora_shrink_ref

PROMPTS = [[1, 17, 29, 41, 53, 67, 71, 83, 97, 101, 113],
           [1, 5, 9, 200, 300, 400, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22],
           [1, 700, 650, 600, 550, 7],
           [1, 42, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def merge_lora(base: str, adapter: str, out: str) -> str:
    """The PEFT-merged checkpoint, W += scaling * B @ A, computed here in float64 (the oracle)."""
    from safetensors.numpy import load_file, save_file
    shutil.copytree(base, out)
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        conf = json.load(f)
    r = conf["r"]
    scaling = conf["lora_alpha"] / (math.sqrt(r) if conf.get("use_rslora") else r)
    weights = load_file(os.path.join(base, "model.safetensors"))
    lora = load_file(os.path.join(adapter, "adapter_model.safetensors"))
    for key, a in lora.items():
        if ".lora_A." not in key:
            continue
        b = lora[key.replace(".lora_A.", ".lora_B.")]
        target = key.replace("base_model.model.", "").replace(".lora_A.weight", ".weight")
        w = weights[target].astype(np.float64) + scaling * (b.astype(np.float64) @ a.astype(np.float64))
        weights[target] = w.astype(np.float32)
    save_file(weights, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    """Two adapters of the tiny Llama (all seven projections rank 8; q/v/down only, rank 4) and
    their merged checkpoints."""
    root = tmp_path_factory.mktemp("lora")
    a = make_tiny_lora(str(root / "a"), tiny_model, seed=1, rank=8, alpha=16)
    b = make_tiny_lora(str(root / "b"), tiny_model, seed=2, rank=4, alpha=4, targets=("q_proj", "v_proj", "down_proj"),
                       use_rslora=True)
    return {"a": a, "b": b, "merged_a": merge_lora(tiny_model, a, str(root / "merged_a")),
            "merged_b": merge_lora(tiny_model, b, str(root / "merged_b"))}


def greedy(llm, prompts, lora=None):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, lora_request=lora)]


# ---- the batched ops ---------------------------------------------------------------------------

def test_segment_ops_equal_the_gather_oracle():
    g = torch.Generator().manual_seed(0)
    t, fan_in, fan_out, slots, rank = 13, 24, 20, 3, 5
    x = torch.randn(t, fan_in, generator=g)
    a = torch.randn(slots, rank, fan_in, generator=g)
    b = torch.randn(slots, fan_out, rank, generator=g)
    token_slots = np.array([2, -1, 0, 0, 2, 1, -1, 2, 0, 1, 1, -1, 2])
    seg = lora_segments(token_slots)
    assert seg is not None and seg.host_slot == [0, 1, 2] and seg.max_seg_len == 4
    base = torch.randn(t, 7 + fan_out + 3, generator=g)
    y = base.clone()
    lora_expand_ref(lora_shrink_ref(x, a, seg), b, seg, y, offset=7)
    want = lora_gather_ref(x, a, b, torch.from_numpy(token_slots))
    torch.testing.assert_close(y[:, 7:7 + fan_out] - base[:, 7:7 + fan_out], want, rtol=1e-5, atol=1e-5)
    # Columns outside the slice and rows without an adapter are untouched, bit for bit.
    assert torch.equal(y[:, :7], base[:, :7]) and torch.equal(y[:, 7 + fan_out:], base[:, 7 + fan_out:])
    assert torch.equal(y[token_slots < 0], base[token_slots < 0])


def test_no_adapter_rows_means_no_segments():
    assert lora_segments(np.array([-1, -1, -1])) is None


# ---- parity with the merged model --------------------------------------------------------------

@pytest.fixture(scope="module")
def lora_llm(tiny_model, adapters):
    from pagoda.gpu_worker.engine.llm import LLM
    return LLM(tiny_model, device="cpu", enable_lora=True, max_loras=2, max_lora_rank=8,
               lora_modules=[f"a={adapters['a']}", f"b={adapters['b']}"])


@pytest.fixture(scope="module")
def references(tiny_model, adapters):
    """Greedy outputs of the base model and of each merged checkpoint, one engine each."""
    from pagoda.gpu_worker.engine.llm import LLM
    out = {}
    for key, path in (("", tiny_model), ("a", adapters["merged_a"]), ("b", adapters["merged_b"])):
        out[key] = greedy(LLM(path, device="cpu"), PROMPTS)
    return out


def test_adapters_change_the_output(references):
    # Else parity would prove nothing.
    assert references["a"] != references[""] and references["b"] != references[""]
    assert references["a"] != references["b"]


def test_two_adapters_and_base_in_one_batch_equal_the_merged_models(lora_llm, references, no_block_leaks):
    mix = ["a", None, "b", "a"]
    got = greedy(lora_llm, PROMPTS, mix)
    want = [references[m or ""][i] for i, m in enumerate(mix)]
    assert got == want
    # Every prompt under every choice, in one batch of twelve.
    prompts = PROMPTS * 3
    mix = [None] * 4 + ["a"] * 4 + ["b"] * 4
    got = greedy(lora_llm, prompts, mix)
    assert got == references[""] + references["a"] + references["b"]


def test_lora_request_object_loads_its_path(tiny_model, adapters, references):
    from dataclasses import dataclass

    from pagoda.gpu_worker.engine.llm import LLM

    @dataclass
    class LoRARequest:       # as vLLM's
        lora_name: str
        lora_int_id: int
        lora_path: str

    llm = LLM(tiny_model, device="cpu", enable_lora=True, max_lora_rank=8)
    assert llm.engine.lora_adapters() == []
    assert greedy(llm, PROMPTS[:2], LoRARequest("a", 1, adapters["a"])) == references["a"][:2]
    assert llm.engine.lora_adapters() == ["a"]


# ---- device slots ----------------------------------------------------------------------------

def test_one_slot_serves_adapters_in_turn_without_stale_weights(tiny_model, adapters, references, no_block_leaks):
    """max_loras 1: requests of the second adapter wait for the first's to finish, and b (which
    targets fewer projections than a) loads over a's slot with nothing of a left."""
    from pagoda.gpu_worker.engine.llm import LLM
    llm = LLM(tiny_model, device="cpu", enable_lora=True, max_loras=1, max_lora_rank=8,
              lora_modules={"a": adapters["a"], "b": adapters["b"]})
    mix = ["a", "b", None, "b"]
    assert greedy(llm, PROMPTS, mix) == [references[m or ""][i] for i, m in enumerate(mix)]
    lora = llm.engine.runner.lora
    assert lora.resident() == ["b"]
    # a's o_proj / gate_up rows are gone from the slot: b does not target them.
    for projs in lora.layers:
        assert not projs["lora_o"].a[0].any() and not projs["lora_gate_up"].b[0].any()
        assert not projs["lora_gate_up"].a[0].any() and not projs["lora_qkv"].a[0, 8:16].any()    # k_proj
        qkv = projs["lora_qkv"]
        q, k = qkv.offsets[1], qkv.offsets[2]
        assert qkv.b[0, :q, 0:4].any() and not qkv.b[0, :q, 4:].any()        # q: rank 4 of 8, its block only
        assert not qkv.b[0, q:k].any() and qkv.b[0, k:, 16:20].any() and not qkv.b[0, k:, :16].any()
    assert greedy(llm, PROMPTS[:1], "a") == references["a"][:1]
    assert lora.resident() == ["a"]


def test_lru_evicts_the_least_recently_used_idle_slot(tiny_model, adapters, tmp_path):
    from pagoda.gpu_worker.engine.llm import LLM
    c = make_tiny_lora(str(tmp_path / "c"), tiny_model, seed=3, rank=2)
    llm = LLM(tiny_model, device="cpu", enable_lora=True, max_loras=2, max_lora_rank=8,
              lora_modules={"a": adapters["a"], "b": adapters["b"], "c": c})
    lora = llm.engine.runner.lora
    for name in ("a", "b", "a"):
        greedy(llm, PROMPTS[:1], name)
    assert lora.loads == 2
    greedy(llm, PROMPTS[:1], "c")           # b was used least recently
    assert sorted(lora.resident()) == ["a", "c"] and lora.loads == 3
    greedy(llm, PROMPTS[:1], "a")           # still resident: no load
    assert lora.loads == 3
    busy = np.array([lora.slot_of[lora.adapters["a"]], lora.slot_of[lora.adapters["c"]]])
    with pytest.raises(RuntimeError, match="max_loras"):
        lora.slot_for(lora.adapters["b"], busy)


def test_adapter_blocks_are_never_shared_with_the_base_model(lora_llm, no_block_leaks):
    prompt = list(range(1, 50))
    first = lora_llm.generate([prompt], GREEDY)[0]
    again = lora_llm.generate([prompt], GREEDY)[0]
    with_a = lora_llm.generate([prompt], GREEDY, lora_request="a")[0]
    with_a2 = lora_llm.generate([prompt], GREEDY, lora_request="a")[0]
    assert again.num_cached_tokens == 48 and first.outputs[0].token_ids == again.outputs[0].token_ids
    assert with_a.num_cached_tokens == 0 and with_a2.num_cached_tokens == 48


def test_unload_and_load_again_at_run_time(tiny_model, adapters, references, no_block_leaks):
    from pagoda.gpu_worker.engine.llm import LLM
    llm = LLM(tiny_model, device="cpu", enable_lora=True, max_loras=1, max_lora_rank=8,
              lora_modules={"x": adapters["a"]})
    assert greedy(llm, PROMPTS[:1], "x") == references["a"][:1]
    long = list(range(1, 50))       # three whole blocks, cached under x with a's weights
    assert llm.generate([long], GREEDY, lora_request="x")[0].num_cached_tokens == 0
    assert llm.generate([long], GREEDY, lora_request="x")[0].num_cached_tokens == 48
    llm.engine.unload_lora_adapter("x")
    with pytest.raises(ValueError, match="adapter: unknown LoRA adapter 'x'"):
        greedy(llm, PROMPTS[:1], "x")
    # The same name, other weights: served from a fresh load, not the old slot, nor the blocks
    # cached with the old weights (a prompt of whole blocks).
    llm.engine.load_lora_adapter("x", adapters["b"])
    assert greedy(llm, PROMPTS[:1], "x") == references["b"][:1]
    again = llm.generate([long], GREEDY, lora_request="x")[0]
    assert again.num_cached_tokens == 0
    assert again.outputs[0].token_ids == greedy(LLM(adapters["merged_b"], device="cpu"), [long])[0]
    with pytest.raises(ValueError, match="lora_name: adapter 'x' is already loaded"):
        llm.engine.load_lora_adapter("x", adapters["a"])
    with pytest.raises(ValueError, match="lora_name: no adapter 'y'"):
        llm.engine.unload_lora_adapter("y")
    for bad in ("x" * 257, " y", "a\nb"):
        with pytest.raises(ValueError, match="lora_name: must be 1 to 256 printable"):
            llm.engine.load_lora_adapter(bad, adapters["a"])


# ---- refusals --------------------------------------------------------------------------------

def test_bad_lora_config_is_refused_naming_the_field(tiny_model, adapters, tmp_path):
    with pytest.raises(ValueError, match="lora_modules: adapter name 'a' is given twice"):
        EngineConfig(model=tiny_model, enable_lora=True, lora_modules=[f"a={adapters['a']}", f"a={adapters['b']}"])
    with pytest.raises(ValueError, match="lora_modules: expected name=path"):
        EngineConfig(model=tiny_model, enable_lora=True, lora_modules=["just-a-path"])
    with pytest.raises(ValueError, match="lora_modules: adapter 'm'.*not a directory"):
        EngineConfig(model=tiny_model, enable_lora=True, lora_modules=[f"m={tmp_path / 'missing'}"])
    with pytest.raises(ValueError, match="lora_modules: adapters need enable_lora"):
        EngineConfig(model=tiny_model, lora_modules=[f"a={adapters['a']}"])
    for field in ("max_loras", "max_lora_rank"):
        with pytest.raises(ValueError, match=f"{field}: must be a positive integer"):
            EngineConfig(model=tiny_model, enable_lora=True, **{field: 0})
    with pytest.raises(ValueError, match="enable_lora: not with tensor_parallel_size"):
        EngineConfig(model=tiny_model, enable_lora=True, tensor_parallel_size=2)


def test_bad_adapters_are_refused_naming_the_field(tiny_model, adapters, tmp_path):
    from pagoda.gpu_worker.features.lora import load_peft_adapter
    from pagoda.gpu_worker.runner.loader import load_hf_config
    cfg = load_hf_config(tiny_model)
    with pytest.raises(ValueError, match="max_lora_rank: .* has rank 8, more than --max-lora-rank 4"):
        load_peft_adapter("a", adapters["a"], cfg, 4)
    with pytest.raises(ValueError, match="lora_path: .* no such directory"):
        load_peft_adapter("z", str(tmp_path / "nothing"), cfg, 8)
    bad = tmp_path / "bad"
    shutil.copytree(adapters["a"], bad)
    conf = json.loads((bad / "adapter_config.json").read_text())
    for change, match in ((dict(target_modules=["lm_head"]), "target_modules: .* targets lm_head"),
                          (dict(bias="all"), "bias: "), (dict(r=0), "r: .* positive integer"),
                          (dict(r=4), "r: .* has shape"), (dict(use_dora=True), "use_dora"),
                          (dict(lora_alpha=float("nan")), "lora_alpha: .* finite, positive"),
                          (dict(lora_alpha=1e38), "lora_alpha: .* at most 65536"),
                          (dict(lora_alpha=-8), "lora_alpha: .* finite, positive")):
        (bad / "adapter_config.json").write_text(json.dumps(dict(conf, **change)))
        with pytest.raises(ValueError, match=match):
            load_peft_adapter("bad", str(bad), cfg, 8)
    (bad / "adapter_config.json").write_text(json.dumps(conf))
    from safetensors.torch import load_file, save_file
    weights = load_file(str(bad / "adapter_model.safetensors"))
    for poison in (float("nan"), float("inf")):
        key = sorted(weights)[3]
        save_file({**weights, key: torch.full_like(weights[key], poison)}, str(bad / "adapter_model.safetensors"))
        with pytest.raises(ValueError, match=f"lora_path: .* tensor '{key}' holds NaN or infinite"):
            load_peft_adapter("bad", str(bad), cfg, 8)
    (bad / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="lora_path: .* cannot read adapter_model.safetensors"):
        load_peft_adapter("bad", str(bad), cfg, 8)


def test_unknown_adapter_is_refused_naming_the_field(lora_llm, tiny_llm_factory):
    with pytest.raises(ValueError, match=r"adapter: unknown LoRA adapter 'nope' \(loaded: a, b\)"):
        lora_llm.generate([PROMPTS[0]], GREEDY, lora_request="nope")
    with pytest.raises(ValueError, match="adapter: this worker serves no adapters"):
        tiny_llm_factory().generate([PROMPTS[0]], GREEDY, lora_request="a")


# ---- a real worker: adapters by gRPC, loaded and unloaded at run time --------------------------

@pytest.mark.slow
def test_worker_serves_adapters_and_loads_them_at_run_time(start_worker, tiny_model, adapters, references):
    import grpc

    from pagoda.protos.pagoda.v1 import pagoda_pb2 as pb
    from pagoda.protos.pagoda.v1 import pagoda_pb2_grpc as pb_grpc
    w = start_worker(tiny_model, enable_lora=True, lora_modules=f"a={adapters['a']}", max_loras=2,
                     max_lora_rank=8)
    with grpc.insecure_channel(w.address) as ch:
        gen, admin = pb_grpc.GenerationStub(ch), pb_grpc.AdminStub(ch)

        def ask(i, adapter=""):
            sp = pb.SamplingParams(temperature=0.0, max_tokens=GREEDY.max_tokens, ignore_eos=True)
            out = []
            for r in gen.Generate(pb.GenerateRequest(token_ids=PROMPTS[i], sampling=sp, adapter=adapter)):
                out.extend(r.token_ids)
            return out

        assert ask(0, "a") == references["a"][0] and ask(0) == references[""][0]
        assert list(admin.GetLoad(pb.LoadRequest()).lora_adapters) == ["a"]
        loaded = admin.LoadLoRAAdapter(pb.LoadLoRAAdapterRequest(lora_name="b", lora_path=adapters["b"]))
        assert list(loaded.adapters) == ["a", "b"]
        assert [ask(i, "b") for i in range(2)] == references["b"][:2]
        assert list(admin.UnloadLoRAAdapter(pb.UnloadLoRAAdapterRequest(lora_name="a")).adapters) == ["b"]
        for call, match in ((lambda: ask(1, "a"), "adapter: unknown LoRA adapter 'a'"),
                            (lambda: admin.LoadLoRAAdapter(pb.LoadLoRAAdapterRequest(lora_name="c", lora_path="/nope")),
                             "lora_path: "),
                            (lambda: admin.LoadLoRAAdapter(pb.LoadLoRAAdapterRequest(lora_name="b", lora_path=adapters["a"])),
                             f"lora_name: adapter 'b' is already loaded from {adapters['b']}"),
                            (lambda: admin.UnloadLoRAAdapter(pb.UnloadLoRAAdapterRequest(lora_name="zz")),
                             "lora_name: no adapter 'zz'")):
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and match in e.value.details()
        assert ask(2, "b") == references["b"][2]     # the worker carries on
        # The same name and path again (a retried load): a no-op that answers the adapters.
        again = admin.LoadLoRAAdapter(pb.LoadLoRAAdapterRequest(lora_name="b", lora_path=adapters["b"]))
        assert list(again.adapters) == ["b"] and ask(0, "b") == references["b"][0]

    from pagoda.clients import PagodaClient
    with PagodaClient(w.address, retries=0) as client:     # the client library's side of the same
        assert client.load_lora_adapter("c", adapters["a"]) == ["b", "c"]
        got = [t for chunk in client.generate(PROMPTS[1], adapter="c", max_tokens=GREEDY.max_tokens, temperature=0.0,
                                              ignore_eos=True) for t in chunk.token_ids]
        assert got == references["a"][1]
        assert client.unload_lora_adapter("c") == ["b"] and list(client.load().lora_adapters) == ["b"]


def test_worker_flags_are_in_help_and_bad_ones_refused(tiny_model, adapters):
    from pagoda.gpu_worker.serving.args import build_parser, engine_config_kwargs
    text = build_parser().format_help()
    for flag in ("--enable-lora", "--lora-modules", "--max-loras", "--max-lora-rank"):
        assert flag in text
    args = build_parser().parse_args(["--model", tiny_model, "--enable-lora", "--lora-modules", f"a={adapters['a']}",
                                      f"b={adapters['b']}", "--max-loras", "3", "--max-lora-rank", "8"])
    cfg = EngineConfig(**engine_config_kwargs(args))
    assert cfg.enable_lora and cfg.lora_modules == {"a": adapters["a"], "b": adapters["b"]}
    assert (cfg.max_loras, cfg.max_lora_rank) == (3, 8)
    args = build_parser().parse_args(["--model", tiny_model, "--lora-modules", f"a={adapters['a']}"])
    with pytest.raises(ValueError, match="lora_modules: adapters need enable_lora"):
        EngineConfig(**engine_config_kwargs(args))


# ---- the router: adapters by name, preference, load and unload over HTTP -----------------------

def _http(url: str, body: dict | None = None) -> tuple[int, str]:
    import urllib.error
    import urllib.request
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_router_serves_adapters_by_name_and_loads_them_over_http(redis_server, start_worker, start_router,
                                                                 tiny_model, adapters, references):
    import grpc

    from pagoda.clients.up import free_port
    from pagoda.protos.pagoda.v1 import pagoda_pb2 as pb
    from pagoda.protos.pagoda.v1 import pagoda_pb2_grpc as pb_grpc
    from tests.test_router import wait_for
    url = redis_server.url
    flags = dict(redis_url=url, enable_lora=True, max_loras=2, max_lora_rank=8, heartbeat_interval=0.2)
    start_worker(tiny_model, worker_id="wa", lora_modules=f"a={adapters['a']}", **flags)
    start_worker(tiny_model, worker_id="wb", **flags)
    port = free_port()
    router = start_router(url, http_port=port)
    base = f"http://127.0.0.1:{port}/v1"

    def models():
        return {m["id"]: m["parent"] for m in json.loads(_http(base + "/models")[1])["data"]}

    wait_for(lambda: "a" in models() and len(models()) == 2, 20, "the router to list the adapter")
    model = next(m for m, parent in models().items() if parent is None)
    assert models() == {model: None, "a": model}

    with grpc.insecure_channel(router.address) as ch:
        gen = pb_grpc.GenerationStub(ch)

        def ask(i, model_name, adapter=""):
            sp = pb.SamplingParams(temperature=0.0, max_tokens=GREEDY.max_tokens, ignore_eos=True)
            out, workers = [], set()
            for r in gen.Generate(pb.GenerateRequest(model=model_name, adapter=adapter, token_ids=PROMPTS[i],
                                                     sampling=sp)):
                out.extend(r.token_ids)
                workers.add(r.worker_id)
            return out, workers

        # Only wa serves a: every request for it goes there, named as a model or as the adapter field.
        for i in range(3):
            assert ask(i, "a") == (references["a"][i], {"wa"})
        assert ask(3, model, "a") == (references["a"][3], {"wa"})
        with pytest.raises(grpc.RpcError) as e:
            ask(0, model, "nope")
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "adapter: unknown LoRA adapter" in e.value.details()

        # b loaded on both over HTTP; the answer lists it at once.
        status, text = _http(base + "/load_lora_adapter", {"lora_name": "b", "lora_path": adapters["b"]})
        assert (status, text) == (200, "Success: LoRA adapter 'b' added successfully on wa, wb.")
        assert models()["b"] == model
        assert ask(0, "b")[0] == references["b"][0]
        status, text = _http(base + "/completions", {"model": "b", "prompt": PROMPTS[1], "max_tokens": 12,
                                                     "temperature": 0, "ignore_eos": True})
        body = json.loads(text)
        from pagoda.runtime.tokenization import PromptTokenizer
        assert status == 200 and body["model"] == "b"
        assert body["choices"][0]["text"] == PromptTokenizer.from_dir(tiny_model).decode(references["b"][1])
        # A chat with tools is rendered by the router with the base model's template: an adapter's
        # name must find it (it answered 404 "no live worker serves 'b'").
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        status, text = _http(base + "/chat/completions", {"model": "b", "messages": [{"role": "user", "content": "hi"}],
                                                          "tools": tools, "max_tokens": 4})
        assert status == 200 and json.loads(text)["model"] == "b", text

        status, text = _http(base + "/load_lora_adapter", {"lora_name": "c", "lora_path": "/no/such/dir"})
        assert status == 400 and "lora_path" in json.loads(text)["error"]["message"]
        status, text = _http(base + "/load_lora_adapter", {"lora_path": adapters["b"]})
        assert status == 400 and json.loads(text)["error"]["param"] == "lora_name"

        status, text = _http(base + "/unload_lora_adapter", {"lora_name": "a"})
        assert (status, text) == (200, "Success: LoRA adapter 'a' removed successfully from wa.")
        assert "a" not in models()
        status, text = _http(base + "/completions", {"model": "a", "prompt": PROMPTS[1], "max_tokens": 4})
        assert status == 404 and "model" in json.loads(text)["error"]["message"]
        status, _ = _http(base + "/unload_lora_adapter", {"lora_name": "a"})
        assert status == 404


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_router_loads_adapters_only_where_lora_runs_and_again_is_a_no_op(redis_server, start_worker, start_router,
                                                                          tiny_model, adapters, references):
    """As vLLM's server: a load without `model` beside a plain worker succeeds on the LoRA one
    (before: 400 "1 of 2 workers refused"), says where, is idempotent for the same path, and
    the adapter's card shows its path as root."""
    from pagoda.clients.up import free_port
    from tests.test_router import wait_for
    url = redis_server.url
    start_worker(tiny_model, worker_id="lora", redis_url=url, enable_lora=True, max_loras=2, max_lora_rank=8,
                 heartbeat_interval=0.2)
    start_worker(tiny_model, worker_id="plain", redis_url=url, heartbeat_interval=0.2)
    port = free_port()
    start_router(url, http_port=port)
    base = f"http://127.0.0.1:{port}/v1"

    def cards():
        return {m["id"]: m for m in json.loads(_http(base + "/models")[1])["data"]}

    def workers_seen():
        status, text = _http(base + "/load_lora_adapter", {"lora_name": "probe", "lora_path": "/no/such/dir"})
        # A bad path is named as lora_path once the LoRA worker's lease arrives (before the fix,
        # the plain worker's refusal made it lora_name).
        return status == 400 and json.loads(text)["error"]["param"] == "lora_path"
    wait_for(workers_seen, 20, "the router to see the LoRA worker")

    load = {"lora_name": "b", "lora_path": adapters["b"]}
    assert _http(base + "/load_lora_adapter", load) == (200, "Success: LoRA adapter 'b' added successfully on lora.")
    card = cards()["b"]
    assert card["root"] == adapters["b"] and card["parent"] in cards()
    # Again with the same path: nothing to do, still a success; another path for the name: refused.
    assert _http(base + "/load_lora_adapter", load) == (200, "Success: LoRA adapter 'b' added successfully on lora.")
    status, text = _http(base + "/load_lora_adapter", {"lora_name": "b", "lora_path": adapters["a"]})
    err = json.loads(text)["error"]
    assert status == 400 and err["param"] == "lora_name" and "already loaded from" in err["message"]
    status, text = _http(base + "/load_lora_adapter", {"lora_name": "c", "lora_path": "/no/such/dir"})
    assert status == 400 and json.loads(text)["error"]["param"] == "lora_path"
    # A base model no worker serves LoRA for is named as such.
    status, text = _http(base + "/load_lora_adapter", {"lora_name": "c", "lora_path": adapters["a"], "model": "nope"})
    assert status == 404 and json.loads(text)["error"]["param"] == "model"

    status, text = _http(base + "/completions", {"model": "b", "prompt": PROMPTS[1], "max_tokens": 12,
                                                 "temperature": 0, "ignore_eos": True})
    from pagoda.runtime.tokenization import PromptTokenizer
    assert status == 200
    assert json.loads(text)["choices"][0]["text"] == PromptTokenizer.from_dir(tiny_model).decode(references["b"][1])


# ---- the lease and the cost ---------------------------------------------------------------------

def test_lease_carries_adapters_within_bounds():
    from pagoda.protos.redis_schema import MAX_LORA_ADAPTERS, Lease
    lease = Lease("w", "m", "h:1", 1, 16, lora_adapters=["a", "b"], lora_resident=["b"])
    back = Lease.decode(lease.encode())
    assert back.lora_adapters == ["a", "b"] and back.lora_resident == ["b"]
    raw = json.loads(lease.encode())
    for bad in (["x"] * (MAX_LORA_ADAPTERS + 1), [""], ["x" * 257], "a", [1]):
        with pytest.raises(ValueError, match="lora_adapters must be a list"):
            Lease.decode(json.dumps(dict(raw, lora_adapters=bad)))
    assert Lease.decode(json.dumps({k: v for k, v in raw.items() if not k.startswith("lora")})).lora_adapters == []


def test_a_worker_without_the_adapter_resident_pays_the_load_cost():
    import random

    from pagoda.protos.block_hash import block_hashes, namespace_root
    from pagoda.protos.redis_schema import Lease
    from pagoda.router.index import BlockIndex
    from pagoda.router.scoring import LORA_LOAD_S, WorkerState
    from pagoda.router.selection import Scorer
    rates = dict(prefill_tps=1000.0, decode_tps=1000.0, step_s=0.01, max_batched_tokens=100)

    def worker(wid, resident, **load):
        return WorkerState(Lease(wid, "m", f"h:{wid}", 1, 16, num_blocks=100, free_blocks=100, lora_adapters=["a"],
                                 lora_resident=resident, **rates, **load))

    cold, warm = worker("cold", []), worker("warm", ["a"])
    hashes = block_hashes(list(range(64)), 16, namespace_root("m", "a"))
    for seed in range(5):       # no tie: the resident one wins every time
        ranked = Scorer("prefix_aware", BlockIndex(), random.Random(seed)).rank("m", [cold, warm], 64, hashes,
                                                                                adapter="a", now=0.0)
        assert [c.worker.id for c in ranked] == ["warm", "cold"]
        assert ranked[1].cost - ranked[0].cost == pytest.approx(LORA_LOAD_S)
    # A cached prefix outweighs the load: the cold worker holding 3 of the 4 blocks wins.
    idx = BlockIndex()
    idx.add("cold", hashes[:3])
    ranked = Scorer("prefix_aware", idx, random.Random(0)).rank("m", [cold, warm], 64, hashes, adapter="a", now=0.0)
    assert ranked[0].worker.id == "cold" and ranked[0].cached_tokens == 48
    # Without an adapter nobody pays it: a tie.
    base = Scorer("prefix_aware", BlockIndex(), random.Random(0)).rank("m", [cold, warm], 64, hashes, now=0.0)
    assert base[0].cost == base[1].cost


def test_the_triton_path_serves_adapters_as_the_torch_one(tiny_model, adapters, references):
    """The CUDA path's code (Triton attention, fused ops, the LoRA kernels) on CPU under the
    interpreter: the same greedy tokens, two adapters and the base model in one batch."""
    from pagoda.gpu_worker.engine.llm import LLM
    llm = LLM(tiny_model, device="cpu", attention_backend="triton", enable_lora=True, max_loras=2, max_lora_rank=8,
              lora_modules={"a": adapters["a"], "b": adapters["b"]}, num_kv_blocks=16)
    assert llm.engine.runner.lora.shrink.__name__ == "lora_shrink_triton"
    few = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    mix = ["a", None, "b"]
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], few, lora_request=mix)]
    assert got == [references[m or ""][i][:3] for i, m in enumerate(mix)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_lora_on_cuda_matches_the_merged_models(tiny_model, adapters, references):
    """On CUDA (Triton attention, fused ops and LoRA kernels; fp32, so that greedy tokens can be
    compared): two adapters and the base model in one batch give the merged models' tokens."""
    from pagoda.gpu_worker.engine.llm import LLM
    llm = LLM(tiny_model, device="cuda", dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8,
              lora_modules={"a": adapters["a"], "b": adapters["b"]}, num_kv_blocks=64)
    mix = ["a", None, "b", "a"]
    assert greedy(llm, PROMPTS, mix) == [references[m or ""][i] for i, m in enumerate(mix)]


def test_warm_up_puts_every_row_on_a_slot(lora_llm):
    """ModelRunner.warm_up (CUDA) compiles the LoRA kernels with one step whose rows all run on
    slot 0; outside warm-up a step without adapter rows does no LoRA work."""
    lora = lora_llm.engine.runner.lora
    lora.warm = True
    try:
        lora.set_step(None, torch.from_numpy, 5)
        assert lora.segments is not None and lora.segments.whole and lora.segments.host_slot == [0]
    finally:
        lora.warm = False
    lora.set_step(None, torch.from_numpy, 5)
    assert lora.segments is None


def test_stats_and_vllm_lora_info_gauge(tiny_model, adapters, tiny_llm_factory, no_block_leaks):
    """vLLM's lora_requests_info: max_lora, and the adapters of waiting and running requests as
    comma-separated labels."""
    from prometheus_client import generate_latest

    from pagoda.gpu_worker.engine.llm import LLM
    from pagoda.gpu_worker.serving.metrics import WorkerMetrics
    llm = LLM(tiny_model, device="cpu", enable_lora=True, max_loras=1, max_lora_rank=8,
              lora_modules={"a": adapters["a"], "b": adapters["b"]})
    e = llm.engine
    for i, name in enumerate(("b", "a", "")):
        e.add_request(f"r{i}", PROMPTS[i], GREEDY, adapter=name)
    st = e.stats()
    assert (st.max_lora, st.running_lora_adapters, st.waiting_lora_adapters) == (1, (), ("a", "b"))
    e.step()        # one slot: b runs (first in); a waits, and the base request behind it runs beside b
    st = e.stats()
    assert (st.running_lora_adapters, st.waiting_lora_adapters, st.running) == (("b",), ("a",), 2)
    text = generate_latest(WorkerMetrics(e.stats, "m", "vllm").registry).decode()
    assert 'vllm:lora_requests_info{engine="0",max_lora="1",model_name="m",running_lora_adapters="b",' \
           'waiting_lora_adapters="a"}' in text
    e.abort_request(["r0", "r1", "r2"])
    while e.has_unfinished_requests():
        e.step()
    assert (e.stats().running_lora_adapters, e.stats().waiting_lora_adapters) == ((), ())
    plain = tiny_llm_factory().engine
    assert "lora_requests_info" not in generate_latest(WorkerMetrics(plain.stats, "m", "vllm").registry).decode()


@pytest.mark.slow
def test_router_lora_admin_needs_an_admin_key(redis_server, start_router, tmp_path):
    import urllib.error
    import urllib.request

    from pagoda.clients.up import free_port
    keys = tmp_path / "keys"
    keys.write_text("alice-key alice\nops-key ops admin\n")
    port = free_port()
    start_router(redis_server.url, http_port=port, api_keys_file=str(keys))
    url = f"http://127.0.0.1:{port}/v1/load_lora_adapter"

    def post(key):
        req = urllib.request.Request(url, data=json.dumps({"lora_name": "a", "lora_path": "/x"}).encode(),
                                     headers={"Content-Type": "application/json",
                                              **({"Authorization": f"Bearer {key}"} if key else {})})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    assert post(None)[0] == 401
    status, text = post("alice-key")
    assert status == 403 and "admin key" in text
    status, text = post("ops-key")            # past the key check: no worker to load it on
    assert status == 503 and "model: no live worker" in text
