"""Direct mode's grants (runtime/security.py) and the router's credit for a direct request
(router/scoring.py), in process: exact answers on hand-built requests, no I/O."""
import grpc
import pytest

from pagoda.protos.pagoda.v1 import pagoda_pb2 as pb
from pagoda.protos.redis_schema import Lease
from pagoda.router.scoring import WorkerState
from pagoda.runtime.security import GrantError, GrantSigner, GrantVerifier, Identity, KeyRing


@pytest.fixture
def keyring(tmp_path):
    path = tmp_path / "keys"
    path.write_text("router-key router admin\nalice-key alice\n")
    return KeyRing(str(path))


def request(**sampling):
    return pb.GenerateRequest(token_ids=[5, 6, 7], model="m", request_id="r1",
                              sampling=pb.SamplingParams(max_tokens=8, **sampling), cache_salt="s")


def refused(verifier, grant, req, now=1000.0) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(GrantError) as e:
        verifier.verify(grant, req, now=now)
    return e.value.code, str(e.value)


def test_a_grant_names_its_tenant_and_opens_one_stream(keyring):
    signer, verifier = GrantSigner("router-key", ttl=10), GrantVerifier(keyring, "w1")
    grant, expires = signer.sign("w1", Identity("alice"), request(), now=1000.0)
    assert expires == 1010.0
    assert verifier.verify(grant, request(), now=1005.0) == Identity("alice")
    assert refused(verifier, grant, request(), now=1005.0) == (grpc.StatusCode.PERMISSION_DENIED, "grant: already used")
    # The router acting as admin or without keys: served unscoped.
    for ident in (None, Identity("ops", admin=True), None):      # each grant its own, even when alike
        assert verifier.verify(signer.sign("w1", ident, request(), now=1000.0)[0], request(), now=1001.0) is None


def test_a_grant_holds_only_for_its_request_worker_time_and_key(keyring, tmp_path):
    signer = GrantSigner("router-key", ttl=10)
    grant, _ = signer.sign("w1", Identity("alice"), request(), now=1000.0)
    w1 = GrantVerifier(keyring, "w1")
    denied = (grpc.StatusCode.PERMISSION_DENIED, "grant: not signed for this request on this worker")
    # Any change of the request (its limits, its salt, its id) or of the worker breaks it.
    assert refused(w1, grant, request(temperature=0.5)) == denied
    changed = request()
    changed.sampling.max_tokens = 9
    assert refused(w1, grant, changed) == denied
    assert refused(GrantVerifier(keyring, "w2"), grant, request()) == denied
    # Nor can the tenant in it be swapped: it is under the MAC.
    forged = grant.replace(b"alice", b"bobby")
    assert refused(w1, forged, request()) == denied
    assert refused(w1, grant, request(), now=1010.5)[1] == "grant: expired; ask the router again"
    # Signed with a key the worker does not hold as an admin key (a tenant's key does not sign).
    for key in ("other-key", "alice-key"):
        bad, _ = GrantSigner(key).sign("w1", None, request(), now=1000.0)
        assert refused(w1, bad, request()) == (grpc.StatusCode.UNAUTHENTICATED,
                                                "grant: signed with a key this worker does not hold")
    for junk in (b"", b"\x01", grant[:-1], b"\x02" + grant[1:]):
        assert refused(w1, junk, request()) == (grpc.StatusCode.UNAUTHENTICATED, "grant: malformed")
    # A keys-file reload that drops the router's key drops its grants too.
    path = tmp_path / "keys"
    path.write_text("new-router-key router admin\n")
    keyring.reload()
    assert refused(w1, grant, request())[0] == grpc.StatusCode.UNAUTHENTICATED
    fresh, _ = GrantSigner("new-router-key").sign("w1", None, request(), now=1000.0)
    assert w1.verify(fresh, request(), now=1001.0) is None


def test_a_direct_credit_leaves_the_ledger_when_a_report_counts_it():
    rates = dict(prefill_tps=1000.0, decode_tps=1000.0, step_s=0.01, max_batched_tokens=100)
    w = WorkerState(Lease("a", "m", "h:a", 1, 16, num_blocks=100, free_blocks=100, ts=1.0, **rates))
    w.credit("direct", 64, now=10.0, prefix=b"p", direct=True)
    w.credit("proxied", 32, now=10.0, prefix=b"p")
    assert w.prefix_live == {b"p": 2} and w.credit_prefill == 96
    w.on_heartbeat(Lease("a", "m", "h:a", 1, 16, ts=11.0, running=2, **rates))
    # The report counts both; the proxied one stays known until its stream ends, the direct one
    # (whose end the router never sees) is the report's alone from here.
    assert set(w.counted) == {"proxied"} and not w.credits and w.prefix_live == {b"p": 1}
    w.finish("proxied", 12.0)
    assert w.prefix_live == {}


def test_used_grants_are_forgotten_once_expired(keyring):
    signer, verifier = GrantSigner("router-key", ttl=10), GrantVerifier(keyring, "w1")
    for i in range(4096):
        verifier.verify(signer.sign("w1", None, request(), now=1000.0)[0], request(), now=1000.0)
    assert len(verifier._used) == 4096
    # The next grant, after the first ones expired, sweeps them out; it is remembered itself.
    late, _ = signer.sign("w1", None, request(), now=1020.0)
    verifier.verify(late, request(), now=1020.0)
    assert len(verifier._used) == 1
    assert refused(verifier, late, request(), now=1021.0)[1] == "grant: already used"
