"""Host KV tier bookkeeping on a tiny pool: offload on eviction, host hits and their reload, the
host LRU, pinning, abort mid-reload, swap preemption (exact block ids, ref counts, free lists)."""
import pytest

from pagoda.gpu_worker.core.host_tier import HostBlockPool, HostHit, KVCopy
from pagoda.gpu_worker.core.kv_cache_manager import KVCacheManager
from pagoda.gpu_worker.core.outputs import ModelRunnerOutput
from pagoda.gpu_worker.core.request import Request, RequestStatus
from pagoda.gpu_worker.core.sampling_params import SamplingParams
from pagoda.gpu_worker.core.scheduler import Scheduler
from pagoda.gpu_worker.runner.model_runner import _runs
from pagoda.protos.block_hash import block_hashes, namespace_root

BS = 4
ROOT = namespace_root("m")
A = list(range(9))                 # two full blocks and one token
B = list(range(100, 113))          # three full blocks and one token
HA, HB = block_hashes(A, BS, ROOT), block_hashes(B, BS, ROOT)


def req(rid, tokens):
    return Request(rid, tokens, SamplingParams(), BS, ROOT)


def ids(blocks):
    return [b.block_id for b in blocks]


def free_ids(m):
    return [b.block_id for b in m.pool.free_queue]


def run(m, r, tokens=None):
    """Admit r as the scheduler does (prefix lookup, then allocation) and mark it computed."""
    hits, n = m.get_computed_blocks(r)
    blocks = m.allocate_slots(r, r.num_tokens - n, hits)
    assert blocks is not None
    r.num_computed_tokens = r.num_tokens
    return hits, n, blocks


def fill_host_with_a():
    """A runs and ends; B then takes the whole device pool, evicting A's two cached blocks to
    the host tier."""
    m = KVCacheManager(num_blocks=4, block_size=BS, num_host_blocks=3)
    a = req("a", A)
    assert ids(run(m, a)[2]) == [0, 1, 2]
    m.free(a)
    assert free_ids(m) == [2, 3, 1, 0] and m.take_tier_copies() == []
    b = req("b", B)
    assert ids(run(m, b)[2]) == [2, 3, 1, 0]
    return m, b


def test_evicted_cached_blocks_are_copied_to_the_host_keeping_their_hash():
    m, b = fill_host_with_a()
    # Blocks 2 and 3 held no hash (A's partial block, an unused one): nothing to keep.
    assert m.take_tier_copies() == [KVCopy(True, 1, 0), KVCopy(True, 0, 1)]
    assert dict(m.host.cached) == {HA[1]: 0, HA[0]: 1}
    assert m.host.free == [2]
    assert m.host.take_events() == [("stored", HA[1]), ("stored", HA[0])]
    # The device events are as before: A's blocks left the device pool.
    assert [e for e in m.pool.take_events() if e[0] == "removed"] == [("removed", HA[1]), ("removed", HA[0])]


def test_host_hit_takes_new_device_blocks_and_queues_the_copy_back():
    m, b = fill_host_with_a()
    m.take_tier_copies()
    m.free(b)
    assert free_ids(m) == [0, 1, 3, 2]        # B's partial block first, then its chain tail first
    a2 = req("a2", A)
    hits, n = m.get_computed_blocks(a2)
    assert hits == [HostHit(HA[0], 1), HostHit(HA[1], 0)] and n == 8
    m.host.take_events()
    blocks = m.allocate_slots(a2, a2.num_tokens - n, hits)
    # Block 0 (plain) takes HA[0]; block 1 (B's third block) takes HA[1], its own KV going to the
    # free host slot 2 first; block 3 (B's second) takes the last token, its KV going to the slot
    # of the least recently used entry: HA[0], back on the device by then.
    assert ids(blocks) == [0, 1, 3]
    assert m.take_tier_copies() == [KVCopy(False, 0, 1), KVCopy(True, 1, 2), KVCopy(False, 1, 0),
                               KVCopy(True, 3, 1)]
    assert [b.block_hash for b in blocks] == HA + [None]
    assert [b.ref_cnt for b in m.pool.blocks] == [1, 1, 0, 1]
    assert free_ids(m) == [2]
    assert dict(m.host.cached) == {HB[2]: 2, HA[1]: 0, HB[1]: 1}
    assert m.host.take_events() == [("stored", HB[2]), ("removed", HA[0]), ("stored", HB[1])]
    # Reloaded blocks are named on the device again: a third request hits them there.
    a3 = req("a3", A)
    hits, n = m.get_computed_blocks(a3)
    assert ids(hits) == [0, 1] and n == 8


