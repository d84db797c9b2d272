"""The router's in-memory mirror of which worker caches which block: hash -> bitmap of workers.

Each worker the index has seen holds one bit (reused after it leaves); a block's owners are one
Python int, so the longest-prefix walk over a request's chain is an AND per block that stops at
the first block nobody left in the running holds, and its cost does not grow with the number of
workers. The walk is a chain of C iterators (lookup, running AND, stop at zero), with no Python
bytecode per block; each worker's depth is then read off where the running AND changes. Each
worker's own hashes are kept too, so a worker that leaves or resyncs is removed without a scan
of the whole index.

Out of the cyclic garbage collector's way: a million blocks are a million entries that a full
collection would walk (tens of milliseconds, a third of the mean decision cost at 32 workers).
The per-worker collections are dicts of bytes, which CPython stops tracking; the one ordered
dict is frozen with the rest of the router's startup heap (pagoda.runtime.heap.freeze_heap, which
Router.start calls once built).

A worker's own dict also marks its speculative blocks (with their deadline; None once reported),
so a speculated block costs two entries (owners, worker) and expiry walks only what is due.

Bounded: past `max_blocks` hashes the least recently touched entry goes (a lookup or a store
touches), so memory stays fixed however many blocks the cluster churns through. A lookup
touches a chain's matched blocks from the last to the first, so that eviction shortens a chain
from its end, and never takes the first block while leaving the rest unreachable. Speculative
entries (a prefix just routed to a worker, before the worker reports it) expire unless the
worker's own "stored" event confirms them first.

Tiers: blocks a worker holds only in host memory (its host KV tier, issue 23) are kept apart, in
a second bitmap dict with the same worker bits and its own bound, so the device walk above is
unchanged; overlap_tiers walks the chain through either tier (a host block costs a copy, where a
device block costs nothing and a missing one a prefill: router/scoring.py prices the three).
"""
from __future__ import annotations

import time
from collections import OrderedDict, deque
from itertools import accumulate, repeat, takewhile
from operator import and_
from typing import Iterable, Sequence


