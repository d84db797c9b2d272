"""The request-facing side of the block pool: prefix-cache lookups, slot allocation, freeing,
and the copy-on-write of blocks that forked sequences (beam search) share.

With a host tier, a lookup walks the chain through both tiers: a block found only on the host
(HostHit) counts as cached, and allocation gives it a new device block and queues its copy back
(KVCopy), so the step's forward finds it in place. Swap preemption copies a request's computed
blocks to host slots of its own and back when it resumes.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

from pagoda.gpu_worker.core.block_pool import BlockPool, KVCacheBlock
from pagoda.gpu_worker.core.host_tier import HostBlockPool, HostHit, KVCopy
from pagoda.gpu_worker.core.request import Request

CachedBlock = Union[KVCacheBlock, HostHit]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 num_host_blocks: int = 0):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.host = HostBlockPool(num_host_blocks) if num_host_blocks else None
        self.pool = BlockPool(num_blocks, enable_caching, self.host)
        # Swapped-out requests: tokens whose KV their host slots hold.
        self.swapped_tokens: dict[str, int] = {}
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are already named in the cache.
        self.num_cached_blocks: dict[str, int] = {}
        # Block copies (src, dst) the next step must do before its forward: copy-on-write.
        self.pending_copies: list[tuple[int, int]] = []
        self.num_copies = 0           # blocks copied so far (tests and bench/beam.py read it)
        self.share_on_fork = True     # False: a fork copies every block (bench/beam.py's baseline)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def get_computed_blocks(self, request: Request) -> tuple[list[CachedBlock], int]:
        """Longest cached chain of the request's full blocks, and the tokens it covers; each
        block on the device, or else in the host tier (a HostHit).

        At most num_tokens - 1 tokens: the last token is always computed so that the step
        yields logits to sample from.
        """
        if not self.enable_caching or request.prompt_logprobs_pending():
            return [], 0
        limit = (request.num_tokens - 1) // self.block_size
        hits: list[CachedBlock] = []
        host = self.host
        for h in request.block_hashes[:limit]:
            b = self.pool.get_cached_block(h)
            if b is not None:
                hits.append(b)
                continue
            slot = host.lookup(h) if host is not None else None
            if slot is None:
                break
            hits.append(HostHit(h, slot))
        return hits, len(hits) * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[CachedBlock] = ()) -> Optional[list[KVCacheBlock]]:
        """Make room for num_new_tokens more tokens; None (and no change) if blocks run out.
        Host hits among new_computed_blocks take a new device block each, their copy back queued."""
        if num_new_tokens < 1:
            raise ValueError("num_new_tokens must be at least 1")
        total = request.num_computed_tokens + num_new_tokens
        held = self.req_to_blocks.get(request.req_id)
        if held and len(held) * self.block_size > request.num_computed_tokens and \
                held[request.num_computed_tokens // self.block_size].ref_cnt > 1 and \
                not self._copy_on_write(held, request.num_computed_tokens // self.block_size, total):
            return None
        if held and not new_computed_blocks and total <= len(held) * self.block_size and \
                (not self.enable_caching or total // self.block_size <= self.num_cached_blocks.get(request.req_id, 0)):
            return held     # the common decode step: room left, no block filled up to name
        blocks = self.req_to_blocks.setdefault(request.req_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_needed = cdiv(num_computed + num_new_tokens, self.block_size) - len(blocks) - len(new_computed_blocks)
        device_hits = [b for b in new_computed_blocks if isinstance(b, KVCacheBlock)]
        num_reloads = len(new_computed_blocks) - len(device_hits)
        # Cache hits that sit idle in the free list stop being free once taken.
        idle_hits = sum(1 for b in device_hits if b.ref_cnt == 0)
        if num_needed + num_reloads > self.pool.num_free_blocks() - idle_hits:
            if not blocks:
                del self.req_to_blocks[request.req_id]
            return None
        self.pool.touch(device_hits)
        if num_reloads:
            self._reload(blocks, new_computed_blocks)
        else:
            blocks.extend(device_hits)
        if num_needed > 0:
            blocks.extend(self.pool.get_new_blocks(num_needed))
        self._cache_blocks(request, blocks, num_computed + num_new_tokens)
        return blocks

    def _copy_on_write(self, blocks: list[KVCacheBlock], i: int, total: int) -> bool:
        """blocks[i] is about to be written but is shared with a forked sibling: give this
        sequence its own copy (False, nothing changed, when no block is free for the copy and
        the slots still to come)."""
        more = max(0, cdiv(total, self.block_size) - len(blocks))
        if self.pool.num_free_blocks() < 1 + more:
            return False
        old = blocks[i]
        new = self.pool.get_new_blocks(1)[0]
        self.pending_copies.append((old.block_id, new.block_id))
        blocks[i] = new
        self.pool.free_blocks([old])     # still held by the sibling: only its count drops
        return True

    def fork(self, parent: Request, child: Request) -> int:
        """The child takes the parent's blocks: shared by reference count (or, without
        share_on_fork, copied whole). Returns the tokens whose KV the child now has (the
        parent's computed ones); 0 when the parent holds no blocks."""
        blocks = self.req_to_blocks.get(parent.req_id)
        if not blocks:
            return 0
        if self.share_on_fork:
            self.pool.touch(blocks)
            mine = list(blocks)
        else:
            if self.pool.num_free_blocks() < len(blocks):
                return 0
            mine = self.pool.get_new_blocks(len(blocks))
            self.pending_copies.extend((a.block_id, b.block_id) for a, b in zip(blocks, mine))
        self.req_to_blocks[child.req_id] = mine
        if not self.share_on_fork:
            self.num_cached_blocks[child.req_id] = 0
            self._cache_blocks(child, mine, parent.num_computed_tokens)
        else:
            self.num_cached_blocks[child.req_id] = self.num_cached_blocks.get(parent.req_id, 0)
        return parent.num_computed_tokens

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        self.num_copies += len(copies)
        return copies

    def _reload(self, blocks: list[KVCacheBlock], hits: Sequence[CachedBlock]) -> None:
        """Append the hits to blocks in chain order, host ones on new device blocks. Their slots
        are pinned meanwhile: a new block may evict a cached one, whose copy out must not take a
        slot that is still to be read. The new blocks are named by _cache_blocks like any other."""
        host, pool = self.host, self.pool
        assert host is not None
        slots = {b.host_block for b in hits if isinstance(b, HostHit)}
        host.pinned |= slots
        try:
            for b in hits:
                if isinstance(b, KVCacheBlock):
                    blocks.append(b)
                    continue
                (new,) = pool.get_new_blocks(1)
                pool.copies.append(KVCopy(False, new.block_id, b.host_block))
                host.touch(b.block_hash)
                blocks.append(new)
        finally:
            host.pinned -= slots

    def _cache_blocks(self, request: Request, blocks: list[KVCacheBlock], num_tokens: int) -> None:
        if not self.enable_caching:
            return
        # Every token up to num_tokens is known (prompt, or sampled), so full blocks can be
        # named now; their KV is written by this step's forward before anyone reads it.
        start = self.num_cached_blocks.get(request.req_id, 0)
        end = min(num_tokens // self.block_size, len(request.block_hashes))
        if end > start:
            self.pool.cache_full_blocks(blocks, request.block_hashes, start, end)
            self.num_cached_blocks[request.req_id] = end

    def truncate(self, request: Request, num_tokens: int) -> int:
        """Keep only the blocks that hold the first num_tokens tokens' KV, freeing the rest tail
        first (speculative decoding: slots of rejected drafts). Returns the blocks kept. The
        freed blocks were never named: a block is named only when all its tokens are known."""
        blocks = self.req_to_blocks.get(request.req_id)
        keep = cdiv(num_tokens, self.block_size)
        if not blocks or len(blocks) <= keep:
            return len(blocks or ())
        tail = blocks[keep:]
        del blocks[keep:]
        assert all(b.block_hash is None for b in tail), tail
        self.pool.free_blocks(reversed(tail))
        return keep

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first so the LRU evicts a chain's tail first (and
        its host slots, if it was swapped out)."""
        blocks = self.req_to_blocks.pop(request.req_id, [])
        self.num_cached_blocks.pop(request.req_id, None)
        self.pool.free_blocks(reversed(blocks))
        if self.swapped_tokens.pop(request.req_id, None) is not None:
            assert self.host is not None
            self.host.release_swapped(request.req_id)

    # ---- swap preemption ------------------------------------------------------------------

    def swap_out(self, request: Request) -> bool:
        """Copy the request's computed blocks to host slots of its own and free its device
        blocks; False (nothing changed) when the host tier cannot take them all, or there is
        nothing to keep: the caller recomputes instead."""
        blocks = self.req_to_blocks.get(request.req_id)
        keep = cdiv(request.num_computed_tokens, self.block_size)
        if self.host is None or not blocks or keep == 0 or keep > len(blocks):
            return False
        slots = self.host.swap_out(request.req_id, keep)
        if slots is None:
            return False
        self.pool.copies.extend(KVCopy(True, b.block_id, s) for b, s in zip(blocks, slots))
        tokens = request.num_computed_tokens
        self.free(request)          # not swapped yet, so this leaves the new slots alone
        self.swapped_tokens[request.req_id] = tokens
        return True

    def is_swapped(self, request: Request) -> bool:
        return request.req_id in self.swapped_tokens

    def swap_in(self, request: Request, num_new_tokens: int) -> Optional[list[KVCacheBlock]]:
        """Device blocks for a swapped-out request's KV (copies back queued) plus room for
        num_new_tokens more, or None and nothing changed. request.num_computed_tokens must be
        what it was at swap_out. Leading full blocks the device prefix cache still holds are
        taken from there, as a prefix hit: only the rest is copied (swap is never dearer than
        recompute for what the cache kept)."""
        host, pool = self.host, self.pool
        assert host is not None and self.swapped_tokens.get(request.req_id) == request.num_computed_tokens
        slots = host.swapped[request.req_id]
        kept: list[KVCacheBlock] = []
        if self.enable_caching:
            for h in request.block_hashes[:request.num_computed_tokens // self.block_size]:
                b = pool.get_cached_block(h)
                if b is None:
                    break
                kept.append(b)
        total = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        if total - len(kept) > pool.num_free_blocks() - sum(1 for b in kept if b.ref_cnt == 0):
            return None
        pool.touch(kept)
        new = pool.get_new_blocks(len(slots) - len(kept))
        pool.copies.extend(KVCopy(False, b.block_id, s) for b, s in zip(new, slots[len(kept):]))
        del self.swapped_tokens[request.req_id]
        host.release_swapped(request.req_id)
        self.req_to_blocks[request.req_id] = kept + new
        self.num_cached_blocks[request.req_id] = len(kept)
        got = self.allocate_slots(request, num_new_tokens)
        assert got is not None
        return got

    def take_tier_copies(self) -> list[KVCopy]:
        return self.pool.take_tier_copies()

    def block_ids(self, request: Request) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request.req_id, [])]
