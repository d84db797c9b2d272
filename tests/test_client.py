"""Client library behaviour against a real gRPC server on loopback whose answers the test scripts:
request building, retry of UNAVAILABLE only before the first chunk, deadlines, per-call metadata,
TLS, and assembling a Completion. (The worker end-to-end tests use the same clients for real.)"""
import asyncio
import datetime
import threading
from concurrent import futures

import grpc
import pytest

from pagoda.clients import AsyncPagodaClient, PagodaClient, build_request
from pagoda.protos.pagoda.v1 import pagoda_pb2 as pb
from pagoda.protos.pagoda.v1 import pagoda_pb2_grpc as pb_grpc


class ScriptedGeneration(pb_grpc.GenerationServicer):
    """Fails the first `unavailable` calls; `fail_after_first` fails mid-stream; else streams `words`."""

    def __init__(self):
        self.calls = 0
        self.unavailable = 0
        self.fail_after_first = False
        self.delay = 0.0
        self.seen_metadata = []
        self.seen_requests = []
        self.cancelled = threading.Event()
        self.words = ["Hello", " there", "!"]

    def Generate(self, request, context):
        self.calls += 1
        self.seen_requests.append(request)
        self.seen_metadata.append(dict(context.invocation_metadata()))
        ended = []      # set when this handler ends on its own: termination before that is a cancel
        context.add_callback(lambda: None if ended else self.cancelled.set())
        if self.calls <= self.unavailable:
            ended.append(True)
            context.abort(grpc.StatusCode.UNAVAILABLE, "no worker yet")
        n = request.sampling.n if request.sampling.HasField("n") else 1
        for i, w in enumerate(self.words):
            if self.delay:
                threading.Event().wait(self.delay)
            if not context.is_active():     # the client went away: stop producing
                return
            last = i == len(self.words) - 1
            for idx in range(n):
                r = pb.GenerateResponse(request_id=request.request_id or "rid", index=idx, token_ids=[i + idx],
                                        text=w, finished=last, worker_id="w-1")
                if last:
                    r.finish_reason = pb.FINISH_REASON_LENGTH
                    r.usage.CopyFrom(pb.Usage(prompt_tokens=5, completion_tokens=len(self.words),
                                              cached_prompt_tokens=2))
                    ended.append(True)
                yield r
            if self.fail_after_first:
                ended.append(True)
                context.abort(grpc.StatusCode.UNAVAILABLE, "worker died")


def _serve(servicer, creds=None):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    pb_grpc.add_GenerationServicer_to_server(servicer, server)
    port = (server.add_secure_port("localhost:0", creds) if creds else server.add_insecure_port("127.0.0.1:0"))
    server.start()
    return server, port


@pytest.fixture
def scripted():
    svc = ScriptedGeneration()
    server, port = _serve(svc)
    yield svc, f"127.0.0.1:{port}"
    server.stop(0)


def test_build_request_maps_prompt_kinds_and_sampling():
    r = build_request("hi", max_tokens=5, temperature=0.0, stop="END", logit_bias={3: -1.5})
    assert r.text == "hi" and not r.messages and not r.token_ids
    assert r.sampling.max_tokens == 5 and r.sampling.HasField("temperature") and r.sampling.temperature == 0.0
    assert list(r.sampling.stop) == ["END"] and dict(r.sampling.logit_bias) == {3: -1.5}
    assert not r.sampling.HasField("top_p")
    r = build_request([1, 2, 3])
    assert list(r.token_ids) == [1, 2, 3] and not r.HasField("text")
    r = build_request("question", system="be brief")
    assert [(m.role, m.content) for m in r.messages] == [("system", "be brief"), ("user", "question")]
    assert not r.HasField("text")
    with pytest.raises(TypeError, match="max_token"):
        build_request("x", max_token=3)


def test_complete_assembles_text_usage_and_choices(scripted):
    svc, target = scripted
    with PagodaClient(target) as c:
        out = c.complete("x", n=2, request_id="abc")
    assert out.text == "Hello there!" and out.finish_reason == "length" and out.request_id == "abc"
    assert [ch.index for ch in out.choices] == [0, 1] and out.choices[1].token_ids == [1, 2, 3]
    assert out.usage.prompt_tokens == 5 and out.usage.completion_tokens == 6 and out.worker_id == "w-1"


def test_unavailable_before_first_chunk_is_retried(scripted):
    svc, target = scripted
    svc.unavailable = 2
    with PagodaClient(target, retries=3, backoff=0.01) as c:
        assert c.complete("x").text == "Hello there!"
    assert svc.calls == 3


def test_retries_give_up_with_the_server_status(scripted):
    svc, target = scripted
    svc.unavailable = 10
    with PagodaClient(target, retries=2, backoff=0.01) as c, pytest.raises(grpc.RpcError) as err:
        c.complete("x")
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and svc.calls == 3


def test_unavailable_after_first_chunk_is_not_retried(scripted):
    svc, target = scripted
    svc.fail_after_first = True
    chunks = []
    with PagodaClient(target, retries=5, backoff=0.01) as c, pytest.raises(grpc.RpcError) as err:
        for ch in c.generate("x"):
            chunks.append(ch)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert [ch.text for ch in chunks] == ["Hello"] and svc.calls == 1


def test_deadline_and_metadata(scripted):
    svc, target = scripted
    svc.delay = 0.5
    with PagodaClient(target, metadata=[("x-tenant", "team-a")]) as c:
        with pytest.raises(grpc.RpcError) as err:
            c.complete("x", timeout=0.2, metadata=[("x-trace", "t1")])
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    md = svc.seen_metadata[-1]
    assert md["x-tenant"] == "team-a" and md["x-trace"] == "t1"


def test_metadata_none_means_none(scripted):
    """metadata=None (as callers pass an optional through) is no metadata, not a TypeError."""
    svc, target = scripted
    with PagodaClient(target, metadata=None) as c:
        assert c.complete("x", metadata=None).text == "Hello there!"
    assert "x-tenant" not in svc.seen_metadata[-1]

    async def main():
        async with AsyncPagodaClient(target, metadata=None) as c:
            return (await c.complete("x")).text
    assert asyncio.run(main()) == "Hello there!"


def test_async_client_streams_retries_and_cancels(scripted):
    svc, target = scripted
    svc.unavailable = 1

    async def go():
        async with AsyncPagodaClient(target, retries=2, backoff=0.01) as c:
            texts = [ch.text async for ch in c.generate("x")]
            assert not svc.cancelled.is_set()
            svc.delay = 0.3
            stream = c.generate("y")
            first = await stream.__anext__()
            await stream.aclose()   # abandoning the stream must cancel the call server-side
            return texts, first

    texts, first = asyncio.run(go())
    assert texts == ["Hello", " there", "!"] and svc.calls == 3 and first.text == "Hello"
    assert svc.cancelled.wait(5)


def _self_signed():
    x509 = pytest.importorskip("cryptography.x509")
    import ipaddress

    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return key_pem, cert.public_bytes(serialization.Encoding.PEM)


def test_tls():
    key_pem, cert_pem = _self_signed()
    svc = ScriptedGeneration()
    server, port = _serve(svc, grpc.ssl_server_credentials([(key_pem, cert_pem)]))
    try:
        with PagodaClient(f"localhost:{port}", root_certificates=cert_pem) as c:
            assert c.complete("x").text == "Hello there!"
        # A plaintext client cannot talk to the TLS port.
        with PagodaClient(f"localhost:{port}", retries=0) as c, pytest.raises(grpc.RpcError):
            c.complete("x", timeout=2)
    finally:
        server.stop(0)
