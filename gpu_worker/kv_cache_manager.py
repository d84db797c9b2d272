"""The request-facing side of the block pool: prefix-cache lookups, slot allocation, freeing,
and the copy-on-write of blocks that forked sequences (beam search) share."""
from __future__ import annotations

from typing import Optional, Sequence

from gpu_worker.block_pool import BlockPool, KVCacheBlock
from gpu_worker.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
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

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached chain of the request's full blocks, and the tokens it covers.

        At most num_tokens - 1 tokens: the last token is always computed so that the step
        yields logits to sample from.
        """
        if not self.enable_caching or request.prompt_logprobs_pending():
            return [], 0
        limit = (request.num_tokens - 1) // self.block_size
        hits = []
        for h in request.block_hashes[:limit]:
            b = self.pool.get_cached_block(h)
            if b is None:
                break
            hits.append(b)
        return hits, len(hits) * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[KVCacheBlock] = ()) -> Optional[list[KVCacheBlock]]:
        """Make room for num_new_tokens more tokens; None (and no change) if blocks run out."""
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
        # Cache hits that sit idle in the free list stop being free once taken.
        idle_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_needed > self.pool.num_free_blocks() - idle_hits:
            if not blocks:
                del self.req_to_blocks[request.req_id]
            return None
        self.pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
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
        """Release the request's blocks, tail first so the LRU evicts a chain's tail first."""
        blocks = self.req_to_blocks.pop(request.req_id, [])
        self.num_cached_blocks.pop(request.req_id, None)
        self.pool.free_blocks(reversed(blocks))

    def block_ids(self, request: Request) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request.req_id, [])]
