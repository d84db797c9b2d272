"""A prompt's block hashes (pagoda.protos.block_hash's chain) with the leading blocks of recent prompts reused.

Each decision hashes every full block of its prompt, one BLAKE2b per block, and that is the
largest single cost of a decision. Prompts repeat their beginnings: a system prompt or few-shot
examples under many requests, and a conversation's history under each of its turns. So the
router remembers recent prompts (their token bytes and hashes) in one sorted list: the one that
shares the most leading blocks with a new prompt sorts right next to it, found by a binary
search of byte comparisons, and its hashes for the shared blocks are taken as they are. Only the
blocks past the shared ones are hashed. A prompt that extends a remembered one (the next turn of
a conversation) replaces it.

Correct by construction: a prompt is remembered under (block size, namespace root, token bytes),
and a block's hash depends only on the root and the tokens up to its end, so equal leading bytes
mean equal leading hashes.

Bounded: at most `max_prompts` prompts and about `max_bytes` (token bytes plus hashes); the
least recently used goes first.
"""
from __future__ import annotations

import bisect
import hashlib
import struct
import sys
from array import array
from collections import OrderedDict
from typing import Sequence

from pagoda.protos.block_hash import _PERSON, DIGEST_SIZE


class PromptHasher:
    def __init__(self, max_prompts: int = 4096, max_bytes: int = 32 << 20):
        if max_prompts < 1 or max_bytes < 1:
            raise ValueError("max_prompts and max_bytes: must be at least 1")
        self.max_prompts, self.max_bytes = max_prompts, max_bytes
        self._sorted: list[bytes] = []                                  # remembered keys, in byte order
        # key -> its hashes, least recently used first. Tuples: the garbage collector stops tracking
        # a tuple of bytes, where thousands of lists held here made every collection walk them
        # (+40 us a decision at 32 workers).
        self._hashes: OrderedDict[bytes, tuple[bytes, ...]] = OrderedDict()
        self._bytes = 0
        self._empty = hashlib.blake2b(digest_size=DIGEST_SIZE, person=_PERSON)
        self.reused_blocks = self.hashed_blocks = 0

    def __len__(self) -> int:
        return len(self._hashes)

    def hashes(self, token_ids: Sequence[int], block_size: int, root: bytes) -> tuple[bytes, ...]:
        """pagoda.protos.block_hash.block_hashes(token_ids, block_size, root), as a tuple."""
        n = len(token_ids) // block_size
        if n <= 0:
            return ()
        head = struct.pack("<I", block_size) + root
        # pagoda.protos.block_hash's bytes (each id a little-endian uint32), packed by array: no
        # argument tuple of every id as struct.pack takes (a tenth of a decision's hashing).
        body = array("I")
        body.fromlist(token_ids if isinstance(token_ids, list) else list(token_ids))   # faster than array(..., ids)
        del body[n * block_size:]
        if _SWAP:
            body.byteswap()
        key = head + body
        step, start = 4 * block_size, len(head)
        known, near, at, where = self._nearest(key, start, step)
        if near is not None and known == n and len(near) == len(key):
            self._hashes.move_to_end(near)
            return self._hashes[near]
        out = list(self._hashes[near][:known]) if near is not None else []
        parent, new = (out[-1] if out else root), self._empty.copy
        for i in range(start + known * step, len(key), step):
            h = new()
            h.update(parent)
            h.update(key[i:i + step])       # a 64-byte copy costs less than a memoryview slice
            parent = h.digest()
            out.append(parent)
        self.reused_blocks += known
        self.hashed_blocks += n - known
        if near is not None and start + known * step == len(near):
            # This prompt extends it: it says nothing more. Its place is known (no second search).
            self._bytes -= _size(near, self._hashes.pop(near))
            del self._sorted[at]
            where -= at < where
        hashes = tuple(out)
        self._remember(key, hashes, where)
        return hashes

    def _nearest(self, key: bytes, start: int, step: int) -> tuple[int, bytes | None, int, int]:
        """(leading blocks shared, the remembered key sharing them, its place in the sorted list,
        the place `key` sorts at) for the best neighbour of `key`."""
        keys = self._sorted
        i = bisect.bisect_left(keys, key)
        best, near, at = 0, None, -1
        for j in (i, i - 1):
            if 0 <= j < len(keys):
                other = keys[j]
                shared = _shared_blocks(key, other, start, step)
                if shared > best:
                    best, near, at = shared, other, j
        return best, near, at, i

    def _remember(self, key: bytes, hashes: tuple[bytes, ...], where: int) -> None:
        self._sorted.insert(where, key)
        self._hashes[key] = hashes
        self._bytes += _size(key, hashes)
        while len(self._hashes) > self.max_prompts or self._bytes > self.max_bytes:
            self._forget(next(iter(self._hashes)))

    def _forget(self, key: bytes) -> None:
        self._bytes -= _size(key, self._hashes.pop(key))
        del self._sorted[bisect.bisect_left(self._sorted, key)]


_SWAP = sys.byteorder != "little"
assert array("I").itemsize == 4, "array('I') must be a uint32 here"


def _size(key: bytes, hashes: tuple[bytes, ...]) -> int:
    return len(key) + 64 * len(hashes)        # a 16-byte digest is a 49-byte object, plus its slot


def _shared_blocks(a: bytes, b: bytes, start: int, step: int) -> int:
    """How many whole blocks a and b share after their common `start` bytes (0 if those differ)."""
    hi = (min(len(a), len(b)) - start) // step
    view = memoryview(b)            # a.startswith(view[:end]) compares in place, copying nothing
    if hi <= 0 or not a.startswith(view[:start + step]):
        return 0
    if a.startswith(view[:start + hi * step]):
        return hi
    lo = 1
    while lo < hi - 1:              # a and b agree on lo blocks and differ within hi
        mid = (lo + hi) // 2
        if a.startswith(view[:start + mid * step]):
            lo = mid
        else:
            hi = mid
    return lo
