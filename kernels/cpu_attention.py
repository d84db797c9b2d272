"""The CPU attention path: paged attention that reads K/V in place from the block pool.

Two C kernels of the CPU kernels' library (kernels/cpu_lib.py: built at first use, called
through ctypes), whose work is split over torch.get_num_threads() threads of that library's
pool:

- kernels/csrc/paged_attention_cpu.c, one sequence at a time: walks each sequence's blocks
  through its block table and never gathers a context (the reference's per-step index_select
  of every sequence's blocks was a third of a CPU decode step, bench/cpu_attention.py). It
  takes decodes and short chunks, and everything with a window, soft-cap or sinks.
- kernels/csrc/gemm_attention_cpu.c, attention as matrix products in register tiles, for the
  rest of plain attention: the prefill chunks of PREFILL_MIN_TOKENS tokens or more (causal
  flash attention over the sequence's keys), and cascade groups. Sequences of a step whose
  block tables start with the same blocks (a system prompt shared through the prefix cache,
  parallel samples of one prompt), with every query token after those blocks, form a group;
  the shared keys are attended by all the group's query rows at once, and each member's own
  keys after them by one of the two kernels, which merges the two softmaxes. A group needs
  CASCADE_MIN_TOKENS query tokens over CASCADE_MIN_KEYS shared keys.

Which kernel does what is planned once per step (_plan, kept in the step's memo) and reused by
every layer. paged_attention_cpu has paged_attention_ref's signature and semantics
(kernels/reference.py) and falls back to it for what the C kernels do not take: fp8 caches,
queries and caches of different dtypes or of a dtype other than fp32, bf16 and fp16, head_dim
not a multiple of 8, non-CPU tensors, or no working C compiler (logged once). bf16 and fp16 are
read in place and summed in fp32 by paged_attention_cpu.c, and converted to fp32 as
gemm_attention_cpu.c packs them.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch

from pagoda.kernels.cpu_lib import (
    GEMM_ATTENTION_ROWS,
    GEMV_MAX_M,
    KINDS,
    QTILE,
    available,
    kernel_threads,
    load_library,
)
from pagoda.kernels.reference import paged_attention_ref

MAX_D, MAX_ROWS = 256, 256
# A group shares at least this many keys with at least this many query tokens: below, packing
# the shared keys once is not worth a second pass (set by judgement, not tuned).
CASCADE_MIN_KEYS = 64
CASCADE_MIN_TOKENS = 8
# A sequence's chunk of at least this many tokens runs as matrix products.
PREFILL_MIN_TOKENS = 16
TO_PARTIALS, FINAL, FINAL_MERGED = 0, 1, 2     # what becomes of a job's result (the C enum)


def supports(q: torch.Tensor, k_cache: torch.Tensor, sinks: torch.Tensor | None = None) -> bool:
    """Whether the C kernels take this call (else paged_attention_cpu uses the reference)."""
    hq, hkv, d = q.shape[1], k_cache.shape[2], k_cache.shape[3]
    return (q.device.type == "cpu" and k_cache.device.type == "cpu"
            and q.dtype in KINDS and k_cache.dtype == q.dtype
            and d % 8 == 0 and d <= MAX_D and hq % hkv == 0 and (hq // hkv) * QTILE <= MAX_ROWS
            and (sinks is None or sinks.device.type == "cpu") and available())


def _items(starts: np.ndarray, lens: np.ndarray, num_groups: int, seqs: np.ndarray) -> np.ndarray:
    """paged_attention_cpu.c's work items for sequences `seqs` (seq << 32 | tile << 8 | KV head
    group), the most keys first so the threads finish together. lens: the keys each sequence's
    own items read (its length, less a cascade prefix)."""
    q_lens = np.diff(starts)
    tiles = -(-q_lens[seqs] // QTILE)
    seq = np.repeat(seqs.astype(np.int64), tiles)
    first = np.repeat(np.cumsum(tiles) - tiles, tiles)
    tile = np.arange(len(seq), dtype=np.int64) - first
    # keys read by a tile ~ the last position it holds
    rows = np.minimum(QTILE, q_lens[seq] - tile * QTILE)
    cost = (lens[seq] - q_lens[seq] + tile * QTILE + rows) * rows
    order = np.argsort(-cost, kind="stable")
    seq, tile = seq[order], tile[order]
    heads = np.arange(num_groups, dtype=np.int64)
    return ((seq[:, None] << 32) | (tile[:, None] << 8) | heads[None, :]).reshape(-1)


def _groups(tables: np.ndarray, lens: np.ndarray, starts: np.ndarray, bs: int) -> list[tuple[np.ndarray, int]]:
    """The step's cascade groups as (members, shared keys). Candidates are sequences with at
    least CASCADE_MIN_KEYS keys in whole blocks before their first query token; they group by
    their first block, and a group shares the blocks that every member's table has in the same
    place, as far as every member's candidates reach. A prefill chunk alone forms no group: its
    own job reads its whole context anyway."""
    q_lens = np.diff(starts)
    full = (lens - q_lens) // bs
    cand = np.flatnonzero(full * bs >= CASCADE_MIN_KEYS)
    if cand.size == 0 or q_lens[cand].sum() < CASCADE_MIN_TOKENS:
        return []
    cand = cand[np.argsort(tables[cand, 0], kind="stable")]
    bounds = np.flatnonzero(np.diff(tables[cand, 0])) + 1
    firsts = np.concatenate(([0], bounds))
    tokens = np.add.reduceat(q_lens[cand], firsts)
    groups = []
    for i in np.flatnonzero(tokens >= CASCADE_MIN_TOKENS):
        members = cand[firsts[i]:(bounds[i] if i < len(bounds) else len(cand))]
        if len(members) == 1 and q_lens[members[0]] >= PREFILL_MIN_TOKENS:
            continue
        reach = int(full[members].min())
        rows = tables[members, :reach]
        same = (rows == rows[0]).all(axis=0)
        shared = reach if same.all() else int(np.argmin(same))
        if shared * bs >= CASCADE_MIN_KEYS:
            groups.append((members, shared * bs))
    return groups


@dataclass(frozen=True)
class GemmJobs:
    """gemm_attention_cpu.c's jobs, one array per argument of the kernel (per job j unless said)."""
    rep: np.ndarray          # int32: the sequence whose block table holds the job's keys
    klo: np.ndarray          # int32: its first key
    keys: np.ndarray         # int32: its keys, [klo, klo + keys)
    tok_off: np.ndarray      # int32 [jobs + 1]: its query tokens are toks[tok_off[j]:tok_off[j + 1]]
    pos0: np.ndarray         # int32: position of its first query token (causal), -1: a shared prefix
    mode: np.ndarray         # int32: what becomes of its result (TO_PARTIALS, FINAL, FINAL_MERGED)
    toks: np.ndarray         # int32 [query tokens]: the token rows of every job, job after job
    pack_off: np.ndarray     # int64 [jobs + 1]: where its packed keys start in the scratch space
    items: np.ndarray        # int64: work items (job << 32 | chunk << 16 | KV head)
    n_first: int             # items of the shared-prefix jobs, which run first