class BlockIndex:
    def __init__(self, max_blocks: int = 1_000_000, speculative_ttl_s: float = 10.0):
        if max_blocks < 1:
            raise ValueError(f"index_max_blocks: must be at least 1 (got {max_blocks})")
        self.max_blocks, self.speculative_ttl_s = max_blocks, speculative_ttl_s
        self._owners: OrderedDict[bytes, int] = OrderedDict()      # hash -> bitmap of worker bits
        # worker -> its hashes: None once reported, else the deadline of its speculation. A lone
        # owner's bitmap finds its dict in one lookup (`_alone`): most blocks have one owner, and
        # eviction (every insert past the bound) needs no bit walk for them.
        self._by_worker: dict[str, dict[bytes, float | None]] = {}
        self._alone: dict[int, dict[bytes, float | None]] = {}
        self._bit: dict[str, int] = {}                             # worker -> its bit
        self._name: dict[int, str] = {}                            # bit -> worker
        self._free_bits: list[int] = []
        # Speculations in the order made, so in deadline order (the clock is monotonic): expiry
        # looks at those due, never at every speculative block.
        self._speculated: deque[tuple[float, str, tuple[bytes, ...]]] = deque()
        # The host tier: hash -> bitmap of workers holding it in host memory, least recently
        # touched first, and each worker's host hashes.
        self._host: OrderedDict[bytes, int] = OrderedDict()
        self._host_of: dict[str, dict[bytes, None]] = {}

    def __len__(self) -> int:
        return len(self._owners)

    def blocks_of(self, worker: str) -> int:
        return len(self._by_worker.get(worker, ()))

    def speculative_blocks(self, worker: str) -> int:
        return sum(1 for t in self._by_worker.get(worker, {}).values() if t is not None)

    def workers(self) -> list[str]:
        return [w for w, hs in self._by_worker.items() if hs]

    def _flag(self, worker: str) -> int:
        bit = self._bit.get(worker)
        if bit is None:
            bit = self._free_bits.pop() if self._free_bits else len(self._bit)
            self._bit[worker], self._name[bit] = bit, worker
            self._by_worker[worker] = self._alone[1 << bit] = {}
        return 1 << bit

    def add(self, worker: str, hashes: Iterable[bytes]) -> None:
        """Blocks the worker reports cached (confirming any it was speculated to hold)."""
        flag, owners, = self._flag(worker), self._owners
        mine = self._by_worker[worker]
        for h in hashes:
            m = owners.get(h)
            if m is None:
                owners[h] = flag
            else:
                owners[h] = m | flag
                owners.move_to_end(h)
            mine[h] = None
        self._evict()

    def remove(self, worker: str, hashes: Iterable[bytes]) -> None:
        bit = self._bit.get(worker)
        if bit is None:
            return
        keep, owners, mine = ~(1 << bit), self._owners, self._by_worker[worker]
        for h in hashes:
            mine.pop(h, None)
            m = owners.get(h)
            if m is not None:
                m &= keep
                if m:
                    owners[h] = m
                else:
                    del owners[h]

    def apply(self, worker: str, events: Sequence[tuple[str, bytes]]) -> None:
        """Stream events in order; a block stored then removed in one batch ends up absent."""
        for kind, h in events:
            (self.add if kind == "stored" else self.remove)(worker, (h,))

    def host_blocks_of(self, worker: str) -> int:
        return len(self._host_of.get(worker, ()))

    def has_host_blocks(self) -> bool:
        return bool(self._host)

    def add_host(self, worker: str, hashes: Iterable[bytes]) -> None:
        """Blocks the worker reports in its host tier."""
        flag, host = self._flag(worker), self._host
        mine = self._host_of.setdefault(worker, {})
        for h in hashes:
            host[h] = host.get(h, 0) | flag
            host.move_to_end(h)
            mine[h] = None
        n = len(host) - self.max_blocks
        for _ in range(max(n, 0)):
            h, m = host.popitem(last=False)
            while m:
                low = m & -m
                self._host_of.get(self._name[low.bit_length() - 1], {}).pop(h, None)
                m ^= low

    def remove_host(self, worker: str, hashes: Iterable[bytes]) -> None:
        bit = self._bit.get(worker)
        if bit is None:
            return
        keep, host, mine = ~(1 << bit), self._host, self._host_of.get(worker, {})
        for h in hashes:
            mine.pop(h, None)
            m = host.get(h)
            if m is not None:
                m &= keep
                if m:
                    host[h] = m
                else:
                    del host[h]

    def apply_host(self, worker: str, events: Sequence[tuple[str, bytes]]) -> None:
        for kind, h in events:
            (self.add_host if kind == "stored" else self.remove_host)(worker, (h,))

    def overlap_tiers(self, hashes: Sequence[bytes]) -> dict[str, int]:
        """Leading blocks of `hashes` each worker holds in either tier (device or host)."""
        owners, host = self._owners, self._host
        held = list(takewhile(bool, accumulate((owners.get(h, 0) | host.get(h, 0) for h in hashes), and_)))
        return self._depths(held)

    def drop_worker(self, worker: str) -> None:
        if worker not in self._bit:
            return
        self.remove_host(worker, list(self._host_of.pop(worker, {})))
        self.remove(worker, list(self._by_worker[worker]))
        bit = self._bit.pop(worker)
        del self._name[bit], self._by_worker[worker], self._alone[1 << bit]
        self._free_bits.append(bit)        # every block has lost this bit: safe to hand out again

    def replace_worker(self, worker: str, hashes: Iterable[bytes], host_hashes: Iterable[bytes] = ()) -> None:
        """A snapshot: what the worker reports replaces what it was known to hold, but for its
        speculations still pending (requests sent after the snapshot was taken, which it cannot
        refute): they stay, with their deadlines, until a report confirms them or they expire."""
        pending = {h: t for h, t in self._by_worker.get(worker, {}).items() if t is not None}
        self.drop_worker(worker)
        self.add(worker, hashes)
        self.add_host(worker, host_hashes)
        if pending:
            flag, owners, mine = self._flag(worker), self._owners, self._by_worker[worker]
            for h, deadline in pending.items():
                if h not in mine:
                    owners[h] = owners.get(h, 0) | flag
                    mine[h] = deadline
            self._evict()

    def speculate(self, worker: str, hashes: Sequence[bytes], now: float | None = None) -> None:
        """Record that `worker` is about to cache `hashes` (not yet reported)."""
        deadline = (time.monotonic() if now is None else now) + self.speculative_ttl_s
        flag, owners = self._flag(worker), self._owners
        mine = self._by_worker[worker]
        new = []
        for h in hashes:
            m = owners.get(h)
            if m is None:
                owners[h] = flag
            elif m & flag:
                continue            # held already, reported or speculated: its deadline stands
            else:
                owners[h] = m | flag
                owners.move_to_end(h)
            mine[h] = deadline
            new.append(h)
        if new:
            self._speculated.append((deadline, worker, tuple(new)))
        self._evict()

    def expire_speculation(self, now: float | None = None) -> None:
        """Drop speculations past their deadline that no report confirmed (nor a later one renewed)."""
        now = time.monotonic() if now is None else now
        due = self._speculated
        while due and due[0][0] <= now:
            deadline, worker, hashes = due.popleft()
            mine = self._by_worker.get(worker)
            if mine:
                dead = [h for h in hashes if mine.get(h) == deadline]
                if dead:
                    self.remove(worker, dead)

    def overlap(self, hashes: Sequence[bytes], workers: Iterable[str] | None = None) -> dict[str, int]:
        """Leading blocks of `hashes` each worker holds (a chain is only usable from its start);
        workers holding none are left out. `workers` limits the answer to those."""
        owners = self._owners
        # held[i]: the workers holding all of blocks 0..i; it stops before the first empty one.
        held = list(takewhile(bool, accumulate(map(owners.get, hashes, repeat(0)), and_)))
        if not held:
            return {}
        deque(map(owners.move_to_end, hashes[len(held) - 1::-1]), maxlen=0)
        result = self._depths(held)
        if workers is not None:
            wanted = set(workers)
            result = {w: n for w, n in result.items() if w in wanted}
        return result

    def _depths(self, held: list[int]) -> dict[str, int]:
        """Each worker's depth, from the running AND of a chain's owner bitmaps (held[i]: the
        workers holding blocks 0..i)."""
        result: dict[str, int] = {}
        if not held:
            return result
        marks = list(dict.fromkeys(held))       # each a subset of the one before
        start = 0
        for mask, after in zip(marks, marks[1:]):
            start = held.index(after, start)
            self._record(mask & ~after, start, result)    # these stop here
        self._record(marks[-1], len(held), result)
        return result

    def _record(self, bits: int, depth: int, result: dict[str, int]) -> None:
        name = self._name
        while bits:
            low = bits & -bits
            result[name[low.bit_length() - 1]] = depth
            bits ^= low

    def _evict(self) -> None:
        owners, alone = self._owners, self._alone
        n = len(owners) - self.max_blocks
        if n <= 0:
            return
        pop, lone = owners.popitem, alone.get
        for h, m in map(pop, repeat(False, n)):
            one = lone(m)
            if one is not None:
                one.pop(h, None)
                continue
            while m:
                low = m & -m
                alone[low].pop(h, None)
                m ^= low
