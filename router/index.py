"""The router's in-memory mirror of which worker caches which block: hash -> worker ids.

Bounded: past `max_blocks` hashes the least recently touched entry goes (a lookup or a store
touches), so memory stays fixed however many blocks the cluster churns through. Speculative
entries (a prefix just routed to a worker, before the worker reports it) expire unless the
worker's own "stored" event confirms them first.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from typing import Iterable, Sequence


class BlockIndex:
    def __init__(self, max_blocks: int = 1_000_000, speculative_ttl_s: float = 10.0):
        if max_blocks < 1:
            raise ValueError(f"index_max_blocks: must be at least 1 (got {max_blocks})")
        self.max_blocks, self.speculative_ttl_s = max_blocks, speculative_ttl_s
        self._owners: OrderedDict[bytes, set[str]] = OrderedDict()
        self._by_worker: dict[str, set[bytes]] = {}
        self._speculative: dict[tuple[str, bytes], float] = {}   # (worker, hash) -> deadline

    def __len__(self) -> int:
        return len(self._owners)

    def blocks_of(self, worker: str) -> int:
        return len(self._by_worker.get(worker, ()))

    def workers(self) -> list[str]:
        return [w for w, hs in self._by_worker.items() if hs]

    def add(self, worker: str, hashes: Iterable[bytes]) -> None:
        mine = self._by_worker.setdefault(worker, set())
        for h in hashes:
            self._speculative.pop((worker, h), None)
            owners = self._owners.get(h)
            if owners is None:
                owners = self._owners[h] = set()
            else:
                self._owners.move_to_end(h)
            owners.add(worker)
            mine.add(h)
        self._evict()

    def remove(self, worker: str, hashes: Iterable[bytes]) -> None:
        mine = self._by_worker.get(worker, set())
        for h in hashes:
            self._speculative.pop((worker, h), None)
            mine.discard(h)
            owners = self._owners.get(h)
            if owners is not None:
                owners.discard(worker)
                if not owners:
                    del self._owners[h]

    def apply(self, worker: str, events: Sequence[tuple[str, bytes]]) -> None:
        """Stream events in order; a block stored then removed in one batch ends up absent."""
        for kind, h in events:
            (self.add if kind == "stored" else self.remove)(worker, (h,))

    def drop_worker(self, worker: str) -> None:
        self.remove(worker, list(self._by_worker.pop(worker, ())))
        self._speculative = {k: v for k, v in self._speculative.items() if k[0] != worker}

    def replace_worker(self, worker: str, hashes: Iterable[bytes]) -> None:
        self.drop_worker(worker)
        self.add(worker, hashes)

    def speculate(self, worker: str, hashes: Sequence[bytes], now: float | None = None) -> None:
        """Record that `worker` is about to cache `hashes` (not yet reported)."""
        deadline = (time.monotonic() if now is None else now) + self.speculative_ttl_s
        new = [h for h in hashes if worker not in self._owners.get(h, ())]
        self.add(worker, new)
        for h in new:
            self._speculative[(worker, h)] = deadline

    def expire_speculation(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        dead = [k for k, t in self._speculative.items() if t <= now]
        for worker, h in dead:
            self.remove(worker, (h,))

    def overlap(self, hashes: Sequence[bytes], workers: Iterable[str]) -> dict[str, int]:
        """Leading blocks of `hashes` each worker holds (a chain is only usable from its start)."""
        alive = set(workers)
        result = dict.fromkeys(alive, 0)
        for i, h in enumerate(hashes):
            owners = self._owners.get(h)
            if not owners:
                break
            self._owners.move_to_end(h)
            alive &= owners
            if not alive:
                break
            for w in alive:
                result[w] = i + 1
        return result

    def _evict(self) -> None:
        while len(self._owners) > self.max_blocks:
            h, owners = self._owners.popitem(last=False)
            for w in owners:
                self._by_worker[w].discard(h)
                self._speculative.pop((w, h), None)
