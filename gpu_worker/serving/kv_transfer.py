"""KV that moves: one worker serves a run of its cached blocks by hash, another pulls them into its
own pool and names them in its prefix cache as if it had computed them (DESIGN.md, round four).

Transport: Admin.FetchKVBlocks, a gRPC server-streaming call on the worker's own server; each
message a pack of consecutive blocks up to PACK_BYTES (K then V of every layer, raw, in the pool's
dtype; one block when a block is bigger). What was tried first
(2026-12, this CPU host, torch 2.13+cpu, `pip install --dry-run` then `--target` a scratch folder):
- mooncake-transfer-engine 0.3.13.post1 resolves, but its module fails to import without CUDA
  (`libcudart.so.12: cannot open shared object file`); its -non-cuda build fails without RDMA
  verbs (`libibverbs.so.1`), so its TCP transport never got to run here.
- nixl 1.5.1 resolves (nixl-cu12 + nixl-cu13 wheels, ~130 MB) and a UCX agent starts on CPU. Not
  taken in phase 1: its one-sided reads of registered pool memory sit outside the worker keys
  (a control plane that authenticates and names the blocks is needed anyway, and this call is
  that plane), and it wants its own out-of-band metadata exchange. Fetcher/serve_fetch are the
  one interface a NIXL data path would go behind on GPU hosts.

Auth: the call is on the Admin service, so the AuthInterceptor (runtime/security.py) already
refuses it without an admin key; a fetching worker sends `--kv-peer-api-key-file`'s key (an
admin key in its peers' keys files, as the router's --worker-api-key-file). Only a router may set
a hint (server.py refuses one from a tenant's key): the key goes wherever the hint points. A
worker that serves TLS reaches its peers over TLS too, as a router reaches workers
(peer_credentials). Bounds: at most max_blocks a fetch, one deadline for the whole call.

Verification: the receiver computes the chain itself from the request's token ids and its own
namespace root (model, adapter, tenant-scoped salt), asks for exactly those hashes, and takes a
block only when its hash is the next one of that chain, its size is the layout's, and its digest
(of hash + bytes) matches. Quarantine: the blocks the fetch writes into are fresh pool blocks
held by the fetch alone (ref 1, no hash), so nothing can find or read them; only the leading
run that arrived whole and verified is named in the prefix cache at the end, the rest is freed
unnamed. Any failure (refused, deadline, source gone, truncated, corrupt) ends there: the
request then prefills whatever is not cached, as it would have without a hint.

One writer: the network side runs on the event loop; every pool change (reserve, write, name,
free) is a typed command below, run on the engine thread through AsyncLLM.call. Each command waits
for the engine's step in progress, so on a busy worker a fetch costs about one step per command:
the commands are few (the source: one export per EXPORT_BYTES; the receiver: a plan, one write per
WRITE_BYTES, the last one together with the naming) and each side asks for the next export or write
while the network moves the one before.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Optional

import grpc
import torch

from pagoda.gpu_worker.core.block_pool import KVCacheBlock
from pagoda.gpu_worker.serving.step_rates import TransferRate
from pagoda.protos.block_hash import block_hashes, namespace_root
from pagoda.protos.pagoda.v1 import pagoda_pb2 as pb
from pagoda.protos.pagoda.v1 import pagoda_pb2_grpc as pb_grpc
from pagoda.runtime.security import channel_credentials

if TYPE_CHECKING:
    from pagoda.gpu_worker.engine.llm_engine import LLMEngine
    from pagoda.gpu_worker.serving.engine_client import EngineClient

log = logging.getLogger(__name__)

_PERSON = b"pagoda-kvxfer"
EXPORT_BYTES = 64 << 20     # copied out per engine command (at least a block): the source's staging bound
WRITE_BYTES = 64 << 20      # written in per engine command (at least a block), on the receiver
PACK_BYTES = 1 << 20        # blocks per message: under gRPC's 4 MiB default message bound
# Test hook (source side): "corrupt:N", "truncate:N" or "die:N" spoils the stream at block N;
# "overpack:N" sends the first message with one block more than PACK_BYTES allows.
FAULT_ENV = "PAGODA_KV_TRANSFER_FAULT"


def block_digest(block_hash: bytes, kv: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=16, person=_PERSON)
    h.update(block_hash)
    h.update(kv)
    return h.digest()


def layout_of(engine: LLMEngine, num_blocks: int = 0) -> pb.KVLayout:
    r = engine.runner
    return pb.KVLayout(block_size=engine.block_size, num_layers=r.num_layers, num_kv_heads=r.num_kv_heads,
                       head_dim=r.head_dim, dtype=str(r.kv_dtype).replace("torch.", ""), num_blocks=num_blocks)


def block_bytes(layout: pb.KVLayout) -> int:
    """Bytes of one block's K and V over every layer: what a fetch moves per block."""
    return 2 * layout.num_layers * layout.num_kv_heads * layout.block_size * layout.head_dim * \
        torch.empty(0, dtype=getattr(torch, layout.dtype)).element_size()


