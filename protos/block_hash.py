"""The chained block hash that names a KV-cache block, shared by workers and routers.

h_0 = H(root, tokens_0), h_i = H(h_{i-1}, tokens_i), over full blocks only. `root` folds
in the namespace (model, adapter, cache salt) so tenants and models never share entries.
H is BLAKE2b-128 over a canonical encoding (parent digest, then each token id as a
little-endian uint32), so it is seedless and identical in every process and machine.
Test vectors live in tests/data/block_hash_vectors.json.
"""
from __future__ import annotations

import hashlib
import struct
from typing import Sequence

DIGEST_SIZE = 16
_PERSON = b"pagoda-kv-v1"


def namespace_root(model: str, adapter: str = "", cache_salt: str = "") -> bytes:
    """The chain's root for one (model, adapter, salt) namespace."""
    h = hashlib.blake2b(digest_size=DIGEST_SIZE, person=_PERSON)
    for part in (model, adapter, cache_salt):
        data = part.encode("utf-8")
        # Length-prefixed so that ("ab", "c") and ("a", "bc") differ.
        h.update(struct.pack("<I", len(data)))
        h.update(data)
    return h.digest()


def hash_block(parent: bytes, tokens: Sequence[int]) -> bytes:
    """Hash of one full block given its parent's hash (or the root for the first block)."""
    h = hashlib.blake2b(parent, digest_size=DIGEST_SIZE, person=_PERSON)
    h.update(struct.pack(f"<{len(tokens)}I", *tokens))
    return h.digest()


def block_hashes(token_ids: Sequence[int], block_size: int, root: bytes,
                 start: Sequence[bytes] = ()) -> list[bytes]:
    """Hashes of every full block of `token_ids`; `start` holds hashes already known
    for a prefix, which are extended rather than recomputed."""
    hashes = list(start)
    parent = hashes[-1] if hashes else root
    first, n = len(hashes), len(token_ids) // block_size
    if n <= first:
        return hashes
    # The same bytes hash_block feeds BLAKE2b, packed once and hashed per block from a copied
    # initial state: a third of the cost of hash_block per block (it sits in every routing decision).
    data = memoryview(struct.pack(f"<{(n - first) * block_size}I", *token_ids[first * block_size:n * block_size]))
    step = 4 * block_size
    for i in range(0, len(data), step):
        h = _EMPTY.copy()
        h.update(parent)
        h.update(data[i:i + step])
        parent = h.digest()
        hashes.append(parent)
    return hashes


_EMPTY = hashlib.blake2b(digest_size=DIGEST_SIZE, person=_PERSON)