@dataclass
class _Plan:
    """One step's work for a layer shape, the same in every layer (kept in the step's memo)."""
    items: np.ndarray                   # paged_attention_cpu.c's items
    heads_per_item: int
    prefix: np.ndarray | None           # per sequence: its keys attended as a shared prefix
    jobs: GemmJobs | None               # gemm_attention_cpu.c's work, when it has any


def _jobs(groups: list[tuple[np.ndarray, int]], own: np.ndarray, prefix: np.ndarray, lens: np.ndarray,
          starts: np.ndarray, hq: int, hkv: int, d: int) -> GemmJobs:
    """gemm_attention_cpu.c's jobs: the groups' shared prefixes, then the own keys of the
    sequences in `own` (prefill chunks), with their items (shared jobs' first)."""
    q_lens = np.diff(starts)
    rep = [m[0] for m, _ in groups] + list(own)
    klo = [0] * len(groups) + [int(prefix[s]) for s in own]
    keys = [n for _, n in groups] + [int(lens[s] - prefix[s]) for s in own]
    pos0 = [-1] * len(groups) + [int(lens[s] - q_lens[s]) for s in own]
    mode = [TO_PARTIALS] * len(groups) + [FINAL_MERGED if prefix[s] else FINAL for s in own]
    toks = [np.concatenate([np.arange(starts[s], starts[s + 1]) for s in m]) for m, _ in groups]
    toks += [np.arange(starts[s], starts[s + 1]) for s in own]
    tok_off = np.concatenate(([0], np.cumsum([len(t) for t in toks]))).astype(np.int32)
    padded = -(-np.array(keys, dtype=np.int64) // 16) * 16     # whole 16-key panels (NR, gemm_micro.h)
    pack_off = np.concatenate(([0], np.cumsum(padded * d * 2 * hkv))).astype(np.int64)
    chunks = -(-(np.diff(tok_off).astype(np.int64) * (hq // hkv)) // GEMM_ATTENTION_ROWS)  # as item_rows()
    job = np.repeat(np.arange(len(rep), dtype=np.int64), chunks)
    chunk = np.arange(len(job), dtype=np.int64) - np.repeat(np.cumsum(chunks) - chunks, chunks)
    cost = padded[job] * np.diff(tok_off)[job] // chunks[job]
    order = np.lexsort((-cost, job >= len(groups)))     # shared jobs first, then the heaviest
    job, chunk = job[order], chunk[order]
    items = ((job[:, None] << 32) | (chunk[:, None] << 16) | np.arange(hkv, dtype=np.int64)[None, :]).reshape(-1)
    n_first = int((job < len(groups)).sum()) * hkv
    i32 = np.int32
    return GemmJobs(rep=np.array(rep, i32), klo=np.array(klo, i32), keys=np.array(keys, i32), tok_off=tok_off,
                    pos0=np.array(pos0, i32), mode=np.array(mode, i32), toks=np.concatenate(toks).astype(i32),
                    pack_off=pack_off, items=items, n_first=n_first)


def _plan(tables: torch.Tensor, lens: np.ndarray, starts: np.ndarray, bs: int, hq: int, hkv: int, d: int,
          threads: int, gemm: bool, heads_per_item: int | None) -> _Plan:
    q_lens = np.diff(starts)
    groups = _groups(tables.numpy(), lens, starts, bs) if gemm else []
    own = np.flatnonzero(q_lens >= PREFILL_MIN_TOKENS) if gemm else np.zeros(0, np.int64)
    prefix = np.zeros(len(lens), dtype=np.int32)
    for members, shared in groups:
        prefix[members] = shared
    rest = np.setdiff1d(np.arange(len(lens)), own)
    if heads_per_item is None:
        tiles = int((-(-q_lens[rest] // QTILE)).sum())
        fits = hq * QTILE <= MAX_ROWS
        heads_per_item = hkv if fits and tiles >= 4 * threads else 1
    items = _items(starts, lens - prefix, hkv // heads_per_item, rest)
    jobs = _jobs(groups, own, prefix, lens, starts, hq, hkv, d) if groups or own.size else None
    return _Plan(items, heads_per_item, prefix if groups else None, jobs)


def _small_plan(lens: list[int], starts: list[int], hq: int, hkv: int, threads: int,
                heads_per_item: int | None) -> _Plan:
    """_plan of a step with fewer than CASCADE_MIN_TOKENS query tokens (a decode of a few
    sequences): no cascade group can form and no chunk is a prefill, so the plan is
    paged_attention_cpu.c's items alone, one tile per sequence: the same items in the same order
    as _items gives (the most keys first, ties in sequence order), without its numpy passes."""
    q_lens = [b - a for a, b in zip(starts, starts[1:])]
    if heads_per_item is None:
        tiles = sum(1 for q in q_lens if q)
        heads_per_item = hkv if hq * QTILE <= MAX_ROWS and tiles >= 4 * threads else 1
    order = sorted((s for s, q in enumerate(q_lens) if q), key=lambda s: -(lens[s] * q_lens[s]))
    items = np.array([s << 32 | h for s in order for h in range(hkv // heads_per_item)], dtype=np.int64)
    return _Plan(items, heads_per_item, None, None)


def step_plan(block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, hq: int,
              hkv: int, d: int, bs: int, threads: int, gemm: bool, heads_per_item: int | None = None,
              memo: dict | None = None) -> tuple[_Plan, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step's work for a layer shape (made once per step when `memo` is the step's memo), with
    the block tables, lengths and query starts as the kernels read them (int32, contiguous).
    gemm: whether plain attention may run as matrix products (gemm_attention_cpu.c)."""
    tables = block_tables if block_tables.dtype == torch.int32 and block_tables.stride(-1) == 1 \
        else block_tables.to(torch.int32).contiguous()
    lens_t = seq_lens.to(torch.int32).contiguous()
    starts_t = query_start_loc.to(torch.int32).contiguous()
    key = ("cpu_attention", hq, hkv, d, bs, threads, gemm, heads_per_item)
    plan = memo.get(key) if memo is not None else None
    if plan is None:
        if lens_t.shape[0] < CASCADE_MIN_TOKENS and (starts := starts_t.tolist())[-1] < CASCADE_MIN_TOKENS:
            plan = _small_plan(lens_t.tolist(), starts, hq, hkv, threads, heads_per_item)
        else:
            starts_np, lens_np = starts_t.numpy().astype(np.int64), lens_t.numpy().astype(np.int64)
            plan = _plan(tables, lens_np, starts_np, bs, hq, hkv, d, threads, gemm, heads_per_item)
        if memo is not None:
            memo[key] = plan
    return plan, tables, lens_t, starts_t


class _Scratch(threading.local):
    buf: torch.Tensor | None = None


_scratch = _Scratch()


def _scratch_floats(n: int) -> torch.Tensor:
    """n floats of this thread's reusable work space (fresh large buffers would page-fault on
    every layer)."""
    if _scratch.buf is None or _scratch.buf.numel() < n:
        _scratch.buf = torch.empty(max(n, 2 * (0 if _scratch.buf is None else _scratch.buf.numel())),
                                   dtype=torch.float32)
    return _scratch.buf


def paged_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        query_start_loc: torch.Tensor, scale: float,
                        out: torch.Tensor | None = None, *, max_seq_len: int | None = None,
                        sliding_window: int | None = None, softcap: float | None = None,
                        sinks: torch.Tensor | None = None, k_scale: float = 1.0,
                        v_scale: float = 1.0, heads_per_item: int | None = None,
                        memo: dict | None = None) -> torch.Tensor:
    """paged_attention_ref's contract, computed in place over the pool (see the module doc).

    heads_per_item: KV heads one work item of paged_attention_cpu.c covers (default: all of
    them, which reads each block's heads as one contiguous run, unless that leaves too few items
    for the threads). memo: a dict that lives as long as the step (AttentionMetadata.memo): the
    step's plan is made by the first layer and reused by the others."""
    if not supports(q, k_cache, sinks) or v_cache.dtype != k_cache.dtype or (out is not None and out.dtype != q.dtype):
        return paged_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                   scale, out, max_seq_len=max_seq_len, sliding_window=sliding_window,
                                   softcap=softcap, sinks=sinks, k_scale=k_scale, v_scale=v_scale)
    if out is None:
        out = torch.empty_like(q)
    if q.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("q/out: the head dimension must be contiguous")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache/v_cache: the head dimension must be contiguous")
    hq, hkv, d, bs = q.shape[1], k_cache.shape[2], k_cache.shape[3], k_cache.shape[1]
    threads = kernel_threads()
    # Matrix products only for plain attention: no window, cap or sinks (16-bit pools and queries
    # become fp32 as gemm_attention_cpu.c packs them).
    gemm = not (sliding_window or softcap or sinks is not None) and d % 16 == 0
    plan, tables, lens_t, starts_t = step_plan(block_tables, seq_lens, query_start_loc, hq, hkv, d, bs, threads,
                                               gemm, heads_per_item, memo)
    lib = load_library()
    assert lib is not None      # supports() checked it
    part_o = part_ml = 0
    if plan.jobs is not None:
        jobs = plan.jobs
        work = lib.gemm_attention_work_floats(d)
        t = q.shape[0] if plan.prefix is not None else 0
        packed = int(jobs.pack_off[-1])
        space = _scratch_floats(packed + threads * work + t * hq * (d + 2))
        part_o = space.data_ptr() + 4 * (packed + threads * work)
        part_ml = part_o + 4 * t * hq * d
        rc = lib.gemm_attention_cpu(
            q.data_ptr(), q.stride(0), q.stride(1), out.data_ptr(), out.stride(0), out.stride(1),
            k_cache.data_ptr(), *k_cache.stride()[:3], v_cache.data_ptr(), *v_cache.stride()[:3],
            tables.data_ptr(), tables.stride(0), hq, hkv, d, bs, float(scale), len(jobs.rep), jobs.rep.ctypes.data,
            jobs.klo.ctypes.data, jobs.keys.ctypes.data, jobs.tok_off.ctypes.data, jobs.pos0.ctypes.data,
            jobs.mode.ctypes.data, jobs.toks.ctypes.data, jobs.pack_off.ctypes.data, part_o, part_ml,
            space.data_ptr(), work, jobs.items.ctypes.data, jobs.n_first, len(jobs.items), KINDS[q.dtype], threads)
        if rc:
            raise RuntimeError(f"gemm_attention_cpu: kernel refused the shapes (code {rc})")
    if len(plan.items):
        sinks_f = None if sinks is None else sinks.detach().float().contiguous()
        rc = lib.paged_attention_cpu(
            q.data_ptr(), q.stride(0), q.stride(1), out.data_ptr(), out.stride(0), out.stride(1),
            k_cache.data_ptr(), *k_cache.stride()[:3], v_cache.data_ptr(), *v_cache.stride()[:3],
            tables.data_ptr(), tables.stride(0), lens_t.data_ptr(), starts_t.data_ptr(),
            None if sinks_f is None else sinks_f.data_ptr(),
            None if plan.prefix is None else plan.prefix.ctypes.data, part_o or None, part_ml or None,
            hq, hkv, d, bs, int(sliding_window or 0), float(scale), float(softcap or 0.0),
            plan.heads_per_item, plan.items.ctypes.data, len(plan.items), KINDS[q.dtype], threads,
            # a step of a few tokens keeps the pool's threads awake through it (cpu_lib.py)
            int(q.shape[0] <= GEMV_MAX_M))
        if rc:
            raise RuntimeError(f"paged_attention_cpu: kernel refused the shapes (code {rc})")
    return out


# PagedAttention passes its step's memo to attention functions that take one.
paged_attention_cpu.takes_memo = True  # type: ignore[attr-defined]