def blocks_within(nbytes: int, per_block: int) -> int:
    """How many blocks a bound of `nbytes` takes: at least one, so that any block can move."""
    return max(1, nbytes // per_block)


def transfer_block_bytes(engine: LLMEngine) -> int:
    """Engine command: block_bytes of this worker's pool, 0 when it can neither serve nor take
    fetches (what its lease says, so that routers never hint it either way)."""
    return block_bytes(layout_of(engine)) if _transferable(engine) else 0


def _stores(engine: LLMEngine) -> list[torch.Tensor]:
    return engine.runner._device_stores()


def _transferable(engine: LLMEngine) -> bool:
    # Under tensor parallelism each rank holds a slice of every block: not in phase 1.
    return engine.runner.tp is None and engine.config.enable_prefix_caching


# ---- engine-thread commands ---------------------------------------------------------------------

@dataclass(frozen=True)
class ExportBlocks:
    """Source: the leading blocks of `hashes` its device cache holds, at most max_bytes of them
    (at least one), copied out (so the engine may evict or overwrite them the moment this
    returns), as uint8 [n, bytes per block], with the pool's layout (num_blocks: n). None when
    this worker cannot export (tensor parallel, or prefix caching off)."""
    hashes: tuple[bytes, ...]
    max_bytes: int = EXPORT_BYTES

    def __call__(self, engine: LLMEngine) -> Optional[tuple[pb.KVLayout, torch.Tensor]]:
        if not _transferable(engine):
            return None
        pool = engine.kv.pool
        ids = []
        for h in self.hashes[:blocks_within(self.max_bytes, block_bytes(layout_of(engine)))]:
            b = pool.get_cached_block(h)
            if b is None:
                break
            ids.append(b.block_id)
        return layout_of(engine, len(ids)), export_blocks(_stores(engine), ids)


def export_blocks(stores: list[torch.Tensor], block_ids: list[int]) -> torch.Tensor:
    """Blocks `block_ids` of a pool (one [blocks, heads, block_size, head_dim] tensor per layer and
    K/V, on any device) copied to host memory: uint8 [n, bytes per block], K then V of every layer."""
    if not block_ids:
        return torch.empty(0, 0, dtype=torch.uint8)
    d = torch.tensor(block_ids, dtype=torch.int64, device=stores[0].device)
    staging = torch.stack([t.index_select(0, d) for t in stores], dim=1).cpu().contiguous()
    return staging.view(torch.uint8).reshape(len(block_ids), -1)


def import_blocks(stores: list[torch.Tensor], block_ids: tuple[int, ...], data: torch.Tensor) -> None:
    """export_blocks' bytes (uint8 [n, bytes per block], host memory) into blocks `block_ids`."""
    t0 = stores[0]
    shape = (len(block_ids), len(stores), *t0.shape[1:])
    staging = data.view(t0.dtype).reshape(shape).to(t0.device)
    d = torch.tensor(block_ids, dtype=torch.int64, device=t0.device)
    for j, t in enumerate(stores):
        t.index_copy_(0, d, staging[:, j])


@dataclass
class ImportPlan:
    """Receiver: what a fetch asks for and the pool blocks it holds meanwhile."""
    missing: list[bytes]                 # chain hashes to fetch, in order
    blocks: list[KVCacheBlock]           # fresh, one per missing hash: the quarantine
    held: list[KVCacheBlock]             # leading blocks already cached here, pinned meanwhile
    layout: pb.KVLayout = field(default_factory=pb.KVLayout)


@dataclass(frozen=True)
class PlanImport:
    """Receiver: the prompt's chain under this worker's namespace, the leading blocks already
    cached here (pinned, so the reservation cannot evict them), and fresh blocks for the next
    ones up to `num_blocks` (fewer when the pool has fewer free). None when nothing is to fetch."""
    token_ids: tuple[int, ...]
    num_blocks: int
    cache_salt: str
    adapter: str

    def __call__(self, engine: LLMEngine) -> Optional[ImportPlan]:
        if not _transferable(engine) or len(self.token_ids) > engine.max_model_len:
            return None     # (a prompt the engine will refuse anyway)
        key = ""
        if self.adapter:
            engine._check_adapter(self.adapter)
            lora = engine.runner.lora
            assert lora is not None
            key = lora.adapters[self.adapter].cache_key
        bs = engine.block_size
        # As get_computed_blocks: the last prompt token is always computed.
        limit = min(self.num_blocks, (len(self.token_ids) - 1) // bs)
        if limit <= 0:
            return None
        hashes = block_hashes(self.token_ids[:limit * bs], bs, namespace_root(engine.model_name, key, self.cache_salt))
        pool = engine.kv.pool
        held = []
        for h in hashes:
            b = pool.get_cached_block(h)
            if b is None:
                break
            held.append(b)
        pool.touch(held)
        missing = hashes[len(held):][:pool.num_free_blocks()]
        if not missing:
            pool.free_blocks(reversed(held))
            return None
        return ImportPlan(missing, pool.get_new_blocks(len(missing)), held, layout_of(engine))


@dataclass(frozen=True)
class WriteBlocks:
    """Receiver: verified bytes (uint8 [n, bytes per block]) into quarantined blocks."""
    block_ids: tuple[int, ...]
    data: torch.Tensor

    def __call__(self, engine: LLMEngine) -> None:
        import_blocks(_stores(engine), self.block_ids, self.data)


@dataclass(frozen=True)
class FinishImport:
    """Receiver: write `last` (the fetch's last verified blocks, in the same engine turn), name the
    first `num_ok` quarantined blocks by their hashes (written whole and verified, in chain order),
    then let every block of the plan go: the named ones stay in the prefix cache (LRU, tail
    first), the others return unnamed."""
    plan: ImportPlan
    num_ok: int
    last: Optional[WriteBlocks] = None

    def __call__(self, engine: LLMEngine) -> None:
        pool, p = engine.kv.pool, self.plan
        try:
            if self.last is not None:
                self.last(engine)
            if self.num_ok:
                pool.cache_full_blocks(p.blocks, p.missing, 0, self.num_ok)
        finally:
            pool.free_blocks(reversed(p.held + p.blocks))


# ---- both sides: what moved, for the metrics (gpu_worker/serving/metrics.py reads it at scrape time)

@dataclass
class TransferTally:
    """One side's transfers (as fetcher, or as source): completed calls, blocks and bytes moved
    (by failed calls too), seconds of calls, failed calls by reason."""
    calls: int = 0
    blocks: int = 0
    bytes: int = 0
    seconds: float = 0.0
    failures: dict[str, int] = field(default_factory=dict)

    def add(self, blocks: int, nbytes: int, seconds: float, failure: str = "") -> None:
        self.calls += 1
        self.blocks, self.bytes, self.seconds = self.blocks + blocks, self.bytes + nbytes, self.seconds + seconds
        if failure:
            self.failures[failure] = self.failures.get(failure, 0) + 1


# ---- source side (event loop) -------------------------------------------------------------------

class FetchError(Exception):
    """A fetch refused or broken; the request recomputes what did not arrive. `reason`: a short
    label for the metrics (layout, chain, digest, truncated, or a gRPC status in lower case)."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


def _fault() -> tuple[str, int]:
    spec = os.environ.get(FAULT_ENV, "")
    kind, _, at = spec.partition(":")
    return (kind, int(at)) if kind and at.isdigit() else ("", -1)


async def serve_fetch(engine: EngineClient, model_name: str, request: pb.FetchKVBlocksRequest,
                      context: grpc.aio.ServicerContext, max_blocks: int,
                      tally: Optional[TransferTally] = None) -> AsyncIterator[pb.FetchKVBlocksResponse]:
    """Admin.FetchKVBlocks: the layout, then the leading requested blocks this worker holds.
    `tally`: what was served, counted when the call ends (refused, or ended by the fetcher:
    "cancelled", as failures)."""
    tally = tally if tally is not None else TransferTally()
    t0, sent, nbytes, failure = time.monotonic(), 0, 0, "cancelled"

    async def refuse(code: grpc.StatusCode, message: str) -> None:
        nonlocal failure
        failure = code.name.lower()
        await context.abort(code, message)

    try:
        if request.model and request.model != model_name:
            await refuse(grpc.StatusCode.NOT_FOUND, f"model: this worker serves {model_name!r}")
        hashes = list(request.block_hashes)
        if len(hashes) > max_blocks:
            await refuse(grpc.StatusCode.INVALID_ARGUMENT,
                         f"block_hashes: at most {max_blocks} blocks a fetch (got {len(hashes)})")
        if any(len(h) != 16 for h in hashes):
            await refuse(grpc.StatusCode.INVALID_ARGUMENT, "block_hashes: each must be 16 bytes")
        fault, fault_at = _fault()
        export: asyncio.Future = _spawn(engine.call(ExportBlocks(tuple(hashes))))
        first = True
        while True:
            got = await export
            if got is None:
                await refuse(grpc.StatusCode.FAILED_PRECONDITION, "this worker cannot export KV blocks "
                             "(tensor parallel, or prefix caching off)")
            layout, data = got
            if first:
                # The count is a promise only for the first export: later ones may have been evicted.
                yield pb.FetchKVBlocksResponse(layout=layout)
                first = False
            per_block, n, start = block_bytes(layout), len(data), sent
            more = n == blocks_within(EXPORT_BYTES, per_block) and start + n < len(hashes)
            if more:        # the engine copies the next window out while this one goes
                export = _spawn(engine.call(ExportBlocks(tuple(hashes[start + n:]))))
            per_pack, pack = blocks_within(PACK_BYTES, per_block), []
            for i in range(n):
                h, kv = hashes[start + i], data[i].numpy().tobytes()
                digest = block_digest(h, kv)
                if start + i == fault_at:
                    if fault == "truncate":
                        break
                    if fault == "die":
                        os._exit(17)
                    if fault == "corrupt":
                        kv = bytes([kv[0] ^ 0xFF]) + kv[1:]
                pack.append(pb.KVBlock(block_hash=h, kv=kv, digest=digest))
                if len(pack) == per_pack or i == n - 1:
                    yield pb.FetchKVBlocksResponse(blocks=pack)
                    sent, nbytes, pack = sent + len(pack), nbytes + len(pack) * per_block, []
            if pack:        # (a truncating fault's blocks before it)
                yield pb.FetchKVBlocksResponse(blocks=pack)
                sent, nbytes = sent + len(pack), nbytes + len(pack) * per_block
            if fault == "truncate" and sent == fault_at or not more:
                break
        failure = ""
    finally:
        tally.add(sent, nbytes, time.monotonic() - t0, failure)


def _spawn(coro) -> asyncio.Future:
    """An engine call run as a task, so that the caller may go on meanwhile; one left behind (the
    call ended) finishes on its own, its outcome dropped."""
    fut = asyncio.ensure_future(coro)
    fut.add_done_callback(lambda f: f.cancelled() or f.exception())
    return fut


def unpack(msg: pb.FetchKVBlocksResponse, want: list[bytes], got: int, per_block: int) -> list[bytes]:
    """The bytes of the blocks one message carries (a pack, or one block in the message's own
    fields), each checked: it must be the next hash of `want` after the `got` already received,
    its size the layout's and its digest right; at most PACK_BYTES of them (one block at least)."""
    blocks = list(msg.blocks) if msg.blocks else [msg] if msg.block_hash else []
    limit = blocks_within(PACK_BYTES, per_block)
    if len(blocks) > limit:
        raise FetchError(f"a message of {len(blocks)} blocks: at most {limit} of {per_block} bytes "
                         f"({PACK_BYTES} bytes) a message", "pack")
    out: list[bytes] = []
    for b in blocks:
        k = got + len(out)
        if k >= len(want) or b.block_hash != want[k]:
            raise FetchError(f"block {k}: not the next hash of the request's chain", "chain")
        if len(b.kv) != per_block or block_digest(b.block_hash, b.kv) != b.digest:
            raise FetchError(f"block {k}: its bytes do not match its digest", "digest")
        out.append(b.kv)
    return out


# ---- receiver side (event loop) -----------------------------------------------------------------

def peer_credentials(tls_cert: Optional[str], tls_key: Optional[str],
                     tls_client_ca: Optional[str]) -> Optional[grpc.ChannelCredentials]:
    """A worker serving TLS (--tls-cert) fetches from its peers over TLS: it verifies them with the
    CA it requires of clients (--tls-client-ca; the system's roots without it) and shows its own
    certificate, for peers that require mTLS. The chart gives every worker one Secret (tls.crt,
    tls.key, ca.crt), so one CA signed them all. None (plaintext) when it serves none."""
    return channel_credentials(tls_client_ca, tls_cert, tls_key) if tls_cert else None


class KVFetcher:
    """Pulls a request's leading blocks from a peer before the request is added to the engine."""

    def __init__(self, model_name: str, api_key: Optional[str] = None, max_blocks: int = 512,
                 timeout_s: float = 10.0, credentials: Optional[grpc.ChannelCredentials] = None):
        """`credentials`: TLS to peers (None: plaintext), peer_credentials() of the worker's flags."""
        self.model_name, self.max_blocks, self.timeout_s = model_name, max_blocks, timeout_s
        self.credentials = credentials
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self.channels: dict[str, grpc.aio.Channel] = {}
        self.fetched = TransferTally()      # as fetcher
        self.served = TransferTally()       # as source (serve_fetch)
        self.rate = TransferRate()          # of completed fetches: published in the lease
        self.block_bytes = 0                # of this worker's pool; 0: it takes no fetches (set at start)

    def _stub(self, address: str) -> pb_grpc.AdminStub:
        ch = self.channels.get(address)
        if ch is None:
            ch = self.channels[address] = (grpc.aio.secure_channel(address, self.credentials)
                                           if self.credentials is not None else grpc.aio.insecure_channel(address))
        return pb_grpc.AdminStub(ch)

    async def fetch(self, engine: EngineClient, token_ids: list[int], hint: pb.KVFetchHint,
                    cache_salt: str, adapter: str) -> int:
        """Blocks fetched and now in the prefix cache (0 on any failure: logged, never raised)."""
        want = min(hint.num_blocks, self.max_blocks)
        if want <= 0 or not hint.source_address:
            return 0
        t0 = time.monotonic()          # the whole call, planning and naming included: what TTFT pays
        try:
            plan = await engine.call(PlanImport(tuple(token_ids), want, cache_salt, adapter))
        except ValueError as e:
            log.warning("kv fetch skipped: %s", e)
            return 0
        if plan is None:
            return 0
        num_ok, failure, last = 0, "cancelled", None
        try:
            num_ok, last = await asyncio.wait_for(self._pull(engine, hint.source_address, plan), self.timeout_s)
            failure = ""
        except Exception as e:      # whatever broke (refused, deadline, bytes): recompute instead
            num_ok, last = getattr(e, "num_ok", 0), getattr(e, "last", None)
            failure = e.reason if isinstance(e, FetchError) else \
                "deadline" if isinstance(e, asyncio.TimeoutError) else "error"
            log.warning("kv fetch from %s: %s; recomputing from block %d", hint.source_address,
                        _describe(e), len(plan.held) + num_ok)
        finally:
            # Queued at once (AsyncLLM.call puts the command before it awaits), so the blocks go
            # back even when this call is cancelled here; after any write still queued (one queue).
            try:
                await asyncio.shield(engine.call(FinishImport(plan, num_ok, last)))
            except Exception as e:      # the last write failed: nothing named, every block freed
                num_ok, failure = 0, "error"
                log.warning("kv fetch from %s: %s; recomputing", hint.source_address, _describe(e))
            seconds, nbytes = time.monotonic() - t0, num_ok * block_bytes(plan.layout)
            self.fetched.add(num_ok, nbytes, seconds, failure)
            if not failure:
                self.rate.observe(nbytes, seconds)
        log.info("kv fetch from %s: %d of %d blocks in %.1f ms", hint.source_address, num_ok,
                 len(plan.missing), 1000 * seconds)
        return num_ok

    async def _pull(self, engine: EngineClient, address: str, plan: ImportPlan) -> tuple[int, Optional[WriteBlocks]]:
        """Verified blocks into plan.blocks, in order: (how many, the last of them not written yet,
        for FinishImport to write); FetchError (with num_ok, the blocks written before it) on
        anything else. A write goes to the engine every WRITE_BYTES, while the next ones arrive."""
        mine = plan.layout
        per_block = block_bytes(mine)
        window = blocks_within(WRITE_BYTES, per_block)
        call = self._stub(address).FetchKVBlocks(
            pb.FetchKVBlocksRequest(model=self.model_name, block_hashes=plan.missing), metadata=self.metadata)
        got, written = 0, 0
        buf: list[bytes] = []
        writing: Optional[tuple[asyncio.Future, int]] = None      # the write in flight, its blocks

        async def settle() -> None:
            nonlocal writing, written
            if writing is not None:
                await writing[0]
                written, writing = written + writing[1], None

        def take() -> WriteBlocks:
            data = torch.frombuffer(bytearray(b"".join(buf)), dtype=torch.uint8).reshape(len(buf), per_block)
            ids = tuple(b.block_id for b in plan.blocks[written:written + len(buf)])
            buf.clear()
            return WriteBlocks(ids, data)

        try:
            first = True
            async for msg in call:
                if first:
                    theirs = pb.KVLayout()
                    theirs.CopyFrom(msg.layout)
                    theirs.num_blocks = 0
                    if theirs != mine:
                        raise FetchError(f"layout differs: theirs {msg.layout}, mine {mine}", "layout")
                    first = False
                    continue
                kvs = unpack(msg, plan.missing, got, per_block)
                buf += kvs
                got += len(kvs)
                if len(buf) >= window:
                    await settle()
                    n = len(buf)
                    writing = (_spawn(engine.call(take())), n)
            await settle()
            num_ok, last = written + len(buf), take() if buf else None
            if got < len(plan.missing):     # what arrived whole and verified is kept
                err = FetchError(f"the source sent {got} of {len(plan.missing)} blocks", "truncated")
                err.num_ok, err.last = num_ok, last        # type: ignore[attr-defined]
                raise err
            return num_ok, last
        except BaseException as e:
            call.cancel()
            if isinstance(e, grpc.RpcError) or isinstance(e, FetchError) and not hasattr(e, "num_ok"):
                # Only blocks written before the failure count (what was in flight or buffered is
                # dropped; FinishImport, queued after it, frees those blocks unnamed).
                err = e if isinstance(e, FetchError) else FetchError(_describe(e), _rpc_reason(e))
                err.num_ok = written          # type: ignore[attr-defined]
                raise err from None
            raise

    async def close(self) -> None:
        for ch in self.channels.values():
            await ch.close()
        self.channels.clear()


def _rpc_reason(e: BaseException) -> str:
    return e.code().name.lower() if isinstance(e, grpc.aio.AioRpcError) else "rpc"


def _describe(e: BaseException) -> str:
    if isinstance(e, grpc.aio.AioRpcError):
        return f"{e.code().name}: {e.details()}"
    if isinstance(e, asyncio.TimeoutError):
        return "deadline passed"
    return str(e)
