"""KVCacheManager: prefix hits, slot allocation that fails cleanly, tail-first freeing."""
from pagoda.gpu_worker.core.kv_cache_manager import KVCacheManager
from pagoda.gpu_worker.core.request import Request
from pagoda.gpu_worker.core.sampling_params import SamplingParams
from pagoda.protos.block_hash import block_hashes, namespace_root

BS = 4
ROOT = namespace_root("m")


def req(rid, tokens, root=ROOT):
    return Request(rid, tokens, SamplingParams(), BS, root)


def ids(blocks):
    return [b.block_id for b in blocks]


def free_ids(m):
    return [b.block_id for b in m.pool.free_queue]


def test_allocate_names_full_blocks_with_chained_hashes():
    m = KVCacheManager(num_blocks=10, block_size=BS)
    r = req("a", list(range(10)))
    assert m.get_computed_blocks(r) == ([], 0)
    blocks = m.allocate_slots(r, 10)
    assert ids(blocks) == [0, 1, 2]
    want = block_hashes(list(range(10)), BS, ROOT)
    assert len(want) == 2
    assert [b.block_hash for b in blocks] == want + [None]
    assert m.pool.take_events() == [("stored", want[0]), ("stored", want[1])]


def test_prefix_hit_shares_blocks_and_leaves_last_token_to_compute():
    m = KVCacheManager(num_blocks=10, block_size=BS)
    a = req("a", list(range(10)))
    m.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    b = req("b", list(range(8)) + [99, 98, 97])
    hits, n = m.get_computed_blocks(b)
    assert ids(hits) == [0, 1] and n == 8
    blocks = m.allocate_slots(b, b.num_tokens - n, hits)
    assert ids(blocks) == [0, 1, 3]
    assert [x.ref_cnt for x in m.pool.blocks[:4]] == [2, 2, 1, 1]
    # Exactly two full blocks of prompt: only one may hit, the last token is recomputed.
    c = req("c", list(range(8)))
    hits, n = m.get_computed_blocks(c)
    assert ids(hits) == [0] and n == 4


def test_other_namespace_never_hits():
    m = KVCacheManager(num_blocks=10, block_size=BS)
    a = req("a", list(range(9)))
    m.allocate_slots(a, 9)
    b = req("b", list(range(9)), root=namespace_root("m", cache_salt="tenant-2"))
    assert m.get_computed_blocks(b) == ([], 0)


def test_failed_allocation_changes_nothing():
    m = KVCacheManager(num_blocks=4, block_size=BS)
    a = req("a", list(range(12)))
    assert ids(m.allocate_slots(a, 12)) == [0, 1, 2]
    b = req("b", list(range(100, 109)))
    before = free_ids(m)
    assert m.allocate_slots(b, 9) is None
    assert free_ids(m) == before and "b" not in m.req_to_blocks
    # Idle cache hits are not free for new blocks once taken: 1 free block, a hit on
    # idle block 0 plus 1 new block fits; plus 2 new does not.
    m.free(a)
    assert free_ids(m) == [3, 2, 1, 0]
    c = req("c", list(range(4)) + [50] * 8)
    hits, n = m.get_computed_blocks(c)
    assert ids(hits) == [0] and n == 4
    blocks = m.allocate_slots(c, 8, hits)
    assert ids(blocks) == [0, 3, 2]
    assert free_ids(m) == [1]
    d = req("d", list(range(4)) + [60] * 8)
    hits, n = m.get_computed_blocks(d)
    assert ids(hits) == [0]
    assert m.allocate_slots(d, 8, hits) is None
    assert m.pool.blocks[0].ref_cnt == 1 and free_ids(m) == [1]


def test_decode_grows_one_block_at_a_boundary_and_caches_it():
    m = KVCacheManager(num_blocks=6, block_size=BS)
    r = req("a", [1, 2, 3])
    assert ids(m.allocate_slots(r, 3)) == [0]
    r.num_computed_tokens = 3
    r.append_output_token(4)                # fills block 0 once computed
    assert ids(m.allocate_slots(r, 1)) == [0]
    assert m.pool.blocks[0].block_hash == block_hashes([1, 2, 3, 4], BS, ROOT)[0]
    r.num_computed_tokens = 4
    r.append_output_token(5)
    assert ids(m.allocate_slots(r, 1)) == [0, 1]
    assert m.pool.blocks[1].block_hash is None


def test_free_is_tail_first_and_keeps_hashes():
    m = KVCacheManager(num_blocks=5, block_size=BS)
    r = req("a", list(range(12)))
    m.allocate_slots(r, 12)
    m.free(r)
    assert free_ids(m) == [3, 4, 2, 1, 0]
    assert all(b.ref_cnt == 0 for b in m.pool.blocks)
    assert len(m.pool.cached_hashes()) == 3
    assert m.req_to_blocks == {} and m.num_cached_blocks == {}


def test_caching_disabled():
    m = KVCacheManager(num_blocks=5, block_size=BS, enable_caching=False)
    a = req("a", list(range(9)))
    m.allocate_slots(a, 9)
    b = req("b", list(range(9)))
    assert m.get_computed_blocks(b) == ([], 0)
    assert m.pool.take_events() == []


def test_idle_cache_hits_count_against_free_blocks():
    # Two free blocks, one of them an idle hit: a request that takes the hit and needs two
    # new blocks must be refused cleanly (the hit leaves the free list when taken).
    m = KVCacheManager(num_blocks=3, block_size=BS)
    a = req("a", list(range(4)))
    m.allocate_slots(a, 4)
    m.free(a)
    holder = req("holder", [70, 71, 72])
    m.allocate_slots(holder, 3)
    assert free_ids(m) == [2, 0]
    b = req("b", list(range(4)) + [80] * 5)
    hits, n = m.get_computed_blocks(b)
    assert ids(hits) == [0] and n == 4
    before = free_ids(m)
    assert m.allocate_slots(b, 5, hits) is None
    assert free_ids(m) == before and m.pool.blocks[0].ref_cnt == 0 and "b" not in m.req_to_blocks
    # One new block fewer fits: the hit plus one new block.
    c = req("c", list(range(4)) + [90] * 3)
    hits, _ = m.get_computed_blocks(c)
    assert ids(m.allocate_slots(c, 3, hits)) == [0, 2] and free_ids(m) == []
