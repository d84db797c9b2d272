"""The Redis key schema shared by workers (who publish) and routers (who read).

Per worker, a lease key with a TTL holds the worker's address, model, epoch and load figures;
it is refreshed at every heartbeat, so a worker whose process died drops out when the key
expires. Per model, a bounded stream carries batches of block events (stored / removed), each
stamped with the worker, its epoch and a per-worker batch sequence number: a router that sees
the sequence jump knows it missed events and resynchronises that worker from its snapshot key,
which holds every cached block hash plus the sequence number and stream id it is current to.

Load changes between heartbeats (a request admitted or finished) go out as the whole lease on a
per-model load stream, rate-limited by the worker, so routers tailing it act on figures tens of
milliseconds old rather than a heartbeat old.

The epoch is new for every process, so a router never mixes a dead process's blocks with its
successor's even when both use the same worker id.

Tiers (issue 23): a worker with a host-memory KV tier reports those blocks apart from its device
blocks, in places a reader of the device schema never looks, so such a reader is unharmed and
simply sees the device tier: a batch's host events go in its own field ("hv", packed as "ev"), the
host blocks' snapshot in its own key (same format and sequence number as the device snapshot,
written with it in one transaction), and the lease names the tier's size and copy rate. "stored"
on the device tier means the device pool holds the block now; on the host tier, the host pool
does. A block may be in both.

Roles (issue 36, prefill/decode disaggregation): the lease's kv_role is the worker's --kv-role,
"prefill", "decode" or "both" (absent: "both", what every older worker is). While a model has
live workers of both the prefill and the decode role, a router sends a request's prompt to a
prefill worker and its decode to a decode worker, which fetches the prompt's KV from the first
(router/disagg.py); otherwise every worker serves whole requests.

KV transfer (issue 36): the lease names the bytes of one KV block (0 for a worker that can neither
serve nor take a fetch) and the rate and per-call overhead the worker measured of its fetches from
peers, which routers price a fetch hint with (router/scoring.py).
"""
from __future__ import annotations

import json
import os
import random
import struct
import time
from dataclasses import asdict, dataclass, field
from urllib.parse import urlparse

from pagoda.protos.block_hash import DIGEST_SIZE

PREFIX = "pagoda:v1"
LEASE_PATTERN = f"{PREFIX}:lease:*"
# Stream length bound (approximate trimming, XADD MAXLEN ~): each entry is one batch.
STREAM_MAXLEN = 50_000
LOAD_STREAM_MAXLEN = 10_000   # only the latest entry per worker matters
STORED, REMOVED = b"+", b"-"
_OPS = {"stored": STORED, "removed": REMOVED}
_NAMES = {STORED: "stored", REMOVED: "removed"}


def lease_key(worker_id: str) -> str:
    return f"{PREFIX}:lease:{worker_id}"


def events_key(model: str) -> str:
    return f"{PREFIX}:events:{model}"


def load_key(model: str) -> str:
    return f"{PREFIX}:load:{model}"


def snapshot_key(worker_id: str) -> str:
    return f"{PREFIX}:snapshot:{worker_id}"


def host_snapshot_key(worker_id: str) -> str:
    """The host tier's blocks: a Snapshot whose seq equals the device snapshot's when current."""
    return f"{PREFIX}:snapshot-host:{worker_id}"


def new_epoch() -> int:
    """Milliseconds since the epoch with random low bits: later processes get larger epochs."""
    return (int(time.time() * 1000) << 16) | random.getrandbits(16)


