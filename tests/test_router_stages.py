"""The router's stages and their contracts (router/prepare.py, selection.py, proxy.py, pipeline.py),
driven in process against stand-in workers served by real gRPC servers on loopback
(tests/plugins/cluster.py's servicer): what preparation hands on, what the proxy relays and what
its credit ledger keeps, and the module layout (fronts import no process, no private names)."""
from __future__ import annotations

import ast
import asyncio
import subprocess
import sys
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest

from pagoda.protos.block_hash import block_hashes, namespace_root
from pagoda.protos.limits import Limits
from pagoda.protos.pagoda.v1 import pagoda_pb2 as pb
from pagoda.protos.pagoda.v1 import pagoda_pb2_grpc as pb_grpc
from pagoda.protos.redis_schema import Lease
from pagoda.router.channels import WorkerChannels
from pagoda.router.cluster import Cluster
from pagoda.router.errors import RouterError
from pagoda.router.index import BlockIndex
from pagoda.router.metrics import RouterMetrics
from pagoda.router.pipeline import Pipeline
from pagoda.router.scoring import Choice, Fetch
from pagoda.router.selection import Scorer
from pagoda.runtime.security import TENANT_HEADER, Identity
from pagoda.runtime.tokenization import PromptTokenizer, tokenizer_digest
from tests.plugins.cluster import TOKENIZER_CONFIG, FakeEngine, _servicer, word_tokenizer_json

ROOT = Path(__file__).resolve().parents[1]
TOK = word_tokenizer_json()
DIGEST = tokenizer_digest(TOK, TOKENIZER_CONFIG)