def test_a_block_already_on_the_host_is_not_copied_again():
    m, b = fill_host_with_a()
    m.take_tier_copies()
    m.free(b)
    a2 = req("a2", A)
    run(m, a2)
    m.take_tier_copies()
    m.free(a2)
    assert free_ids(m) == [3, 2, 1, 0]
    # Block 1 holds HA[1], which the host still holds (slot 0): evicting it only refreshes that
    # entry. Block 2 (HB[0]) and block 0 (HA[0]) take the two least recently used slots.
    c = req("c", list(range(200, 216)))
    run(m, c)
    assert m.take_tier_copies() == [KVCopy(True, 2, 2), KVCopy(True, 0, 1)]
    assert dict(m.host.cached) == {HA[1]: 0, HB[0]: 2, HA[0]: 1}


def test_host_tier_is_a_bounded_lru():
    host = HostBlockPool(2)
    assert host.store(b"a" * 16) == 0 and host.store(b"b" * 16) == 1
    host.touch(b"a" * 16)
    assert host.store(b"c" * 16) == 1                 # b was the least recently used
    assert list(host.cached) == [b"a" * 16, b"c" * 16]
    assert host.store(b"a" * 16) is None               # held already: no copy, most recent now
    assert list(host.cached) == [b"c" * 16, b"a" * 16]
    host.pinned.add(1)                                 # c's slot is being read
    assert host.store(b"d" * 16) == 0                  # so a goes, though c is older
    host.pinned.add(0)
    assert host.store(b"e" * 16) is None and len(host.cached) == 2
    assert host.take_events() == [("stored", b"a" * 16), ("stored", b"b" * 16), ("removed", b"b" * 16),
                                  ("stored", b"c" * 16), ("removed", b"a" * 16), ("stored", b"d" * 16)]
    with pytest.raises(ValueError, match="kv_offloading_size"):
        HostBlockPool(0)


def test_host_hits_stay_pinned_while_their_allocation_evicts():
    """A two-slot tier holding both blocks of A: reloading them evicts two cached device blocks,
    whose copies out must not take a slot still to be read (they are dropped instead)."""
    m = KVCacheManager(num_blocks=4, block_size=BS, num_host_blocks=2)
    a = req("a", A)
    run(m, a)
    m.free(a)
    c = req("c", list(range(50, 66)))           # four full blocks: A goes to the host
    assert ids(run(m, c)[2]) == [2, 3, 1, 0]
    assert m.take_tier_copies() == [KVCopy(True, 1, 0), KVCopy(True, 0, 1)]
    m.free(c)
    assert free_ids(m) == [0, 1, 3, 2]
    a2 = req("a2", A)
    hits, n = m.get_computed_blocks(a2)
    assert hits == [HostHit(HA[0], 1), HostHit(HA[1], 0)]
    m.host.take_events()
    assert ids(m.allocate_slots(a2, 1, hits)) == [0, 1, 3]
    # Blocks 0 and 1 (c's last two) are lost; block 3 (the last token's) then takes HA[0]'s slot,
    # after it has been read. Unpinned, block 0's copy out would have overwritten slot 0 (HA[1])
    # before its reload.
    assert m.take_tier_copies() == [KVCopy(False, 0, 1), KVCopy(False, 1, 0), KVCopy(True, 3, 1)]
    hc = block_hashes(list(range(50, 66)), BS, ROOT)
    assert m.host.take_events() == [("removed", HA[0]), ("stored", hc[1])]
    assert m.host.pinned == set()


