"""The runner's persistent batch: rows survive between steps, leaving rows are filled by the last
one, and each step's flat inputs equal the ones built the plain way from whole requests."""
import random

import numpy as np
import pytest
import torch

from pagoda.gpu_worker.core.outputs import NewRequest, ScheduledRequest, SchedulerOutput
from pagoda.gpu_worker.core.sampling_params import SamplingParams
from pagoda.gpu_worker.runner.input_batch import InputBatch

BS, V = 4, 50


def make(rows=6):
    return InputBatch(rows, 64, 256, BS, V, [2], torch.device("cpu"))


def plain_inputs(reqs, sched):
    """The reference: flatten whole requests one by one, as a list-based runner would."""
    ids, pos, slots, lens, qsl = [], [], [], [], [0]
    for s in sched:
        r = reqs[s.req_id]
        for p in range(s.start_pos, s.start_pos + s.num_tokens):
            ids.append(r["tokens"][p])
            pos.append(p)
            slots.append(r["blocks"][p // BS] * BS + p % BS)
        lens.append(s.start_pos + s.num_tokens)
        qsl.append(qsl[-1] + s.num_tokens)
    return ids, pos, slots, lens, qsl


def test_rows_stay_dense_and_follow_their_requests():
    b = make()
    sp = SamplingParams()
    b.update(SchedulerOutput([], new=[NewRequest(r, [i + 10] * (i + 1), i + 1, sp, [i]) for i, r in enumerate("abcd")]))
    assert b.req_ids == ["a", "b", "c", "d"]
    b.update(SchedulerOutput([], finished_req_ids={"b"}))
    assert b.req_ids == ["a", "d", "c"] and b.row_of == {"a": 0, "d": 1, "c": 2}
    assert b.token_ids[1, :4].tolist() == [13] * 4 and b.num_tokens[1] == 4 and b.block_table[1, 0] == 3
    b.update(SchedulerOutput([], finished_req_ids={"c", "a", "unknown"}))
    assert b.req_ids == ["d"] and b.row_of == {"d": 0} and b.token_ids[0, :4].tolist() == [13] * 4


@pytest.mark.parametrize("pipelined", [False, True])
def test_steps_equal_plain_flattening_under_random_churn(pipelined):
    """pipelined: each step is built before the previous step's tokens land (async scheduling);
    a row with a token in flight computes just that token, read from the previous draw."""
    rng = random.Random(0)
    b = make(rows=8)
    reqs: dict = {}
    free_blocks = list(range(200))
    serial = 0
    in_flight = None     # (request ids, positions, tokens, draw) of the last step, not landed
    fed = 0
    for _ in range(80):
        finished = {r for r in reqs if rng.random() < 0.2}
        new = []
        for r in finished:
            free_blocks += reqs.pop(r)["blocks"]
        while len(reqs) < 8 and rng.random() < 0.7:
            serial += 1
            n = rng.randrange(1, 20)
            rid = f"r{serial}"
            reqs[rid] = {"tokens": [rng.randrange(V) for _ in range(n)], "computed": 0, "blocks": [],
                         "new": True, "pending": 0}
        sched = []
        for rid, r in reqs.items():
            known = len(r["tokens"]) + r["pending"]
            if known == r["computed"] or (r["pending"] and rng.random() < 0.3):
                continue    # nothing to compute, or left out of this step
            n = 1 if r["pending"] else min(known - r["computed"], rng.randrange(1, 8))
            need = -(-(r["computed"] + n) // BS) - len(r["blocks"])
            added = [free_blocks.pop(rng.randrange(len(free_blocks))) for _ in range(need)]
            r["blocks"] += added
            if r.pop("new", False):
                new.append(NewRequest(rid, list(r["tokens"]), len(r["tokens"]), SamplingParams(), list(r["blocks"])))
                added = []
            sched.append(ScheduledRequest(rid, n, r["computed"], r["computed"] + n == known, added))
        rng.shuffle(sched)
        b.update(SchedulerOutput(sched, new=new, finished_req_ids=finished))
        got = b.prepare(sched) if sched else None
        if in_flight is not None:    # the previous step's tokens land after this one is built
            rids, positions, tokens, draw = in_flight
            b.fill_sampled(rids, positions, tokens)
            for rid, t in zip(rids, tokens):
                if rid in reqs:
                    reqs[rid]["tokens"].append(t)
                    reqs[rid]["pending"] -= 1
            in_flight = None
        if got is None:
            continue
        ids, pos, slots, lens, qsl = plain_inputs(reqs, sched)
        inputs = got.input_ids.clone()
        if got.in_flight is not None:
            dst, src = got.in_flight
            inputs[dst] = draw[src]
            fed += len(dst)
        assert inputs.tolist() == ids and got.positions.tolist() == pos
        assert got.meta.slot_mapping.tolist() == slots and got.meta.seq_lens.tolist() == lens
        assert got.meta.query_start_loc.tolist() == qsl
        for i, s in enumerate(sched):
            row = got.meta.block_tables[i].tolist()
            assert row[:len(reqs[s.req_id]["blocks"])] == reqs[s.req_id]["blocks"][:len(row)]
        sampling = [s.req_id for s in sched if s.sample]
        assert got.req_ids == sampling
        assert got.logits_indices.tolist() == [qsl[i + 1] - 1 for i, s in enumerate(sched) if s.sample]
        tokens = [rng.randrange(V) for _ in sampling]
        positions = b.mark_sampled(got.sample_rows)
        for s in sched:
            reqs[s.req_id]["computed"] += s.num_tokens
        if pipelined:
            for rid in sampling:
                reqs[rid]["pending"] += 1
            in_flight = (sampling, positions, tokens, torch.tensor(tokens))
            continue
        b.fill_sampled(sampling, positions, tokens)
        for rid, t in zip(sampling, tokens):
            reqs[rid]["tokens"].append(t)
        for rid, r in reqs.items():
            row = b.row_of[rid]
            assert b.token_ids[row, :b.num_tokens[row]].tolist() == r["tokens"]
            assert np.array_equal(b.block_table[row, :b.num_blocks[row]], r["blocks"])
    assert (fed > 50) if pipelined else (fed == 0)


def test_a_row_with_a_token_in_flight_must_compute_just_that_token():
    b = make()
    b.update(SchedulerOutput([], new=[NewRequest("a", [1, 2, 3], 3, SamplingParams(), [0])]))
    got = b.prepare([ScheduledRequest("a", 3, 0, True, [])])
    assert b.mark_sampled(got.sample_rows).tolist() == [3]
    with pytest.raises(ValueError, match="in flight"):
        b.prepare([ScheduledRequest("a", 2, 2, True, [])])
    got = b.prepare([ScheduledRequest("a", 1, 3, True, [])])
    assert [t.tolist() for t in got.in_flight] == [[0], [0]]


def test_finish_flags_check_stop_ids_min_tokens_and_length_per_row():
    """The vectorised stop-token and length checks: a stop id (or EOS 2 unless ignored) ends a
    row only once min_tokens are out; max_tokens and max_model_len (64 here) end it by length;
    the flags follow rows that move when another leaves."""
    from pagoda.gpu_worker.core.stop import LENGTH, STOP_TOKEN
    b = make()
    reqs = {
        "eos": SamplingParams(max_tokens=10),
        "eos-ignored": SamplingParams(max_tokens=10, ignore_eos=True, stop_token_ids=[7]),
        "held": SamplingParams(max_tokens=10, min_tokens=2),
        "short": SamplingParams(max_tokens=1),
        "long-prompt": SamplingParams(max_tokens=10),
        "gone": SamplingParams(max_tokens=10),
    }
    prompts = {r: [5] * (63 if r == "long-prompt" else 3) for r in reqs}
    b.update(SchedulerOutput([], new=[NewRequest(r, prompts[r], len(prompts[r]), sp, list(range(16)))
                                      for r, sp in reqs.items()]))
    b.update(SchedulerOutput([], finished_req_ids={"gone"}))     # a row moves
    names = ["eos", "eos-ignored", "held", "short", "long-prompt"]
    rows = np.array([b.row_of[r] for r in names])

    def sample(names, rows, tokens):
        return b.fill_sampled(names, b.mark_sampled(rows), tokens).tolist()

    assert sample(names, rows, [2, 2, 2, 9, 9]) == [STOP_TOKEN, 0, 0, LENGTH, LENGTH]   # 64 tokens = max_model_len
    # stop id despite ignore_eos; min_tokens out
    assert sample(names[1:3], rows[1:3], [7, 2]) == [STOP_TOKEN, STOP_TOKEN]
    assert b.num_tokens[rows].tolist() == [4, 5, 5, 4, 64]
    # A token whose row has left (its request ended meanwhile) is dropped: no flag, no write.
    positions = b.mark_sampled(rows[:1])
    b.update(SchedulerOutput([], finished_req_ids={"eos"}))
    assert b.fill_sampled(["eos"], positions, [2]).tolist() == [0]
