"""CPU paged attention, option by option (issue 22): single-thread CPU time, ratios to the reference.

Shapes of the issue-22 Llama (8 query heads, 4 KV heads of 64, block size 16, fp32), over a pool
whose block tables are a random scatter (as after a while of serving), with spare blocks:

    decode      256 sequences, one new token each, context uniform in 250-450 (mean ~350)
    prefill     8 fresh prompts of 512 tokens (a 4,096-token step)
    prefix      64 chunks of 64 tokens over one shared, cached 1,024-token prefix
    prefix-decode  64 decodes over one shared 1,024-token prefix and ~100 tokens each of their own
    mixed       128 decodes (~350 context) + one 512-token chunk over 512 cached tokens

Options (each checked against the reference, max |error| in the table):

    torch-ref    kernels/reference.py: per-step gather of every context, then SDPA (bool mask)
    cpu          kernels/cpu_attention.py as the worker runs it: cascade groups and prefill chunks
                 as matrix products (csrc/gemm_attention_cpu.c), the rest one sequence at a time
                 (csrc/paged_attention_cpu.c), K/V read in place via the block table
    cpu-per-seq  the same with every sequence on the per-sequence kernel (no cascade, no
                 matrix products): the kernel before them
    sdpa-causal  fresh prefill only: gather, heads expanded, SDPA is_causal (no mask; the flash
                 CPU kernel)
    inductor     decode only, with --inductor: torch.compile of a gather-fused two-pass
                 attention (dynamic shapes); its compile time is reported

Time = the minimum over --reps runs of time.process_time() with torch.set_num_threads(1)
(the machine is shared: CPU time, never wall time). Also reported: the C kernel's build time
cold (empty cache) and its load time warm, which is what a worker start pays.

    python bench/cpu_attention.py                 # the recorded run
    python bench/cpu_attention.py --inductor      # plus torch.compile (minutes to compile here)
    python bench/cpu_attention.py --quick         # smoke run, tiny sizes
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.common import command_line, machine, markdown_table, now  # noqa: E402
from pagoda.kernels import cpu_attention  # noqa: E402
from pagoda.kernels.reference import gather_kv, paged_attention_ref, random_paged_batch  # noqa: E402

HQ, HKV, D, BS = 8, 4, 64, 16


def cases(quick: bool, gen: torch.Generator) -> dict[str, dict]:
    rng = random.Random(0)
    n = 0.125 if quick else 1.0
    k = lambda x: max(1, int(x * n))  # noqa: E731
    decode = [rng.randint(250, 450) for _ in range(k(256))]
    out = {
        "decode": random_paged_batch([1] * len(decode), decode, HQ, HKV, D, BS, generator=gen, spare_blocks=512),
        "prefill": random_paged_batch([k(512)] * 8, [k(512)] * 8, HQ, HKV, D, BS, generator=gen),
    }
    b = random_paged_batch([64] * k(64), [1088] * k(64), HQ, HKV, D, BS, generator=gen)
    b["block_tables"][:, :64] = b["block_tables"][0, :64]     # the shared prefix's blocks
    out["prefix"] = b
    own = [1024 + rng.randint(64, 136) for _ in range(k(64))]
    b = random_paged_batch([1] * len(own), own, HQ, HKV, D, BS, generator=gen)
    b["block_tables"][:, :64] = b["block_tables"][0, :64]
    out["prefix-decode"] = b
    mixed = [rng.randint(250, 450) for _ in range(k(128))]
    out["mixed"] = random_paged_batch([1] * len(mixed) + [512], mixed + [1024], HQ, HKV, D, BS, generator=gen)
    return out


def sdpa_causal(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, **_):
    """Fresh prompts only (q_len == seq_len): no mask, so SDPA may take its flash kernel."""
    out = torch.empty_like(q)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    group = q.shape[1] // k_cache.shape[2]
    for s, n in enumerate(lens):
        assert starts[s + 1] - starts[s] == n
        k = gather_kv(k_cache, block_tables[s], n).transpose(0, 1).repeat_interleave(group, 0)
        v = gather_kv(v_cache, block_tables[s], n).transpose(0, 1).repeat_interleave(group, 0)
        o = F.scaled_dot_product_attention(q[starts[s]:starts[s + 1]].transpose(0, 1), k, v,
                                           is_causal=True, scale=scale)
        out[starts[s]:starts[s + 1]] = o.transpose(0, 1)
    return out


def per_sequence(**b) -> torch.Tensor:
    """cpu_attention with no cascade groups and no matrix-product prefill."""
    saved = cpu_attention.CASCADE_MIN_TOKENS, cpu_attention.PREFILL_MIN_TOKENS
    cpu_attention.CASCADE_MIN_TOKENS = cpu_attention.PREFILL_MIN_TOKENS = 1 << 30
    try:
        return cpu_attention.paged_attention_cpu(**b)
    finally:
        cpu_attention.CASCADE_MIN_TOKENS, cpu_attention.PREFILL_MIN_TOKENS = saved


def inductor_decode():
    """Two-pass decode attention with the block gather inside the reductions, for torch.compile."""
    def attend(q, k_cache, v_cache, block_tables, seq_lens, scale: float):
        S, W = block_tables.shape
        hkv, d = k_cache.shape[2], k_cache.shape[3]
        ids = block_tables.clamp(min=0).long()
        k, v = k_cache[ids], v_cache[ids]                        # [S, W, bs, Hkv, D], fused away
        qv = q.view(S, 1, 1, hkv, -1, d)
        scores = (qv * k.unsqueeze(4)).sum(-1) * scale           # [S, W, bs, Hkv, G]
        pos = torch.arange(W * k_cache.shape[1], device=q.device).view(1, W, -1, 1, 1)
        scores = scores.masked_fill(pos >= seq_lens.view(S, 1, 1, 1, 1), float("-inf"))
        p = torch.exp(scores - scores.amax(dim=(1, 2), keepdim=True))
        p = p / p.sum(dim=(1, 2), keepdim=True)
        return (p.unsqueeze(-1) * v.unsqueeze(4)).sum(dim=(1, 2)).reshape(S, -1, d)
    fn = torch.compile(attend, dynamic=True)
    return lambda q, k_cache, v_cache, block_tables, seq_lens, scale, **_: fn(
        q, k_cache, v_cache, block_tables, seq_lens, scale)


def cpu_time_ms(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.process_time()
        fn()
        best = min(best, time.process_time() - t0)
    return best * 1e3


def build_times() -> tuple[float, float]:
    """(cold build, warm load) of the C kernel, in wall seconds, in a fresh cache directory."""
    old = os.environ.get("PAGODA_KERNEL_CACHE")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["PAGODA_KERNEL_CACHE"] = tmp
        times = []
        for _ in range(2):
            cpu_attention.load_library.cache_clear()
            t0 = time.perf_counter()
            assert cpu_attention.available()
            times.append(time.perf_counter() - t0)
    if old is None:
        del os.environ["PAGODA_KERNEL_CACHE"]
    else:
        os.environ["PAGODA_KERNEL_CACHE"] = old
    cpu_attention.load_library.cache_clear()
    return times[0], times[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes, for the smoke test")
    ap.add_argument("--reps", type=int, default=5, help="timed runs per option (minimum kept)")
    ap.add_argument("--inductor", action="store_true", help="also time torch.compile on decode")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the C kernel uses as many)")
    args = ap.parse_args()
    if args.reps < 1:
        ap.error("--reps: must be at least 1")
    if args.threads < 1:
        ap.error("--threads: must be at least 1")
    torch.set_num_threads(args.threads)
    cold, warm = build_times()
    if not cpu_attention.available():
        sys.exit("cpu_attention: the C kernel did not build here (see the warning above)")
    gen = torch.Generator().manual_seed(0)
    batches = cases(args.quick, gen)
    options: dict[str, Callable[..., torch.Tensor]] = {
        "torch-ref": paged_attention_ref, "cpu": cpu_attention.paged_attention_cpu, "cpu-per-seq": per_sequence,
        "sdpa-causal": sdpa_causal}
    compile_s = None
    if args.inductor:
        options["inductor"] = inductor_decode()
    rows = []
    for case, b in batches.items():
        ref = paged_attention_ref(**b)
        base = 1.0
        for name, fn in options.items():
            if (name == "sdpa-causal" and case != "prefill") or (name == "inductor" and case != "decode"):
                continue
            if name == "inductor":
                c0 = time.process_time()
                fn(**b)
                compile_s = time.process_time() - c0
            err = (fn(**b) - ref).abs().max().item()
            ms = cpu_time_ms(lambda: fn(**b), args.reps)
            base = ms if name == "torch-ref" else base
            kv_mb = sum(int(n) for n in b["seq_lens"].tolist()) * HKV * D * 4 * 2 / 1e6
            rows.append([case, name, ms, f"{base / ms:.2f}x", f"{err:.1e}", f"{kv_mb:.0f}"])
    print(f"Command: `{command_line()}`")
    print(f"Date: {now()}")
    print(f"Machine: {machine()}")
    print(f"Shapes: {HQ} query / {HKV} KV heads of {D}, block {BS}, fp32; {args.threads} thread(s); "
          f"min of {args.reps} runs of process_time")
    print()
    print(markdown_table(["case", "option", "CPU ms", "speed-up vs torch-ref", "max abs err", "KV MB (logical)"], rows))
    print()
    print(f"C kernel build: {cold:.2f} s cold (empty cache), {warm * 1e3:.1f} ms warm (cached .so)")
    if compile_s is not None:
        print(f"inductor first call (compile) CPU time: {compile_s:.1f} s")


if __name__ == "__main__":
    main()
