"""The host-memory KV tier's bookkeeping: which host slot holds which block (issue 23).

A prefix-cache block that the device pool hands out again is first copied to a host slot,
keeping its hash; a prefix lookup that misses the device pool but finds the hash here gets a
new device block and the copy back. A preempted request in swap mode holds slots of its own
until it resumes. This module only decides; the runner owns the host tensors (pinned on CUDA,
a second CPU pool on CPU) and performs the KVCopy list each step carries, in order.

Invariants:
- every slot is in exactly one place: `free`, `cached` (hash -> slot, least recently used
  first) or `swapped` (slots of one preempted request, in its block order);
- a pinned slot (a reload from it is being queued) is never taken for another block;
- copies run in the order they were queued and before the step's forward, so a slot read by
  one copy and then reused by a later one is read first (and likewise a device block copied out
  before a reload or the forward overwrites it).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple, Optional


class KVCopy(NamedTuple):
    """One block's copy between tiers: device -> host when to_host, else host -> device."""
    to_host: bool
    device_block: int
    host_block: int


class HostHit(NamedTuple):
    """A prefix block found in the host tier only: it needs a device block and a copy back."""
    block_hash: bytes
    host_block: int


class HostBlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"kv_offloading_size: the host tier needs at least one block (got {num_blocks})")
        self.num_blocks = num_blocks
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))   # pop() hands out 0 first
        self.cached: OrderedDict[bytes, int] = OrderedDict()
        self.swapped: dict[str, list[int]] = {}
        self.pinned: set[int] = set()
        self.events: list[tuple[str, bytes]] = []

    def lookup(self, block_hash: bytes) -> Optional[int]:
        return self.cached.get(block_hash)

    def num_takeable(self) -> int:
        """Slots a new block could take now: free, or cached and not pinned."""
        return len(self.free) + len(self.cached) - sum(1 for s in self.cached.values() if s in self.pinned)

    def _take(self) -> Optional[int]:
        if self.free:
            return self.free.pop()
        for h, slot in self.cached.items():     # least recently used first
            if slot not in self.pinned:
                del self.cached[h]
                self.events.append(("removed", h))
                return slot
        return None

    def store(self, block_hash: bytes) -> Optional[int]:
        """A slot for a block leaving the device, to copy it into; None when no copy is needed
        (the tier holds the hash already: it becomes the most recently used) or none can be had."""
        if block_hash in self.cached:
            self.cached.move_to_end(block_hash)
            return None
        slot = self._take()
        if slot is not None:
            self.cached[block_hash] = slot
            self.events.append(("stored", block_hash))
        return slot

    def touch(self, block_hash: bytes) -> None:
        if block_hash in self.cached:
            self.cached.move_to_end(block_hash)

    def swap_out(self, req_id: str, n: int) -> Optional[list[int]]:
        """n slots for a preempted request's blocks (evicting cached ones, least recent first),
        or None and nothing changed when fewer can be had."""
        if n > self.num_takeable():
            return None
        slots = [self._take() for _ in range(n)]
        assert None not in slots
        self.swapped[req_id] = slots        # type: ignore[assignment]
        return self.swapped[req_id]

    def release_swapped(self, req_id: str) -> None:
        """The request's slots go free (it resumed: its copies back are queued, so any later use
        of the slots is ordered after them; or it ended)."""
        self.free.extend(reversed(self.swapped.pop(req_id, [])))

    def reset(self) -> None:
        """Forget every cached hash (the device cache was reset: its blocks may be unwritten)."""
        for h, slot in self.cached.items():
            self.events.append(("removed", h))
            self.free.append(slot)
        self.cached.clear()

    def take_events(self) -> list[tuple[str, bytes]]:
        events, self.events = self.events, []
        return events