def test_failed_allocation_with_host_hits_changes_nothing():
    m, b = fill_host_with_a()
    m.take_tier_copies()
    a2 = req("a2", A)
    hits, n = m.get_computed_blocks(a2)
    before = (free_ids(m), dict(m.host.cached), list(m.host.free))
    assert m.allocate_slots(a2, 1, hits) is None       # B holds every device block
    assert (free_ids(m), dict(m.host.cached), list(m.host.free)) == before
    assert m.take_tier_copies() == [] and "a2" not in m.req_to_blocks


def test_abort_mid_reload_leaks_nothing():
    """A request aborted after its reload was queued, before the step ran: its device blocks
    go back (named: the queued copy still fills them before anything reads them), host slots stay
    consistent."""
    m, b = fill_host_with_a()
    m.take_tier_copies()
    m.free(b)
    a2 = req("a2", A)
    hits, n = m.get_computed_blocks(a2)
    m.allocate_slots(a2, a2.num_tokens - n, hits)
    assert any(not x.to_host for x in m.pool.copies)
    m.free(a2)                                       # aborted: the step never launched
    assert [b.ref_cnt for b in m.pool.blocks] == [0, 0, 0, 0]
    assert m.pool.num_free_blocks() == 4 and m.req_to_blocks == {}
    slots = sorted(list(m.host.cached.values()) + m.host.free)
    assert slots == [0, 1, 2] and not m.host.swapped and not m.host.pinned


def test_swap_out_and_in_move_every_computed_block():
    m = KVCacheManager(num_blocks=4, block_size=BS, num_host_blocks=4)
    r = req("r", list(range(10)))
    run(m, r)
    m.take_tier_copies()
    assert m.swap_out(r)
    assert m.take_tier_copies() == [KVCopy(True, 0, 0), KVCopy(True, 1, 1), KVCopy(True, 2, 2)]
    assert m.host.swapped == {"r": [0, 1, 2]} and m.is_swapped(r) and r.num_computed_tokens == 10
    assert m.pool.num_free_blocks() == 4 and "r" not in m.req_to_blocks
    assert free_ids(m) == [2, 3, 1, 0]
    # Resume with one more token. Blocks 0 and 1 still cache r's two full blocks: taken back as
    # prefix hits; only the partial block comes back from the host, to block 2.
    r.append_output_token(5)
    blocks = m.swap_in(r, 1)
    assert ids(blocks) == [0, 1, 2]
    assert m.take_tier_copies() == [KVCopy(False, 2, 2)]
    assert m.host.swapped == {} and sorted(m.host.free) == [0, 1, 2, 3] and not m.is_swapped(r)
    assert [b.ref_cnt for b in m.pool.blocks] == [1, 1, 1, 0] and free_ids(m) == [3]
    assert [b.block_hash for b in blocks] == r.block_hashes[:2] + [None]


