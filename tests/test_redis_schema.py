"""The Redis key schema's encodings: round trips and clear errors on malformed data."""
import json

import pytest

from pagoda.protos import redis_schema as rs
from pagoda.protos.block_hash import hash_block, namespace_root

H = [hash_block(namespace_root("m"), [i]) for i in range(4)]


def test_keys_are_namespaced_and_distinct():
    keys = {rs.lease_key("w1"), rs.events_key("w1"), rs.snapshot_key("w1")}
    assert len(keys) == 3 and all(k.startswith(rs.PREFIX + ":") for k in keys)
    assert rs.lease_key("w1").startswith(rs.LEASE_PATTERN[:-1])


def test_lease_round_trip_and_validation():
    lease = rs.Lease("w1", "m", "10.0.0.1:50051", rs.new_epoch(), 16, num_blocks=64, running=2, waiting=1,
                     queued_prefill_tokens=300, kv_usage=0.25, free_blocks=48, seq=7, ts=1.5)
    assert rs.Lease.decode(lease.encode()) == lease
    with pytest.raises(ValueError, match="lease"):
        rs.Lease.decode(b"{not json")
    with pytest.raises(ValueError, match="address"):
        rs.Lease.decode(b'{"worker_id":"w","model":"m","address":"","epoch":1,"block_size":16}')


def test_lease_speed_figures_are_bounded():
    lease = rs.Lease("w1", "m", "a:1", 1, 16, prefill_tps=16000.0, decode_tps=4000.0, step_s=0.006,
                     max_batched_tokens=4096, name="pod-0")
    assert rs.Lease.decode(lease.encode()) == lease
    for field, bad in (("prefill_tps", -1.0), ("decode_tps", 1e12), ("step_s", 120.0),
                       ("max_batched_tokens", "many"), ("prefill_tps", True)):
        raw = lease.encode().replace(f'"{field}":'.encode(), f'"{field}":{json.dumps(bad)},"_":'.encode())
        with pytest.raises(ValueError, match=field):
            rs.Lease.decode(raw)
    assert rs.load_key("m") not in {rs.events_key("m"), rs.lease_key("m"), rs.snapshot_key("m")}


def test_lease_kv_role_is_one_of_the_roles():
    """An older worker's lease has no kv_role: it serves whole requests ("both")."""
    assert rs.Lease.decode(b'{"worker_id":"w","model":"m","address":"a:1","epoch":1,"block_size":16}').kv_role \
        == "both"
    lease = rs.Lease("w1", "m", "a:1", 1, 16, kv_role="prefill")
    assert rs.Lease.decode(lease.encode()).kv_role == "prefill"
    for bad in ("Prefill", "", 3):
        with pytest.raises(ValueError, match="kv_role"):
            rs.Lease.decode(lease.encode().replace(b'"prefill"', json.dumps(bad).encode()))


def test_epochs_increase_across_processes():
    a = rs.new_epoch()
    import time
    time.sleep(0.002)
    assert rs.new_epoch() > a


def test_event_batch_round_trip_keeps_order():
    events = [("stored", H[0]), ("stored", H[1]), ("removed", H[0]), ("stored", H[0])]
    b = rs.EventBatch("w1", 42, 3, events)
    fields = {k.encode(): (v if isinstance(v, bytes) else v.encode()) for k, v in b.fields().items()}
    assert rs.EventBatch.from_fields(fields) == b
    with pytest.raises(ValueError, match="event batch"):
        rs.EventBatch.from_fields({b"w": b"w1", b"e": b"1", b"n": b"1", b"ev": b"+abc"})
    with pytest.raises(ValueError, match="16 bytes"):
        rs.pack_events([("stored", b"short")])


def test_snapshot_round_trip():
    s = rs.Snapshot("w1", 42, 9, "1712-3", H)
    assert rs.Snapshot.decode(s.encode()) == s
    assert rs.Snapshot.decode(rs.Snapshot("w", 1, 0, "0-0").encode()).hashes == []
    with pytest.raises(ValueError, match="snapshot"):
        rs.Snapshot.decode(s.encode()[:-3])


def test_stream_ids_order_numerically():
    assert rs.stream_id_tuple("1712-10") > rs.stream_id_tuple(b"1712-9")
    assert rs.stream_id_tuple("0-0") < rs.stream_id_tuple("1-0")


def test_password_from_env_only_when_url_has_none(monkeypatch):
    monkeypatch.setenv("REDIS_PASSWORD", "s3cret")
    assert rs.redis_password("redis://host:6379/0") == "s3cret"
    assert rs.redis_password("redis://:inurl@host:6379/0") is None