def redis_password(url: str) -> str | None:
    """REDIS_PASSWORD applies when the URL carries no password of its own."""
    if urlparse(url).password:
        return None
    return os.environ.get("REDIS_PASSWORD") or None


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclass
class Lease:
    """What a worker announces at every heartbeat."""
    worker_id: str
    model: str
    address: str
    epoch: int
    block_size: int
    num_blocks: int = 0
    running: int = 0
    waiting: int = 0
    queued_prefill_tokens: int = 0
    kv_usage: float = 0.0
    free_blocks: int = 0
    seq: int = 0            # last event batch sequence number assigned
    ts: float = 0.0         # worker wall clock at the heartbeat
    # What the worker measured of its own speed (0 = not yet known; routers assume defaults):
    # a step costs step_s + prefill tokens / prefill_tps + decoding sequences / decode_tps,
    # and carries at most max_batched_tokens tokens.
    prefill_tps: float = 0.0
    decode_tps: float = 0.0
    step_s: float = 0.0
    max_batched_tokens: int = 0
    name: str = ""          # stable name for metric labels (pod or --worker-name), unlike worker_id
    tokenizer_digest: str = ""   # PromptTokenizer.digest of the tokenizer the worker serves
    # Multi-LoRA: the adapters requests may name here (at most MAX_LORA_ADAPTERS), and those of
    # them already in a device slot (no load before the first step).
    lora_adapters: list[str] = field(default_factory=list)
    lora_resident: list[str] = field(default_factory=list)
    # Where each of lora_adapters was read from, in its order ("" where unknown or longer than
    # MAX_ADAPTER_NAME): what /v1/models shows as the adapter's root, and what makes a repeated
    # load of the same name and path a no-op. And the worker's adapter slots (--max-loras):
    # 0 means it runs without --enable-lora, so the router never sends it a load.
    lora_paths: list[str] = field(default_factory=list)
    max_loras: int = 0
    # Host KV tier (0 blocks: none): its size, and the rate the worker measured of copying KV
    # between the tiers, in tokens per second (0 = not known; routers assume a default).
    host_blocks: int = 0
    kv_copy_tps: float = 0.0
    kv_role: str = "both"   # one of KV_ROLES: what share of requests routers send here
    # KV transfer between workers (issue 36): the bytes of one block's K and V over all layers (0:
    # this worker neither serves nor takes fetches, and routers never hint it), and what it
    # measured of its completed fetches as fetcher: seconds = kv_fetch_overhead_s + bytes /
    # kv_fetch_bps (a prior until its first fetch; 0 = not known, routers assume defaults).
    kv_block_bytes: int = 0
    kv_fetch_bps: float = 0.0
    kv_fetch_overhead_s: float = 0.0

    def encode(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes | str) -> "Lease":
        """Parsed against the schema: a value of the wrong type or out of range is refused
        here, so nothing downstream (scoring, fencing) ever sees it."""
        if len(data) > MAX_LEASE_BYTES:
            raise ValueError(f"lease: {len(data)} bytes, more than {MAX_LEASE_BYTES}")
        try:
            raw = json.loads(data)
        except ValueError as e:
            raise ValueError(f"lease: malformed ({e})") from None
        if not isinstance(raw, dict):
            raise ValueError("lease: not a JSON object")
        try:
            lease = cls(**{name: _checked(name, raw[name], str(f.type))
                           for name, f in cls.__dataclass_fields__.items() if name in raw})
        except (TypeError, ValueError) as e:
            raise ValueError(f"lease: malformed ({e})") from None
        if not lease.worker_id or not lease.model or not lease.address:
            raise ValueError("lease: worker_id, model and address are required")
        for name, (lo, hi) in _LEASE_BOUNDS.items():
            v = getattr(lease, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not lo <= v <= hi:
                raise ValueError(f"lease: {name} must be a number in [{lo}, {hi}] (got {v!r})")
        if not isinstance(lease.name, str) or len(lease.name) > 253:
            raise ValueError("lease: name must be a string of at most 253 characters")
        if lease.kv_role not in KV_ROLES:
            raise ValueError(f"lease: kv_role must be one of {', '.join(KV_ROLES)} (got {lease.kv_role!r:.40})")
        if lease.block_size < 1 or not 0.0 <= lease.kv_usage <= 1.0:
            raise ValueError("lease: block_size must be >= 1 and kv_usage in [0, 1]")
        return lease


# Speed figures feed the router's arithmetic directly: out-of-range values are refused, not used.
KV_ROLES = ("prefill", "decode", "both")
_LEASE_BOUNDS = {"prefill_tps": (0.0, 1e9), "decode_tps": (0.0, 1e9), "step_s": (0.0, 60.0),
                 "max_batched_tokens": (0, 1 << 24), "host_blocks": (0, 1 << 32), "kv_copy_tps": (0.0, 1e12),
                 "kv_block_bytes": (0, 1 << 40), "kv_fetch_bps": (0.0, 1e12), "kv_fetch_overhead_s": (0.0, 60.0)}
MAX_LEASE_BYTES = 64 << 10         # room for three full adapter lists (names, resident, paths)
MAX_TEXT = 512                      # worker ids, model names, addresses
MAX_LORA_ADAPTERS = 64              # names in each of a lease's adapter lists
MAX_ADAPTER_NAME = 256              # as pagoda.protos.limits' max_id_bytes
_MAX_INT = (1 << 63) - 1


def _checked(name: str, value, kind: str):
    """One field against its annotated type: str (bounded), int (non-negative, not a bool)
    or float (finite, non-negative)."""
    if name == "lora_paths":
        if not isinstance(value, list) or len(value) > MAX_LORA_ADAPTERS or not all(
                isinstance(v, str) and len(v) <= MAX_ADAPTER_NAME for v in value):
            raise ValueError(f"{name} must be a list of at most {MAX_LORA_ADAPTERS} paths of at most "
                             f"{MAX_ADAPTER_NAME} characters")
    elif kind == "list[str]":
        if not isinstance(value, list) or len(value) > MAX_LORA_ADAPTERS or not all(
                isinstance(v, str) and 0 < len(v) <= MAX_ADAPTER_NAME for v in value):
            raise ValueError(f"{name} must be a list of at most {MAX_LORA_ADAPTERS} names of 1 to "
                             f"{MAX_ADAPTER_NAME} characters")
    elif kind == "str":
        if not isinstance(value, str) or len(value) > MAX_TEXT:
            raise ValueError(f"{name} must be a string of at most {MAX_TEXT} characters")
    elif kind == "int":
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX_INT:
            raise ValueError(f"{name} must be a non-negative integer (got {value!r:.40})")
    elif isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        raise ValueError(f"{name} must be a finite non-negative number (got {value!r:.40})")
    return value


def pack_events(events: list[tuple[str, bytes]]) -> bytes:
    """[("stored"|"removed", hash)] -> one op byte + 16 hash bytes per event, order kept."""
    out = bytearray()
    for kind, h in events:
        if len(h) != DIGEST_SIZE:
            raise ValueError(f"events: block hash must be {DIGEST_SIZE} bytes (got {len(h)})")
        out += _OPS[kind] + h
    return bytes(out)


def unpack_events(data: bytes) -> list[tuple[str, bytes]]:
    step = DIGEST_SIZE + 1
    if len(data) % step:
        raise ValueError("events: truncated payload")
    return [(_NAMES[data[i:i + 1]], data[i + 1:i + step]) for i in range(0, len(data), step)]


@dataclass
class EventBatch:
    """One stream entry: the block events a worker drained since its previous batch."""
    worker_id: str
    epoch: int
    seq: int
    events: list[tuple[str, bytes]] = field(default_factory=list)
    host_events: list[tuple[str, bytes]] = field(default_factory=list)     # the host tier's

    def fields(self) -> dict[str, bytes | str]:
        out: dict[str, bytes | str] = {"w": self.worker_id, "e": str(self.epoch), "n": str(self.seq),
                                       "ev": pack_events(self.events)}
        if self.host_events:
            out["hv"] = pack_events(self.host_events)
        return out

    @classmethod
    def from_fields(cls, fields: dict) -> "EventBatch":
        f = {_text(k): v for k, v in fields.items()}
        try:
            worker_id, epoch, seq = _text(f["w"]), int(f["e"]), int(f["n"])
            if len(worker_id) > MAX_TEXT or not 0 <= epoch <= _MAX_INT or not 0 <= seq <= _MAX_INT:
                raise ValueError("worker id, epoch or seq out of range")
            return cls(worker_id, epoch, seq, unpack_events(f.get("ev", b"")), unpack_events(f.get("hv", b"")))
        except (KeyError, ValueError, TypeError, UnicodeDecodeError) as e:
            raise ValueError(f"event batch: malformed ({e})") from None


@dataclass
class Snapshot:
    """Every block a worker holds, current up to batch `seq` (stream entry `stream_id`)."""
    worker_id: str
    epoch: int
    seq: int
    stream_id: str            # id of the last batch XADDed before it, "0-0" if none
    hashes: list[bytes] = field(default_factory=list)

    def encode(self) -> bytes:
        head = json.dumps({"worker_id": self.worker_id, "epoch": self.epoch, "seq": self.seq,
                           "stream_id": self.stream_id}).encode()
        return struct.pack("<I", len(head)) + head + b"".join(self.hashes)

    @staticmethod
    def max_bytes(num_blocks: int) -> int:
        """The largest snapshot a worker with `num_blocks` blocks can write (the router reads
        a snapshot's length first and refuses one beyond this without fetching it)."""
        return 4 + MAX_SNAPSHOT_HEAD + num_blocks * DIGEST_SIZE

    @classmethod
    def decode(cls, data: bytes) -> "Snapshot":
        try:
            (n,) = struct.unpack_from("<I", data)
            if n > MAX_SNAPSHOT_HEAD:
                raise ValueError(f"header of {n} bytes")
            head = json.loads(data[4:4 + n])
            body = data[4 + n:]
            if len(body) % DIGEST_SIZE:
                raise ValueError("truncated hashes")
            hashes = [body[i:i + DIGEST_SIZE] for i in range(0, len(body), DIGEST_SIZE)]
            snap = cls(_checked("worker_id", head["worker_id"], "str"), _checked("epoch", head["epoch"], "int"),
                       _checked("seq", head["seq"], "int"), _checked("stream_id", head["stream_id"], "str"), hashes)
            stream_id_tuple(snap.stream_id)
            return snap
        except (struct.error, KeyError, ValueError, TypeError, UnicodeDecodeError) as e:
            raise ValueError(f"snapshot: malformed ({e})") from None


MAX_SNAPSHOT_HEAD = 4096


def stream_id_tuple(stream_id: bytes | str) -> tuple[int, int]:
    """'1712-3' -> (1712, 3), for ordering stream ids."""
    ms, _, seq = _text(stream_id).partition("-")
    return int(ms), int(seq or 0)