def test_swap_in_copies_every_block_the_device_cache_lost():
    m = KVCacheManager(num_blocks=4, block_size=BS, num_host_blocks=6)
    r = req("r", list(range(10)))
    run(m, r)
    assert m.swap_out(r)
    other = req("o", list(range(50, 66)))        # takes all four device blocks, r's cached two too
    run(m, other)
    # r's own slots first, then r's two cached blocks leave the device for host slots 3 and 4.
    assert m.take_tier_copies() == [KVCopy(True, 0, 0), KVCopy(True, 1, 1), KVCopy(True, 2, 2),
                                    KVCopy(True, 1, 3), KVCopy(True, 0, 4)]
    m.free(other)
    assert free_ids(m) == [0, 1, 3, 2]
    r.append_output_token(5)
    blocks = m.swap_in(r, 1)
    assert ids(blocks) == [0, 1, 3]
    # o's blocks go to the host (slot 5, then the least recent entries: r's own cached copies,
    # which the swap makes redundant), then r's three slots come back; its slots are never taken.
    assert m.take_tier_copies() == [KVCopy(True, 0, 5), KVCopy(True, 1, 3), KVCopy(True, 3, 4),
                                    KVCopy(False, 0, 0), KVCopy(False, 1, 1), KVCopy(False, 3, 2)]
    assert [b.block_hash for b in blocks] == r.block_hashes[:2] + [None]
    assert m.pool.get_cached_block(r.block_hashes[0]).block_id == 0
    assert m.host.swapped == {} and m.host.free == [2, 1, 0]


def test_swap_out_refused_when_the_host_tier_is_too_small():
    m = KVCacheManager(num_blocks=4, block_size=BS, num_host_blocks=2)
    r = req("r", list(range(10)))
    run(m, r)
    assert not m.swap_out(r)
    assert ids(m.req_to_blocks["r"]) == [0, 1, 2] and m.host.swapped == {} and m.take_tier_copies() == []


def test_swapped_request_that_ends_frees_its_slots():
    m = KVCacheManager(num_blocks=4, block_size=BS, num_host_blocks=4)
    r = req("r", list(range(10)))
    run(m, r)
    assert m.swap_out(r)
    m.free(r)
    assert m.host.swapped == {} and sorted(m.host.free) == [0, 1, 2, 3] and not m.is_swapped(r)


def test_copy_runs_never_write_a_block_twice():
    copies = [KVCopy(True, 1, 0), KVCopy(True, 2, 1), KVCopy(True, 3, 0), KVCopy(False, 1, 0),
              KVCopy(False, 2, 1)]
    assert list(_runs(copies)) == [(True, [1, 2], [0, 1]), (True, [3], [0]), (False, [1, 2], [0, 1])]


# ---- scheduler -------------------------------------------------------------------------------

def step(s, token=7):
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput(sampled_token_ids={x.req_id: token for x in out.scheduled
                                                                   if x.sample}))
    return out


def two_requests(mode, host_blocks=8, b_len=4):
    kv = KVCacheManager(3, BS, False, num_host_blocks=host_blocks)
    s = Scheduler(kv, 8, 64, preemption_mode=mode)
    s.add_request(Request("a", list(range(4)), SamplingParams(), BS, ROOT))
    s.add_request(Request("b", list(range(10, 10 + b_len)), SamplingParams(), BS, ROOT))
    step(s)
    out = step(s)      # a needs another block; none is left: b, the last admitted, is preempted
    assert [x.req_id for x in out.scheduled] == ["a"]
    return s


def test_swap_preemption_keeps_progress_and_resumes_from_the_host():
    s = two_requests("swap")
    b = s.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and s.num_swaps == 1 and s.num_preemptions == 1
    assert b.num_computed_tokens == 4 and s.kv.is_swapped(b)
    s.finish_requests(["a"], RequestStatus.FINISHED_STOPPED)
    out = step(s)
    # Only the sampled token is computed; its KV comes back first.
    assert [(x.req_id, x.num_tokens, x.start_pos) for x in out.scheduled] == [("b", 1, 4)]
    assert out.kv_copies == [KVCopy(False, s.kv.block_ids(b)[0], 0)]
    assert s.prefix_cache_queries == 8                  # a resume is no prefix lookup


def test_recompute_preemption_when_swap_is_off_or_the_host_is_full():
    # b holds two computed blocks; a one-slot tier cannot take them.
    for mode, host in (("recompute", 8), ("swap", 1)):
        s = two_requests(mode, host, b_len=8)
        b = s.requests["b"]
        assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
        assert not s.kv.is_swapped(b) and s.num_swaps == 0 and s.num_preemptions == 1
