"""KV that moves: one worker serves a run of its cached blocks by hash, another pulls them into its
own pool and names them in its prefix cache as if it had computed them (DESIGN.md, round four).

Transport: Admin.FetchKVBlocks, a gRPC server-streaming call on the worker's own server, one
block per message (K then V of every layer, raw, in the pool's dtype). What was tried first
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
free) is a typed command below, run on the engine thread through AsyncLLM.call.
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
EXPORT_WINDOW = 32          # blocks copied out per engine turn: bounds the source's staging memory
WRITE_WINDOW = 32           # blocks written in per engine command on the receiver
# Test hook (source side): "corrupt:N", "truncate:N" or "die:N" spoils the stream at block N.
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
    """Source: the leading blocks of `hashes` its device cache holds, copied out (so the engine
    may evict or overwrite them the moment this returns), as uint8 [n, bytes per block]."""
    hashes: tuple[bytes, ...]

    def __call__(self, engine: LLMEngine) -> tuple[int, torch.Tensor]:
        pool = engine.kv.pool
        ids = []
        for h in self.hashes:
            b = pool.get_cached_block(h)
            if b is None:
                break
            ids.append(b.block_id)
        if not ids:
            return 0, torch.empty(0, 0, dtype=torch.uint8)
        d = torch.tensor(ids, dtype=torch.int64, device=engine.runner.device)
        staging = torch.stack([t.index_select(0, d) for t in _stores(engine)], dim=1).cpu().contiguous()
        return len(ids), staging.view(torch.uint8).reshape(len(ids), -1)


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
        stores = _stores(engine)
        r = engine.runner
        shape = (len(self.block_ids), len(stores), r.num_kv_heads, engine.block_size, r.head_dim)
        staging = self.data.view(stores[0].dtype).reshape(shape).to(r.device)
        d = torch.tensor(self.block_ids, dtype=torch.int64, device=r.device)
        for j, t in enumerate(stores):
            t.index_copy_(0, d, staging[:, j])


@dataclass(frozen=True)
class FinishImport:
    """Receiver: name the first `num_ok` quarantined blocks by their hashes (written whole and
    verified, in chain order), then let every block of the plan go: the named ones stay in the
    prefix cache (LRU, tail first), the others return unnamed."""
    plan: ImportPlan
    num_ok: int

    def __call__(self, engine: LLMEngine) -> None:
        pool, p = engine.kv.pool, self.plan
        if self.num_ok:
            pool.cache_full_blocks(p.blocks, p.missing, 0, self.num_ok)
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
        if not await engine.call(_transferable):
            await refuse(grpc.StatusCode.FAILED_PRECONDITION, "this worker cannot export KV blocks "
                         "(tensor parallel, or prefix caching off)")
        fault, fault_at = _fault()
        first = True
        while sent < len(hashes):
            n, data = await engine.call(ExportBlocks(tuple(hashes[sent:sent + EXPORT_WINDOW])))
            if first:
                # The count is a promise only for the first window: later ones may have been evicted.
                yield pb.FetchKVBlocksResponse(layout=await engine.call(lambda e: layout_of(e, n)))
                first = False
            for i in range(n):
                h, kv = hashes[sent], data[i].numpy().tobytes()
                digest = block_digest(h, kv)
                if sent == fault_at:
                    if fault == "truncate":
                        failure = ""
                        return
                    if fault == "die":
                        os._exit(17)
                    if fault == "corrupt":
                        kv = bytes([kv[0] ^ 0xFF]) + kv[1:]
                yield pb.FetchKVBlocksResponse(block_hash=h, kv=kv, digest=digest)
                sent, nbytes = sent + 1, nbytes + len(kv)
            if n < min(EXPORT_WINDOW, len(hashes) - (sent - n)):
                break                                   # the chain ends here on this worker
        failure = ""
    finally:
        tally.add(sent, nbytes, time.monotonic() - t0, failure)


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
        num_ok, failure = 0, "cancelled"
        try:
            num_ok = await asyncio.wait_for(self._pull(engine, hint.source_address, plan), self.timeout_s)
            failure = ""
        except Exception as e:      # whatever broke (refused, deadline, bytes): recompute instead
            num_ok = getattr(e, "num_ok", 0)
            failure = e.reason if isinstance(e, FetchError) else \
                "deadline" if isinstance(e, asyncio.TimeoutError) else "error"
            log.warning("kv fetch from %s: %s; recomputing from block %d", hint.source_address,
                        _describe(e), len(plan.held) + num_ok)
        finally:
            # Queued at once (AsyncLLM.call puts the command before it awaits), so the blocks go
            # back even when this call is cancelled here.
            await asyncio.shield(engine.call(FinishImport(plan, num_ok)))
            seconds, nbytes = time.monotonic() - t0, num_ok * block_bytes(plan.layout)
            self.fetched.add(num_ok, nbytes, seconds, failure)
            if not failure:
                self.rate.observe(nbytes, seconds)
        log.info("kv fetch from %s: %d of %d blocks in %.1f ms", hint.source_address, num_ok,
                 len(plan.missing), 1000 * seconds)
        return num_ok

    async def _pull(self, engine: EngineClient, address: str, plan: ImportPlan) -> int:
        """Verified blocks written into plan.blocks, in order; FetchError (with num_ok, the blocks
        written before it) on anything else."""
        mine = plan.layout
        per_block = block_bytes(mine)
        call = self._stub(address).FetchKVBlocks(
            pb.FetchKVBlocksRequest(model=self.model_name, block_hashes=plan.missing), metadata=self.metadata)
        got, written = 0, 0
        buf: list[bytes] = []

        async def flush() -> None:
            nonlocal written
            data = torch.frombuffer(bytearray(b"".join(buf)), dtype=torch.uint8).reshape(len(buf), per_block)
            ids = tuple(b.block_id for b in plan.blocks[written:written + len(buf)])
            await engine.call(WriteBlocks(ids, data))
            written += len(buf)
            buf.clear()

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
                if got >= len(plan.missing) or msg.block_hash != plan.missing[got]:
                    raise FetchError(f"block {got}: not the next hash of the request's chain", "chain")
                if len(msg.kv) != per_block or block_digest(msg.block_hash, msg.kv) != msg.digest:
                    raise FetchError(f"block {got}: its bytes do not match its digest", "digest")
                buf.append(msg.kv)
                got += 1
                if len(buf) == WRITE_WINDOW:
                    await flush()
            if buf:
                await flush()
            if got < len(plan.missing):
                raise FetchError(f"the source sent {got} of {len(plan.missing)} blocks", "truncated")
            return written
        except BaseException as e:
            call.cancel()
            if isinstance(e, (FetchError, grpc.RpcError)):
                # Only blocks written before the failure count (a partial window is dropped).
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
