"""The engine-side commands of a KV transfer, in process on two tiny engines (no network): a block
exported from one pool and written into the other is byte-identical; quarantined blocks are
nobody's cache hit until named; only the leading run given as complete is named; every block goes
back; and the fetched prefix serves the same greedy tokens as computing it."""
import random

import pytest
import torch

from pagoda.gpu_worker.core.sampling_params import SamplingParams
from pagoda.gpu_worker.engine.llm import LLM
from pagoda.gpu_worker.serving.kv_transfer import ExportBlocks, FinishImport, PlanImport, WriteBlocks, layout_of

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BLOCK = 16
PROMPT = [random.Random(3).randrange(5, 600) for _ in range(100)]      # 6 full blocks can be fetched
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def llm(tiny_model):
    return LLM(tiny_model, device="cpu", block_size=BLOCK, num_kv_blocks=32, max_model_len=512)


def move(src, dst, num_ok=None):
    """What a fetch does, minus the network: -> (plan, blocks named on dst)."""
    plan = PlanImport(tuple(PROMPT), 6, "", "")(dst)
    assert plan is not None
    exported = ExportBlocks(tuple(plan.missing))(src)
    assert exported is not None
    layout, data = exported
    assert layout.num_blocks == len(plan.missing) and data.shape[1] == 2 * 2 * 2 * BLOCK * 16 * 4
    WriteBlocks(tuple(b.block_id for b in plan.blocks), data)(dst)
    for b in plan.blocks:       # quarantined: held, unnamed, no lookup finds them
        assert b.ref_cnt == 1 and b.block_hash is None
    assert all(dst.kv.pool.get_cached_block(h) is None for h in plan.missing)
    FinishImport(plan, len(plan.missing) if num_ok is None else num_ok)(dst)
    return plan, data


def test_moved_blocks_are_byte_identical_and_serve_the_same_tokens(tiny_model):
    a, b = llm(tiny_model), llm(tiny_model)
    want = a.generate([PROMPT], GREEDY)[0].outputs[0].token_ids
    plan, data = move(a.engine, b.engine)
    pool = b.engine.kv.pool
    assert [pool.get_cached_block(h) for h in plan.missing] == plan.blocks
    again, data_again = ExportBlocks(tuple(plan.missing))(b.engine)
    assert torch.equal(data_again, data) and again.num_blocks == 6
    assert pool.num_free_blocks() == pool.num_blocks          # named, idle, evictable
    out = b.generate([PROMPT], GREEDY)[0]
    assert out.outputs[0].token_ids == want and out.num_cached_tokens == 96
    assert layout_of(a.engine) == layout_of(b.engine) and again == layout_of(a.engine, 6)


def test_only_the_leading_complete_run_is_named_and_nothing_leaks(tiny_model):
    a, b = llm(tiny_model), llm(tiny_model)
    a.generate([PROMPT], GREEDY)
    plan, _ = move(a.engine, b.engine, num_ok=2)
    pool = b.engine.kv.pool
    assert [pool.get_cached_block(h) is not None for h in plan.missing] == [True] * 2 + [False] * 4
    assert all(b_.block_hash is None for b_ in plan.blocks[2:]) and pool.num_free_blocks() == pool.num_blocks
    # The four unnamed blocks went to the head of the free list, tail first as a request's are:
    # handed out before any cached block.
    assert [x.block_id for x in list(pool.free_queue)[:4]] == [x.block_id for x in reversed(plan.blocks[2:])]


def test_a_plan_pins_what_is_cached_and_asks_only_for_the_rest(tiny_model):
    a, b = llm(tiny_model), llm(tiny_model)
    a.generate([PROMPT], GREEDY)
    b.generate([PROMPT[:40] + [9] * 10], GREEDY)               # b holds the first two blocks
    plan = PlanImport(tuple(PROMPT), 6, "", "")(b.engine)
    assert plan is not None and len(plan.held) == 2 and len(plan.missing) == 4
    assert all(x.ref_cnt == 1 for x in plan.held)              # pinned against the reservation's evictions
    FinishImport(plan, 0)(b.engine)
    pool = b.engine.kv.pool
    assert pool.num_free_blocks() == pool.num_blocks and all(x.ref_cnt == 0 for x in plan.held)
    # Another namespace (salt) shares nothing: all six asked for.
    other = PlanImport(tuple(PROMPT), 6, "tenant:x", "")(b.engine)
    assert other is not None and len(other.missing) == 6 and not set(other.missing) & set(plan.missing)
    FinishImport(other, 0)(b.engine)
    assert ExportBlocks(tuple(other.missing))(a.engine)[0].num_blocks == 0