@asynccontextmanager
async def stand_ins(*specs: dict):
    """In-process stand-in workers (one gRPC server each, on loopback) and a pipeline whose
    cluster holds their leases, as its Redis sync would have put them."""
    servers, cluster, engines = [], Cluster("redis://unused", BlockIndex()), {}
    for i, opts in enumerate(specs):
        wid = opts.pop("worker_id", f"w{i}")
        kv_role = opts.pop("kv_role", "both")
        server = grpc.aio.server()
        engines[wid] = FakeEngine("m")
        pb_grpc.add_GenerationServicer_to_server(
            _servicer(engines[wid], wid, opts.pop("token_delay", 0.0), TOK, **opts), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        cluster._upsert(Lease(wid, "m", f"127.0.0.1:{port}", 0, 16, num_blocks=4096, free_blocks=4096,
                              ts=1.0, tokenizer_digest=DIGEST, kv_role=kv_role))
    index = cluster.index
    pipeline = Pipeline(cluster, Scorer("round_robin", index), RouterMetrics(cluster, index), WorkerChannels(),
                        limits=Limits(max_n=4))
    pipeline.stand_ins = engines        # type: ignore[attr-defined]   # what each stand-in was sent
    try:
        yield pipeline
    finally:
        await pipeline.channels.close()
        for s in servers:
            await s.stop(None)


async def collect(pipeline, request, ident=None):
    out = []
    async for r in pipeline.generate(request, 10.0, ident):
        out.append(r)
    return out


def test_preparation_hands_on_a_tokenized_tenant_scoped_request_with_its_hashes():
    async def go():
        async with stand_ins({}) as pipeline:
            text = " ".join(["aa", "bb", "cc", "dd"] * 9)
            ids = PromptTokenizer(TOK, TOKENIZER_CONFIG).encode_text(text)
            req = pb.GenerateRequest(request_id="r1", text=text, cache_salt="s", adapter="x",
                                     sampling=pb.SamplingParams(max_tokens=3),
                                     kv_fetch=pb.KVFetchHint(source_address="10.9.9.9:1", num_blocks=2))
            p = await pipeline.prepare.prepare(req, Identity("alice"))
            up = p.upstream
            assert (p.model, p.field, p.caller_id, p.prompt_len) == ("m", "text", "r1", len(ids))
            assert list(up.token_ids) == ids and not up.HasField("text") and up.model == "m"
            # A fetch hint is the router's to give (a worker sends its peer key to the source it names).
            assert not up.HasField("kv_fetch")
            # The worker scopes salt and id for the tenant the call names; the router hashes in
            # that same scoped namespace, and keeps its ledger under the scoped id.
            assert up.cache_salt == "s" and up.request_id == "r1" and up.adapter == "x"
            assert (TENANT_HEADER, b"alice") in p.metadata and p.key == "alice/r1"
            assert list(p.hashes) == block_hashes(ids, 16, namespace_root("m", "x", "tenant:alice\x00s"))
            assert req.HasField("text") and req.cache_salt == "s"     # the caller's request is left as it was
            # Without keys: nothing scoped; without an id, one is made and sent as is.
            p = await pipeline.prepare.prepare(pb.GenerateRequest(token_ids=ids, cache_salt="s"), None)
            assert p.upstream.cache_salt == "s" and p.key == p.caller_id and len(p.caller_id) == 32
            assert not p.metadata
            assert list(p.hashes) == block_hashes(ids, 16, namespace_root("m", "", "s"))
            # Refusals name the field, and come before any worker sees the request.
            for bad, code, head in ((pb.GenerateRequest(token_ids=[1], sampling=pb.SamplingParams(n=5)),
                                     grpc.StatusCode.INVALID_ARGUMENT, "n:"),
                                    (pb.GenerateRequest(text=""), grpc.StatusCode.INVALID_ARGUMENT, "text:"),
                                    (pb.GenerateRequest(token_ids=[1], model="zzz"), grpc.StatusCode.NOT_FOUND,
                                     "model:"),
                                    (pb.GenerateRequest(token_ids=[1] * 10, sampling=pb.SamplingParams(
                                        max_tokens=4090)), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens:")):
                with pytest.raises(RouterError) as e:
                    await pipeline.prepare.prepare(bad, None)
                assert e.value.code == code and e.value.message.startswith(head), e.value.message
    asyncio.run(go())


def test_the_proxy_fails_over_before_the_first_token_and_its_ledger_ends_clean():
    async def go():
        # round_robin from w0: w0 refuses its first call, so the request moves to w1.
        async with stand_ins({"fail_first": 1}, {}) as pipeline:
            w0, w1 = (pipeline.cluster.workers[w] for w in ("w0", "w1"))
            out = await collect(pipeline, pb.GenerateRequest(request_id="r1", token_ids=list(range(1, 40)),
                                                             sampling=pb.SamplingParams(max_tokens=3)),
                                Identity("alice"))
            assert [r.worker_id for r in out] == ["w1"] * 3 and out[-1].finished
            assert {r.request_id for r in out} == {"r1"}           # the caller's id, not "alice/r1"
            assert not w0.credits and not w1.credits and "alice/r1" in w1.gone and "alice/r1" not in w0.gone
            assert pipeline.breaker._states["w0"].failures == 1 and "w1" not in pipeline.breaker._states
    asyncio.run(go())


def test_a_stream_broken_after_its_first_token_is_an_error_and_the_worker_is_unloaded():
    async def go():
        async with stand_ins({"misbehave": "no_finish"}) as pipeline:
            w0 = pipeline.cluster.workers["w0"]
            seen = []
            with pytest.raises(RouterError) as e:
                async for r in pipeline.generate(pb.GenerateRequest(token_ids=[1, 2, 3], sampling=pb.SamplingParams(
                        max_tokens=3)), 10.0):
                    seen.append(r)
            assert len(seen) == 2 and e.value.code == grpc.StatusCode.UNAVAILABLE and "unfinished" in e.value.message
            assert not w0.credits and len(w0.gone) == 1
    asyncio.run(go())


def test_the_relay_passes_the_workers_bytes_through_and_an_error_after_the_first_token_ends_it():
    async def go():
        async with stand_ins({}, {"misbehave": "abort_mid"}) as pipeline:
            req = pb.GenerateRequest(request_id="r9", model="m", token_ids=list(range(1, 40)),
                                     sampling=pb.SamplingParams(max_tokens=4))
            direct = pb_grpc.GenerationStub(pipeline.channels.channel(pipeline.cluster.workers["w0"].lease.address))
            # Salts apart, so that each call finds the stand-in's cache as cold as the other did.
            upstream = [r.SerializeToString() async for r in direct.Generate(pb.GenerateRequest(
                cache_salt="direct", **{f.name: v for f, v in req.ListFields()}))]
            relayed = [raw async for raw in await pipeline.open(req, 10.0)]     # round_robin: w0, then w1
            assert relayed == upstream and len(relayed) == 4        # byte for byte, nothing rewritten
            w1 = pipeline.cluster.workers["w1"]
            seen = []
            with pytest.raises(RouterError) as e:
                async for raw in await pipeline.open(req, 10.0):
                    seen.append(raw)
            assert len(seen) == 1 and e.value.code == grpc.StatusCode.UNAVAILABLE
            assert "w1 failed mid-stream (INTERNAL: stand-in died mid-stream)" in e.value.message
            assert not w1.credits and "r9" in w1.gone and pipeline.breaker._states["w1"].failures == 1
    asyncio.run(go())


def test_a_request_the_worker_names_as_the_cause_is_not_failed_over_before_or_after_its_first_token():
    """A worker's RequestFault (gpu_worker/core/faults.py) is INVALID_ARGUMENT: the caller gets
    it as it is, no other worker is tried (it would fail the same way), the breaker is not
    charged."""
    async def go():
        for w0, when in (({"fail_first": 1, "fail_code": "INVALID_ARGUMENT"}, "before"),
                         ({"misbehave": "request_fault_mid"}, "after")):
            async with stand_ins(w0, {}) as pipeline:
                req = pb.GenerateRequest(request_id="r7", model="m", token_ids=list(range(1, 40)),
                                         sampling=pb.SamplingParams(max_tokens=4))
                seen = []
                with pytest.raises(RouterError) as e:
                    async for raw in await pipeline.open(req, 10.0):      # round_robin: w0 first
                        seen.append(raw)
                assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT, when
                assert len(seen) == (1 if when == "after" else 0)
                w1 = pipeline.cluster.workers["w1"]
                assert "r7" not in w1.gone and not w1.credits, f"{when}: failed over to w1"
                assert pipeline.breaker._states.get("w0") is None or pipeline.breaker._states["w0"].failures == 0
    asyncio.run(go())


def test_fronts_import_no_process_module_and_no_module_imports_private_names():
    paths = sorted((ROOT / "router").rglob("*.py"))      # the sub-packages too
    assert {"openai", "policies"} <= {p.parent.name for p in paths}
    for path in paths:
        name = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pagoda.router"):
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"{name} imports {private} from {node.module}"
                if name != "router/__main__.py":
                    assert node.module != "pagoda.router.server", f"{name} imports the process module"
    code = "import sys, pagoda.router.openai.front, pagoda.router.grpc_front; assert 'pagoda.router.server' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_disaggregation_sends_the_prompt_to_a_prefill_worker_then_the_request_to_a_decode_worker():
    """router/disagg.py: with a prefill and a decode worker, the prompt goes first to the prefill
    worker as a one-token greedy request with none of the caller's sampling, then the caller's
    request, unchanged but for a fetch hint naming the prefill worker and the prompt's full blocks
    (not the block the last token ends), to the decode worker, which alone streams back. Prompts
    with no full block to move, and prompt-logprob requests, go to the decode pool whole; a
    prefill worker that fails leaves the decode leg without a hint. Without a decode pool every
    worker serves whole requests."""
    async def go():
        async with stand_ins({"kv_role": "prefill"}, {"kv_role": "decode"}, {"kv_role": "decode"}) as pipeline:
            pre, seen = pipeline.cluster.workers["w0"], pipeline.stand_ins
            sp = pb.SamplingParams(max_tokens=3, temperature=0.7, seed=5, logprobs=2, stop=["x"])
            out = await collect(pipeline, pb.GenerateRequest(request_id="r1", token_ids=list(range(1, 33)),
                                                             cache_salt="s", sampling=sp), Identity("alice"))
            assert {r.worker_id for r in out} <= {"w1", "w2"} and len(out) == 3 and out[-1].finished
            (leg,) = seen["w0"].requests
            assert list(leg.token_ids) == list(range(1, 33)) and leg.cache_salt == "s" and leg.request_id == "r1"
            assert leg.sampling == pb.SamplingParams(max_tokens=1, temperature=0.0) and not leg.HasField("kv_fetch")
            (decode,) = seen[out[0].worker_id].requests
            assert decode.sampling == sp and list(decode.token_ids) == list(range(1, 33))
            assert decode.kv_fetch == pb.KVFetchHint(source_address=pre.lease.address, num_blocks=1)
            assert not pre.credits and all(not w.credits for w in pipeline.cluster.workers.values())
            m = pipeline.metrics
            assert m.pd_requests._value.get() == 1
            for short in (pb.GenerateRequest(token_ids=list(range(1, 17))),
                          pb.GenerateRequest(token_ids=list(range(1, 40)), sampling=pb.SamplingParams(prompt_logprobs=1))):
                out = await collect(pipeline, short)
                assert out[-1].worker_id in ("w1", "w2") and len(seen["w0"].requests) == 1
                assert not seen[out[-1].worker_id].requests[-1].HasField("kv_fetch")
            # A fetch the policy priced for a decode worker (from another peer) gives way to the
            # P/D hint: the prompt is on the prefill worker now.
            prepared, _, _ = await pipeline._decide(pb.GenerateRequest(token_ids=list(range(1, 33))), None)
            priced = Choice(pipeline.cluster.workers["w1"], 0.0, 0, fetch=Fetch(pipeline.cluster.workers["w2"], 1, 0))
            p2, (c2,) = await pipeline.disagg.prefill(prepared, [pre], [priced], None)
            assert c2.fetch is None and c2.cached_tokens == 16
            assert pipeline.select.upstream(c2, p2.upstream).kv_fetch.source_address == pre.lease.address
        async with stand_ins({"kv_role": "prefill", "fail_first": 1}, {"kv_role": "decode"}) as pipeline:
            out = await collect(pipeline, pb.GenerateRequest(token_ids=list(range(1, 40))))
            assert out[-1].worker_id == "w1" and not pipeline.stand_ins["w1"].requests[0].HasField("kv_fetch")
            assert pipeline.metrics.pd_fallbacks.labels("prefill_failed")._value.get() == 1
        # A decode worker that fails before its first token: the next decode worker, same hint.
        async with stand_ins({"kv_role": "prefill"}, {"kv_role": "decode", "fail_first": 1},
                             {"kv_role": "decode"}) as pipeline:
            for _ in range(2):      # round robin: w1 first both times
                out = await collect(pipeline, pb.GenerateRequest(token_ids=list(range(1, 40))))
                assert out[-1].finished and out[-1].worker_id in ("w1", "w2")
            sent = pipeline.stand_ins["w1"].requests + pipeline.stand_ins["w2"].requests
            assert len(sent) == 2 and all(r.kv_fetch.num_blocks == 2 for r in sent)
            # w1 refused the first request (w2 served it with the same hint), served the second.
            assert [len(pipeline.stand_ins[w].requests) for w in ("w1", "w2")] == [1, 1]
        async with stand_ins({"kv_role": "prefill"}, {}) as pipeline:
            workers = {(await collect(pipeline, pb.GenerateRequest(token_ids=list(range(1, 40)))))[-1].worker_id
                       for _ in range(2)}
            assert workers == {"w0", "w1"} and pipeline.metrics.pd_requests._value.get() == 0
    asyncio.run(go())
