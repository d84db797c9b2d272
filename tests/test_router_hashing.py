"""router/hashing.py: the router's prompt hashes equal pagoda.protos.block_hash's chain whatever it reuses."""
import random

import pytest

from pagoda.protos.block_hash import block_hashes, namespace_root
from pagoda.router.hashing import PromptHasher

ROOT = namespace_root("m")


def test_equals_the_contract_on_shared_prefixes_turns_namespaces_and_block_sizes():
    rng = random.Random(3)
    hasher = PromptHasher(max_prompts=50)
    systems = [[rng.randrange(32000) for _ in range(rng.randint(0, 300))] for _ in range(5)]
    sessions = [list(rng.choice(systems)) for _ in range(20)]
    roots = [ROOT, namespace_root("m", cache_salt="t2"), namespace_root("other")]
    for step in range(600):
        s = rng.randrange(len(sessions))
        if rng.random() < 0.3:
            prompt = rng.choice(systems) + [rng.randrange(32000) for _ in range(rng.randint(0, 100))]
        else:                                   # the session's next turn resends its history
            sessions[s] += [rng.randrange(32000) for _ in range(rng.randint(1, 80))]
            prompt = sessions[s]
        if rng.random() < 0.1:
            prompt = prompt[:rng.randrange(len(prompt) + 1)]
        root, bs = rng.choice(roots), rng.choice((16, 16, 16, 4))
        assert hasher.hashes(prompt, bs, root) == tuple(block_hashes(prompt, bs, root)), step
        assert hasher._sorted == sorted(hasher._hashes), step       # the search list stays in order
    assert hasher.reused_blocks > hasher.hashed_blocks // 3   # the reuse was exercised
    assert len(hasher) <= 50


def test_reuses_the_leading_blocks_of_the_nearest_prompt_and_a_turn_replaces_its_predecessor():
    hasher = PromptHasher()
    system = list(range(1000, 1000 + 64))                      # 4 blocks
    a = system + list(range(5000, 5000 + 32))
    b = system + list(range(7000, 7000 + 40))
    assert hasher.hashes(a, 16, ROOT) == tuple(block_hashes(a, 16, ROOT)) and hasher.hashed_blocks == 6
    assert hasher.hashes(b, 16, ROOT) == tuple(block_hashes(b, 16, ROOT))
    assert (hasher.reused_blocks, hasher.hashed_blocks) == (4, 8)          # b: 4 reused, 2 hashed
    turn = b + list(range(9000, 9000 + 48))
    assert hasher.hashes(turn, 16, ROOT) == tuple(block_hashes(turn, 16, ROOT))
    assert (hasher.reused_blocks, hasher.hashed_blocks) == (10, 11)        # all of b's 6 reused
    assert len(hasher) == 2                                                # the turn replaced b
    assert hasher.hashes(turn, 16, ROOT) == tuple(block_hashes(turn, 16, ROOT))   # an exact repeat
    assert hasher.hashed_blocks == 11
    assert hasher.hashes(a, 16, namespace_root("m", adapter="x")) == tuple(block_hashes(a, 16, namespace_root("m", "x")))
    assert hasher.hashed_blocks == 17                          # another namespace shares nothing
    assert hasher.hashes(a[:15], 16, ROOT) == ()


def test_bounded_by_prompts_and_bytes_least_recently_used_first():
    hasher = PromptHasher(max_prompts=3)
    prompts = [[i] * 32 for i in range(5)]
    for p in prompts:
        hasher.hashes(p, 16, ROOT)
    assert len(hasher) == 3 and len(hasher._sorted) == 3
    hasher.hashes(prompts[2], 16, ROOT)                        # touched: outlives 3 and 4
    hasher.hashes([9] * 32, 16, ROOT)
    hasher.hashes([8] * 32, 16, ROOT)
    assert sorted(hasher._sorted) == hasher._sorted and len(hasher) == 3
    before = hasher.hashed_blocks
    hasher.hashes(prompts[2], 16, ROOT)
    assert hasher.hashed_blocks == before
    small = PromptHasher(max_bytes=1000)                       # one 32-token prompt is 4 + 16 + 128 + 128
    for p in prompts:
        small.hashes(p, 16, ROOT)
    assert 0 < small._bytes <= 1000 and len(small) == small._bytes // 276
    with pytest.raises(ValueError):
        PromptHasher(max_prompts=0)
