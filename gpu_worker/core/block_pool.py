"""The pool of fixed-size KV-cache blocks: ref counts, the LRU free list and the prefix cache.

A block whose ref count drops to 0 joins the tail of the free list but keeps its hash, so
a later request with the same prefix can take it back (lazy eviction). A freed block without
a hash can never be found again, so it joins the head instead: useless blocks are handed out
before cached ones. Only when the block
is handed out as a new block is its hash dropped: that is the "removed" event. The free
list is an intrusive doubly linked list so that reviving a cached block from the middle
of it is O(1).

With a host tier (gpu_worker/core/host_tier.py), a cached block handed out again is first queued
for a copy to a host slot that keeps its hash; `copies` collects those (and the manager's
reloads) in order until the scheduler hands them to the runner with the step.
"""
from __future__ import annotations

from typing import Iterable, Iterator, Optional

from pagoda.gpu_worker.core.host_tier import HostBlockPool, KVCopy


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: Optional[bytes] = None
        self.prev_free: Optional[KVCacheBlock] = None
        self.next_free: Optional[KVCacheBlock] = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """Free blocks in eviction order: the head is evicted first."""

    def __init__(self, blocks: Iterable[KVCacheBlock]):
        # Sentinels spare every operation the empty-list and end-of-list cases.
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def __len__(self) -> int:
        return self.num_free

    # Every block in the list, sentinels aside, has both links set: the asserts narrow types.
    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if self.num_free == 0 or block is None:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, block
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free += 1

    def appendleft(self, block: KVCacheBlock) -> None:
        first = self._head.next_free
        assert first is not None
        self._head.next_free, block.prev_free = block, self._head
        block.next_free, first.prev_free = first, block
        self.num_free += 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        b = self._head.next_free
        while b is not None and b is not self._tail:
            yield b
            b = b.next_free


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True, host: Optional[HostBlockPool] = None):
        if num_blocks < 1:
            raise ValueError(f"num_blocks: the KV pool needs at least one block (got {num_blocks})")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVCacheBlock] = {}
        self.events: list[tuple[str, bytes]] = []
        self.host = host if enable_caching else None
        self.copies: list[KVCopy] = []

    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now: free, including cached ones with no owner."""
        return len(self.free_queue)

    def get_cached_block(self, block_hash: bytes) -> Optional[KVCacheBlock]:
        return self.cached.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cache hits, pulling idle ones out of the free list."""
        for b in blocks:
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
            b.ref_cnt += 1

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks():
            raise ValueError(f"cannot allocate {n} blocks, {self.num_free_blocks()} free")
        out = []
        for _ in range(n):
            b = self.free_queue.popleft()
            self._evict(b)
            b.ref_cnt = 1
            out.append(b)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
                self.events.append(("removed", block.block_hash))
                if self.host is not None:
                    slot = self.host.store(block.block_hash)
                    if slot is not None:
                        self.copies.append(KVCopy(True, block.block_id, slot))
            block.block_hash = None

    def cache_full_blocks(self, blocks: list[KVCacheBlock], hashes: list[bytes],
                          start: int, end: int) -> None:
        """Name blocks[start:end] by their chained hashes now that their tokens are final."""
        if not self.enable_caching:
            return
        for b, h in zip(blocks[start:end], hashes[start:end]):
            if b.block_hash is not None:
                continue
            b.block_hash = h
            # Two requests can compute the same block in one step; the first one is kept
            # in the cache and the duplicate simply goes back as a plain block when freed.
            if h not in self.cached:
                self.cached[h] = b
                self.events.append(("stored", h))

    def free_blocks(self, ordered: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each. Idle cached blocks join the LRU tail in the order
        given; idle blocks without a hash go to the head, keeping that order among them."""
        plain = []
        for b in ordered:
            b.ref_cnt -= 1
            assert b.ref_cnt >= 0, b
            if b.ref_cnt == 0:
                if b.block_hash is not None and self.cached.get(b.block_hash) is not b:
                    b.block_hash = None    # a duplicate: nothing can ever find it
                if b.block_hash is None:
                    plain.append(b)
                else:
                    self.free_queue.append(b)
        for b in reversed(plain):
            self.free_queue.appendleft(b)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (False, nothing changed) while any block is in
        use: a running request's blocks must keep the names its later steps rely on."""
        if self.num_free_blocks() != self.num_blocks:
            return False
        for h, b in self.cached.items():
            b.block_hash = None
            self.events.append(("removed", h))
        self.cached.clear()
        if self.host is not None:
            self.host.reset()
        return True

    def take_events(self) -> list[tuple[str, bytes]]:
        events, self.events = self.events, []
        return events

    def take_tier_copies(self) -> list[KVCopy]:
        copies, self.copies = self.copies, []
        return copies

    def cached_hashes(self) -> list[bytes]:
        return list(self.cached)
