"""BlockPool: exact block ids, ref counts, free-list order and cache events on a tiny pool."""
import pytest

from pagoda.gpu_worker.core.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock


def free_ids(pool):
    return [b.block_id for b in pool.free_queue]


def h(i):
    return bytes([i]) * 16


def test_free_queue_popleft_append_remove_from_middle():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert [b.block_id for b in q] == [0, 1, 2, 3, 4] and len(q) == 5
    q.remove(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4] and len(q) == 4
    assert q.popleft() is blocks[0]
    q.append(blocks[2])
    q.append(blocks[0])
    assert [b.block_id for b in q] == [1, 3, 4, 2, 0]
    for b in list(q):
        q.remove(b)
    assert len(q) == 0 and list(q) == []
    with pytest.raises(ValueError):
        q.popleft()


def test_allocate_then_free_tail_first_sets_lru_order():
    pool = BlockPool(6)
    a = pool.get_new_blocks(3)
    assert [b.block_id for b in a] == [0, 1, 2]
    assert [b.ref_cnt for b in a] == [1, 1, 1]
    assert free_ids(pool) == [3, 4, 5] and pool.num_free_blocks() == 3
    pool.cache_full_blocks(a, [h(1), h(2), h(3)], 0, 3)
    pool.free_blocks(reversed(a))
    # Freed tail first: the chain's tail is the first of its blocks to be evicted.
    assert free_ids(pool) == [3, 4, 5, 2, 1, 0]
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert pool.num_free_blocks() == 6


def test_freed_blocks_without_hash_go_to_the_head():
    pool = BlockPool(6)
    a = pool.get_new_blocks(4)
    pool.cache_full_blocks(a, [h(1), h(2)], 0, 2)      # blocks 2 and 3 are partial or unnamed
    pool.free_blocks(reversed(a))
    # Useless blocks are handed out first (in the order freed); cached ones wait at the tail.
    assert free_ids(pool) == [3, 2, 4, 5, 1, 0]
    assert [b.block_id for b in pool.get_new_blocks(2)] == [3, 2]
    assert pool.get_cached_block(h(1)) is a[0] and pool.take_events() == [("stored", h(1)), ("stored", h(2))]


def test_cache_hit_revives_block_from_middle_of_free_list():
    pool = BlockPool(6)
    a = pool.get_new_blocks(3)
    pool.cache_full_blocks(a, [h(1), h(2)], 0, 2)     # the third block is partial
    assert pool.take_events() == [("stored", h(1)), ("stored", h(2))]
    assert a[2].block_hash is None
    pool.free_blocks(reversed(a))
    assert free_ids(pool) == [2, 3, 4, 5, 1, 0]
    # Lazily evicted: still findable after being freed.
    hit = pool.get_cached_block(h(2))
    assert hit is a[1] and hit.ref_cnt == 0
    pool.touch([pool.get_cached_block(h(1)), hit])
    assert (a[0].ref_cnt, a[1].ref_cnt) == (1, 1)
    assert free_ids(pool) == [2, 3, 4, 5]
    pool.touch([a[0]])                                 # a second sharer
    assert a[0].ref_cnt == 2 and free_ids(pool) == [2, 3, 4, 5]
    pool.free_blocks([a[1], a[0]])
    assert (a[0].ref_cnt, a[1].ref_cnt) == (1, 0)
    assert free_ids(pool) == [2, 3, 4, 5, 1]
    assert pool.take_events() == []


def test_eviction_in_lru_order_emits_removed_and_drops_hash():
    pool = BlockPool(4)
    a = pool.get_new_blocks(2)
    pool.cache_full_blocks(a, [h(1), h(2)], 0, 2)
    pool.free_blocks(reversed(a))
    assert free_ids(pool) == [2, 3, 1, 0]
    pool.take_events()
    got = pool.get_new_blocks(3)
    assert [b.block_id for b in got] == [2, 3, 1]
    # Block 1 held h(2), the chain's tail: evicted before its parent block 0.
    assert pool.take_events() == [("removed", h(2))]
    assert got[2].block_hash is None and got[2].ref_cnt == 1
    assert pool.get_cached_block(h(2)) is None
    assert pool.get_cached_block(h(1)) is a[0]
    assert sorted(pool.cached_hashes()) == [h(1)]
    assert free_ids(pool) == [0]
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)
    assert free_ids(pool) == [0]                       # a failed allocation takes nothing


def test_duplicate_hash_keeps_first_block_and_frees_duplicate_plain():
    pool = BlockPool(4)
    a = pool.get_new_blocks(1)
    b = pool.get_new_blocks(1)
    pool.cache_full_blocks(a, [h(7)], 0, 1)
    pool.cache_full_blocks(b, [h(7)], 0, 1)
    assert pool.take_events() == [("stored", h(7))]
    assert pool.get_cached_block(h(7)) is a[0]
    pool.free_blocks(b)
    assert b[0].block_hash is None
    pool.free_blocks(a)
    assert pool.get_cached_block(h(7)) is a[0]
    # The plain duplicate goes first, and handing it out evicts nothing.
    assert [x.block_id for x in pool.get_new_blocks(3)] == [1, 2, 3]
    assert pool.take_events() == []


def test_caching_disabled_names_nothing():
    pool = BlockPool(3, enable_caching=False)
    a = pool.get_new_blocks(2)
    pool.cache_full_blocks(a, [h(1), h(2)], 0, 2)
    assert pool.take_events() == [] and pool.cached_hashes() == []
    assert a[0].block_hash is None


def test_pool_needs_a_block():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)


def test_reset_prefix_cache_refused_while_blocks_are_in_use():
    pool = BlockPool(4)
    a = pool.get_new_blocks(2)
    pool.cache_full_blocks(a, [h(1), h(2)], 0, 2)
    pool.take_events()
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(h(1)) is a[0] and pool.take_events() == []
    pool.free_blocks(reversed(a))
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(h(1)) is None and a[0].block_hash is None
    assert sorted(pool.take_events()) == [("removed", h(1)), ("removed", h(2))]
