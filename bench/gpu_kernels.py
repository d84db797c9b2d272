"""Paged-attention kernel benchmark: correctness against an fp32 reference, then timings.

On a GPU (made for one H200 run of a few minutes):
  python bench/gpu_kernels.py --quick        # reduced sweep
  python bench/gpu_kernels.py                # full sweep
Llama-3-8B attention shapes (32 query heads, 8 KV heads, head dim 128, bf16). The KV pool is
several GiB (far beyond L2) and every block table is a random scatter across it; decode lengths
are ragged. Our kernels are timed against torch SDPA on contiguous KV, gather-then-SDPA, and
FlexAttention where it compiles, with triton.testing.do_bench (median of CUDA-event timings,
L2 flushed between runs). Bandwidth is the K/V bytes the attention must read, over time; the
percentage is of the H200's 4.3 TB/s. A step-level figure times one decode step of a
Llama-3-8B-shaped stack with random weights, per attention backend and with/without the fused
small ops. Output: markdown tables on stdout (and --out FILE).

On CPU: TRITON_INTERPRET=1 python bench/gpu_kernels.py --cpu  (toy sizes, correctness only; every
code path of the sweep runs once so a GPU run does not fail on a typo).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PEAK_BW = 4.3e12  # H200 HBM3e, bytes/s
LINES: list[str] = []


def emit(line: str = "") -> None:
    print(line, flush=True)
    LINES.append(line)


def table(header: list[str], rows: list[list]) -> None:
    emit("| " + " | ".join(header) + " |")
    emit("|" + "|".join("---" for _ in header) + "|")
    for r in rows:
        emit("| " + " | ".join(str(c) for c in r) + " |")
    emit()


class Bench:
    """Sizes, device, timer and the shared KV pool for one run."""

    def __init__(self, cpu: bool, quick: bool):
        import torch
        self.torch = torch
        self.cpu = cpu
        self.device = "cpu" if cpu else "cuda"
        self.dtype = torch.float32 if cpu else torch.bfloat16
        if cpu:  # toy Llama-3-8B ratios: GQA 4
            self.hq, self.hkv, self.d, self.bs = 8, 2, 64, 16
        else:
            self.hq, self.hkv, self.d, self.bs = 32, 8, 128, 16
        self.quick = quick
        self.flex = True
        self.t0, self.budget_s = time.time(), 1e9
        self.gen = torch.Generator(device="cpu").manual_seed(0)
        self.pool_tokens = 0
        self.k_pool = self.v_pool = None

    def flex_allowed(self) -> bool:
        """FlexAttention compiles per shape (tens of seconds): only while half the budget is left."""
        return time.time() - self.t0 < 0.5 * self.budget_s

    # -- timing ---------------------------------------------------------------------------------
    def time_us(self, fn) -> float:
        if self.cpu:  # interpreter timings mean nothing; run once for the code path
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e6
        import triton.testing
        return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median") * 1e3

    # -- batches --------------------------------------------------------------------------------
    def ensure_pool(self, tokens: int) -> None:
        """One pool for the whole sweep, at least 4 GiB on a GPU so no config fits in L2."""
        torch = self.torch
        per_token = self.hkv * self.d * 2 * 2  # K and V, 2 bytes each
        floor = 1 if self.cpu else (4 << 30) // per_token
        want = max(tokens + 64 * self.bs, floor)
        if want <= self.pool_tokens:
            return
        self.k_pool = self.v_pool = None
        blocks = -(-want // self.bs)
        shape = (blocks, self.bs, self.hkv, self.d)
        self.k_pool = torch.randn(shape, dtype=self.dtype, device=self.device)
        self.v_pool = torch.randn(shape, dtype=self.dtype, device=self.device)
        self.pool_tokens = blocks * self.bs

    def batch(self, q_lens: list[int], seq_lens: list[int], dtype=None, own_pool: bool = False) -> dict:
        """A step whose sequences own random, scattered blocks of the shared pool (or, with
        own_pool, of a pool just big enough for it: the step benchmark needs one per layer)."""
        torch = self.torch
        nblocks = [-(-s // self.bs) for s in seq_lens]
        if own_pool:
            shape = (sum(nblocks) + 8, self.bs, self.hkv, self.d)
            k_pool = torch.randn(shape, dtype=self.dtype, device=self.device)
            v_pool = torch.randn(shape, dtype=self.dtype, device=self.device)
        else:
            self.ensure_pool(sum(seq_lens))
            k_pool, v_pool = self.k_pool, self.v_pool
        perm = torch.randperm(k_pool.shape[0], generator=self.gen)[:sum(nblocks)].to(torch.int32)
        table = torch.zeros(len(seq_lens), max(nblocks), dtype=torch.int32)
        at = 0
        for i, n in enumerate(nblocks):
            table[i, :n] = perm[at:at + n]
            at += n
        starts = [0]
        for q in q_lens:
            starts.append(starts[-1] + q)
        dev = self.device
        q = torch.randn(starts[-1], self.hq, self.d, generator=self.gen).to(dev, dtype or self.dtype)
        return dict(q=q, k_cache=k_pool, v_cache=v_pool, block_tables=table.to(dev),
                    seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
                    query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
                    scale=self.d ** -0.5)

    def ragged(self, batch: int, ctx: int) -> list[int]:
        """Lengths in [ctx/2, ctx], the first exactly ctx: mixed sequence ages in one batch."""
        torch = self.torch
        lens = torch.randint(ctx // 2, ctx + 1, (batch,), generator=self.gen).tolist()
        lens[0] = ctx
        return lens


# ---- baselines ------------------------------------------------------------------------------

def dense_kv(b: dict, seq_lens: list[int]):
    """[B, Hkv, Lmax, D] contiguous K and V plus a [B, 1, 1, Lmax] validity mask (built untimed)."""
    import torch

    from pagoda.kernels.reference import gather_kv
    lmax = max(seq_lens)
    ks, vs = [], []
    for i, n in enumerate(seq_lens):
        pad = (0, 0, 0, 0, 0, lmax - n)
        ks.append(torch.nn.functional.pad(gather_kv(b["k_cache"], b["block_tables"][i], n), pad))
        vs.append(torch.nn.functional.pad(gather_kv(b["v_cache"], b["block_tables"][i], n), pad))
    k = torch.stack(ks).transpose(1, 2).contiguous()
    v = torch.stack(vs).transpose(1, 2).contiguous()
    lens = torch.tensor(seq_lens, device=k.device)
    valid = torch.arange(lmax, device=k.device)[None, :] < lens[:, None]
    return k, v, valid


def sdpa_decode(q4, k, v, mask, scale):
    import torch.nn.functional as F
    return F.scaled_dot_product_attention(q4, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def gather_then_sdpa_decode(b: dict, lmax_blocks: int):
    """Gather every sequence's blocks into one padded tensor, then batched SDPA (all timed)."""
    import torch.nn.functional as F
    kc, vc, bt = b["k_cache"], b["v_cache"], b["block_tables"][:, :lmax_blocks].long()
    nseq = bt.shape[0]
    k = kc[bt].reshape(nseq, -1, kc.shape[2], kc.shape[3]).transpose(1, 2)
    v = vc[bt].reshape(nseq, -1, vc.shape[2], vc.shape[3]).transpose(1, 2)
    valid = (b["_arange"][None, :k.shape[2]] < b["seq_lens"][:, None])[:, None, None, :]
    q4 = b["q"].view(nseq, 1, -1, b["q"].shape[-1]).transpose(1, 2)
    return F.scaled_dot_product_attention(q4, k, v, attn_mask=valid, scale=b["scale"], enable_gqa=True)


_FLEX = {}


def flex_decode(q4, k, v, seq_lens_t, scale):
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    if "fn" not in _FLEX:
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)

    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx < seq_lens_t[b]

    bm = create_block_mask(mask_mod, q4.shape[0], None, q4.shape[2], k.shape[2], device=q4.device)
    return lambda: _FLEX["fn"](q4, k, v, block_mask=bm, scale=scale, enable_gqa=True)


def flex_prefill(q4, k, v, offset: int, scale):
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    if "fn" not in _FLEX:
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)

    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + offset

    bm = create_block_mask(mask_mod, None, None, q4.shape[2], k.shape[2], device=q4.device)
    return lambda: _FLEX["fn"](q4, k, v, block_mask=bm, scale=scale, enable_gqa=True)


def attempt(fn):
    """Run a baseline; a failure (unsupported shape, compile error) is shown, not fatal."""
    try:
        return fn(), ""
    except Exception as e:  # noqa: BLE001 - any backend failure just marks the cell
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:60]}" if str(e) else type(e).__name__


def fmt_time(us, nbytes) -> list[str]:
    if us is None:
        return ["n/a", "", ""]
    bw = nbytes / (us * 1e-6)
    return [f"{us:.1f}", f"{bw / 1e9:.0f}", f"{100 * bw / PEAK_BW:.0f}%"]


# ---- sections -------------------------------------------------------------------------------

def check_correctness(B: Bench) -> bool:
    """Each kernel variant against the fp32 torch reference on Llama-shaped heads."""
    torch = B.torch
    from pagoda.kernels.reference import paged_attention_ref, write_kv_cache_ref
    from pagoda.kernels.triton_attention import paged_attention_triton
    from pagoda.kernels.triton_cache import write_kv_cache_triton
    small = B.cpu
    cases = {
        "decode": ([1] * 4, [1, 16, 100, 333] if small else [1, 16, 3000, 9001]),
        "decode split-KV x8": ([1] * 3, [5, 64, 300] if small else [5, 4096, 20000]),
        "prefill over prefix": ([40, 16], [100, 16] if small else [1500, 512]),
        "mixed": ([1, 1, 24, 1], [50, 17, 80, 1] if small else [2000, 17, 700, 1]),
    }
    rows, ok = [], True
    for name, (q_lens, seq_lens) in cases.items():
        b = B.batch(q_lens, seq_lens)
        ref = paged_attention_ref(**{**b, "q": b["q"].float(), "k_cache": b["k_cache"], "v_cache": b["v_cache"]})
        out = torch.full_like(b["q"], float("nan"))
        paged_attention_triton(**b, out=out, num_splits=8 if "split" in name else None)
        err = (out.float() - ref.float()).abs().max().item()
        tol = 2e-5 if B.dtype == torch.float32 else 2e-2
        ok &= err <= tol and not out.isnan().any().item()
        rows.append([name, str(b["q"].dtype).replace("torch.", ""), f"{err:.2e}", "ok" if err <= tol else "FAIL"])
    # cache write, with skipped slots
    key = torch.randn(33, B.hkv, B.d, generator=B.gen).to(B.device, B.dtype)
    slots = torch.randperm(64 * B.bs, generator=B.gen)[:33].to(B.device)
    slots[::5] = -1
    kc = torch.zeros(64, B.bs, B.hkv, B.d, dtype=B.dtype, device=B.device)
    kr, vc, vr = kc.clone(), kc.clone(), kc.clone()
    write_kv_cache_triton(key, key, kc, vc, slots)
    write_kv_cache_ref(key, key, kr, vr, slots)
    same = torch.equal(kc, kr) and torch.equal(vc, vr)
    ok &= same
    rows.append(["cache write", str(B.dtype).replace("torch.", ""), "exact" if same else "differs", "ok" if same else "FAIL"])
    del kc, kr, vc, vr
    emit("## Correctness against the fp32 reference")
    table(["variant", "dtype", "max abs err", ""], rows)
    return ok


def decode_sweep(B: Bench) -> None:
    torch = B.torch
    from pagoda.kernels.triton_attention import _choose_splits, paged_attention_triton
    if B.cpu:
        grid = [(1, 40), (3, 70)]
    elif B.quick:
        grid = [(b, c) for b in (1, 16, 64, 256) for c in (512, 4096, 32768) if b * c <= 2 << 20]
    else:
        grid = [(b, c) for b in (1, 4, 16, 32, 64, 128, 256) for c in (512, 2048, 8192, 32768)
                if b * c <= 4 << 20]
    flex_ok = {(1, 4096), (64, 4096)} if B.quick else {(1, 2048), (32, 2048), (64, 8192), (4, 32768), (256, 2048)}
    if B.cpu or not B.flex:
        flex_ok = set()
    rows = []
    for batch, ctx in grid:
        lens = B.ragged(batch, ctx)
        b = B.batch([1] * batch, lens)
        nbytes = sum(lens) * B.hkv * B.d * b["k_cache"].element_size() * 2
        splits = _choose_splits(b["q"], batch, B.hkv, 64, True, None)
        out = torch.empty_like(b["q"])
        ours = B.time_us(lambda: paged_attention_triton(**b, out=out))
        ours1 = B.time_us(lambda: paged_attention_triton(**b, out=out, num_splits=1)) if splits > 1 else ours
        k, v, valid = dense_kv(b, lens)
        q4 = b["q"].view(batch, 1, B.hq, B.d).transpose(1, 2)
        mask = valid[:, None, None, :]
        dense, err_d = attempt(lambda: B.time_us(lambda: sdpa_decode(q4, k, v, mask, b["scale"])))
        b["_arange"] = torch.arange(max(lens) + B.bs, device=B.device)
        nblk = -(-max(lens) // B.bs)
        gath, err_g = attempt(lambda: B.time_us(lambda: gather_then_sdpa_decode(b, nblk)))
        flex, err_f = (None, "skipped")
        if (batch, ctx) in flex_ok and B.flex_allowed():
            flex, err_f = attempt(lambda: B.time_us(flex_decode(q4, k, v, b["seq_lens"], b["scale"])))
        k = v = None
        rows.append([batch, ctx, sum(lens) // batch, splits, *fmt_time(ours, nbytes), f"{ours1:.1f}",
                     *fmt_time(dense, nbytes)[:2], *fmt_time(gath, nbytes)[:2],
                     f"{flex:.1f}" if flex else ("n/a" if err_f == "skipped" else f"n/a ({err_f})")])
        for e in (err_d, err_g):
            if e:
                emit(f"<!-- batch {batch} ctx {ctx}: {e} -->")
    emit("## Decode (one query token per sequence, ragged contexts, scattered blocks)")
    emit("Times in microseconds; GB/s counts the K/V bytes read; % of 4.3 TB/s.")
    table(["batch", "max ctx", "mean ctx", "splits", "ours us", "ours GB/s", "ours %BW", "ours no-split us",
           "SDPA contig us", "GB/s", "gather+SDPA us", "GB/s", "Flex us"], rows)


def prefill_sweep(B: Bench) -> None:
    torch = B.torch
    import torch.nn.functional as F

    from pagoda.kernels.reference import gather_kv
    from pagoda.kernels.triton_attention import paged_attention_triton
    if B.cpu:
        grid = [(1, 32, 32), (2, 16, 80)]
    elif B.quick:
        grid = [(1, 2048, 2048), (4, 2048, 2048), (1, 512, 8192), (1, 8192, 8192)]
    else:
        grid = [(1, 512, 512), (8, 1024, 1024), (1, 2048, 2048), (4, 2048, 2048), (2, 4096, 4096),
                (1, 8192, 8192), (1, 512, 8192), (16, 512, 4096), (1, 2048, 16384)]
    flex_ok = set() if B.cpu or not B.flex else {grid[0]}
    rows = []
    for batch, qlen, ctx in grid:
        b = B.batch([qlen] * batch, [ctx] * batch)
        out = torch.empty_like(b["q"])
        ours = B.time_us(lambda: paged_attention_triton(**b, out=out))
        offset = ctx - qlen
        flops = 4 * batch * B.hq * B.d * qlen * (offset + (qlen + 1) / 2)
        k = torch.stack([gather_kv(b["k_cache"], b["block_tables"][i], ctx) for i in range(batch)]).transpose(1, 2).contiguous()
        v = torch.stack([gather_kv(b["v_cache"], b["block_tables"][i], ctx) for i in range(batch)]).transpose(1, 2).contiguous()
        q4 = b["q"].view(batch, qlen, B.hq, B.d).transpose(1, 2)
        causal = torch.arange(ctx, device=B.device)[None, :] <= torch.arange(offset, ctx, device=B.device)[:, None]

        def dense():
            if offset == 0:
                return F.scaled_dot_product_attention(q4, k, v, is_causal=True, scale=b["scale"], enable_gqa=True)
            return F.scaled_dot_product_attention(q4, k, v, attn_mask=causal, scale=b["scale"], enable_gqa=True)

        nblk = ctx // B.bs if ctx % B.bs == 0 else ctx // B.bs + 1

        def gathered():
            bt = b["block_tables"][:, :nblk].long()
            kg = b["k_cache"][bt].reshape(batch, -1, B.hkv, B.d)[:, :ctx].transpose(1, 2)
            vg = b["v_cache"][bt].reshape(batch, -1, B.hkv, B.d)[:, :ctx].transpose(1, 2)
            return F.scaled_dot_product_attention(q4, kg, vg, attn_mask=causal, scale=b["scale"], enable_gqa=True)

        t_dense, _ = attempt(lambda: B.time_us(dense))
        t_gath, _ = attempt(lambda: B.time_us(gathered))
        t_flex, err_f = (None, "skipped")
        if (batch, qlen, ctx) in flex_ok and B.flex_allowed():
            t_flex, err_f = attempt(lambda: B.time_us(flex_prefill(q4, k, v, offset, b["scale"])))
        k = v = None

        def tf(us):
            return "n/a" if us is None else f"{us:.1f} ({flops / (us * 1e-6) / 1e12:.0f})"

        rows.append([batch, qlen, ctx, tf(ours), tf(t_dense), tf(t_gath),
                     tf(t_flex) if t_flex else ("n/a" if err_f == "skipped" else f"n/a ({err_f})")])
    emit("## Prefill (chunks of q tokens at the end of ctx, causal; scattered blocks)")
    emit("Microseconds (TFLOP/s).")
    table(["batch", "q tokens", "ctx", "ours", "SDPA contig", "gather+SDPA", "Flex"], rows)


def fused_ops(B: Bench) -> None:
    torch = B.torch
    from pagoda.kernels.reference import add_rms_norm_ref, rotary_ref
    from pagoda.kernels.triton_norm import add_rms_norm_triton, rotary_triton
    hidden = 256 if B.cpu else 4096
    rows = []
    for t in ([3] if B.cpu else [1, 64, 256, 2048, 8192]):
        x = torch.randn(t, hidden, device=B.device, dtype=B.dtype)
        r = torch.randn_like(x)
        w = torch.ones(hidden, device=B.device, dtype=B.dtype)
        a = B.time_us(lambda: add_rms_norm_triton(x, r, w, 1e-5))
        b = B.time_us(lambda: add_rms_norm_ref(x, r, w, 1e-5))
        qkv = torch.randn(t, B.hq + 2 * B.hkv, B.d, device=B.device, dtype=B.dtype)
        q, k = qkv[:, :B.hq], qkv[:, B.hq:B.hq + B.hkv]
        pos = torch.arange(t, device=B.device)
        cos = torch.randn(max(t, 16), B.d, device=B.device)
        sin = torch.randn_like(cos)
        c = B.time_us(lambda: rotary_triton(pos, q, k, cos, sin))
        d = B.time_us(lambda: rotary_ref(pos, q, k, cos, sin))
        rows.append([t, f"{a:.1f}", f"{b:.1f}", f"{c:.1f}", f"{d:.1f}"])
    emit("## Fused small ops (microseconds; hidden 4096, 32/8 heads x 128)")
    table(["tokens", "add+RMSNorm fused", "add+RMSNorm torch", "rotary fused", "rotary torch"], rows)


class Stack:
    """A Llama-3-8B-shaped decoder with random weights over the paged pool, for step timings."""

    def __init__(self, B: Bench, layers: int, hidden: int, inter: int, vocab: int):
        torch = B.torch
        self.B, self.layers = B, layers
        dev, dt = B.device, B.dtype
        g = torch.Generator(device=dev).manual_seed(1)

        def w(*shape):
            return (torch.randn(*shape, device=dev, dtype=dt, generator=g) * 0.02)

        qkv_out = (B.hq + 2 * B.hkv) * B.d
        self.embed = w(vocab, hidden)
        self.lm_head = w(vocab, hidden)
        self.norm_w = torch.ones(hidden, device=dev, dtype=dt)
        self.w = [dict(qkv=w(qkv_out, hidden), o=w(hidden, B.hq * B.d), gu=w(2 * inter, hidden),
                       down=w(hidden, inter), ln1=torch.ones(hidden, device=dev, dtype=dt),
                       ln2=torch.ones(hidden, device=dev, dtype=dt)) for _ in range(layers)]
        inv = 1.0 / (500000.0 ** (torch.arange(0, B.d, 2, device=dev).float() / B.d))
        emb = torch.outer(torch.arange(131072 if not B.cpu else 4096, device=dev).float(), inv).repeat(1, 2)
        self.cos, self.sin = emb.cos(), emb.sin()

    def caches(self, batch: dict):
        """Per-layer caches: distinct layers read distinct memory, as in a real model."""
        torch = self.B.torch
        kc, vc = batch["k_cache"], batch["v_cache"]
        return [(kc, vc)] + [(torch.empty_like(kc).normal_(), torch.empty_like(vc).normal_())
                             for _ in range(self.layers - 1)]

    def step(self, ids, positions, slots, b, caches, attention: str, fused: bool):
        import torch.nn.functional as F

        from pagoda.kernels.reference import add_rms_norm_ref, paged_attention_ref, rotary_ref, write_kv_cache_ref
        from pagoda.kernels.triton_attention import paged_attention_triton
        from pagoda.kernels.triton_cache import write_kv_cache_triton
        from pagoda.kernels.triton_norm import add_rms_norm_triton, rotary_triton
        B = self.B
        norm = add_rms_norm_triton if fused else add_rms_norm_ref
        rope = rotary_triton if fused else rotary_ref
        write = write_kv_cache_triton if attention == "triton" else write_kv_cache_ref
        attend = {"triton": paged_attention_triton, "torch": paged_attention_ref,
                  "gather+sdpa": _gather_sdpa_any}[attention]
        h, res = self.embed[ids], None
        t = ids.shape[0]
        for lw, (kc, vc) in zip(self.w, caches):
            x, res = norm(h, res, lw["ln1"], 1e-5)
            qkv = F.linear(x, lw["qkv"]).view(t, B.hq + 2 * B.hkv, B.d)
            q, k, v = qkv[:, :B.hq], qkv[:, B.hq:B.hq + B.hkv], qkv[:, B.hq + B.hkv:]
            q, k = rope(positions, q, k, self.cos, self.sin)
            write(k, v, kc, vc, slots)
            o = attend(q.contiguous() if attention != "triton" else q, kc, vc, b["block_tables"],
                       b["seq_lens"], b["query_start_loc"], b["scale"])
            h = F.linear(o.reshape(t, -1), lw["o"])
            x, res = norm(h, res, lw["ln2"], 1e-5)
            gate, up = F.linear(x, lw["gu"]).chunk(2, dim=-1)
            h = F.linear(F.silu(gate) * up, lw["down"])
        x, _ = norm(h, res, self.norm_w, 1e-5)
        return F.linear(x, self.lm_head).float()


def _gather_sdpa_any(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale):
    """Decode-only gather-then-SDPA attention with the reference's signature."""
    b = dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, seq_lens=seq_lens, scale=scale)
    b["_arange"] = _gather_sdpa_any.arange
    out = gather_then_sdpa_decode(b, block_tables.shape[1])
    return out.transpose(1, 2).reshape(q.shape)


def step_level(B: Bench) -> None:
    torch = B.torch
    if B.cpu:
        stack = Stack(B, layers=2, hidden=128, inter=256, vocab=512)
        grid = [(3, 40)]
    else:
        stack = Stack(B, layers=32, hidden=4096, inter=14336, vocab=128256)
        grid = [(1, 2048), (64, 2048)] if B.quick else [(1, 2048), (16, 2048), (64, 2048), (256, 2048), (32, 8192)]
    rows = []
    for batch, ctx in grid:
        lens = B.ragged(batch, ctx)
        b = B.batch([1] * batch, lens, own_pool=True)
        caches = stack.caches(b)
        ids = torch.randint(0, stack.embed.shape[0], (batch,), generator=B.gen).to(B.device)
        positions = (b["seq_lens"] - 1).long()
        blk = b["block_tables"].gather(1, (positions // B.bs).view(-1, 1).to(torch.int64)).view(-1)
        slots = blk.long() * B.bs + positions % B.bs
        _gather_sdpa_any.arange = torch.arange(b["block_tables"].shape[1] * B.bs, device=B.device)
        variants = [("triton", True), ("triton", False), ("gather+sdpa", False)]
        if batch <= 16 or B.cpu:
            variants.append(("torch", False))
        logits, cells = {}, []
        for attention, fused in variants:
            def run():
                return stack.step(ids, positions, slots, b, caches, attention, fused)
            logits[(attention, fused)] = run()
            us = B.time_us(run)
            cells.append(f"{attention}{' +fused' if fused else ''}: {us / 1e3:.2f} ms")
        base = logits[("triton", True)]
        drift = max((lg - base).abs().max().item() for lg in logits.values())
        rows.append([batch, ctx, "; ".join(cells), f"{drift:.2e}"])
        caches = None
    emit("## Decode step, Llama-3-8B-shaped stack (32 layers, random weights)" if not B.cpu
         else "## Decode step, toy stack (correctness of the code path only)")
    emit("Per backend: ms per step. Last column: max logit difference between variants.")
    table(["batch", "max ctx", "step time", "max logit diff"], rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="reduced sweep (a few minutes on an H200)")
    ap.add_argument("--cpu", action="store_true", help="toy sizes under the Triton interpreter, correctness only")
    ap.add_argument("--out", help="also write the markdown tables to this file")
    ap.add_argument("--skip", default="", help="comma list of sections to skip: decode,prefill,fused,step")
    ap.add_argument("--no-flex", action="store_true", help="skip FlexAttention (it compiles per shape)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="FlexAttention runs only in the first half of this (default 420 quick, 1500 full)")
    args = ap.parse_args(argv)
    if args.cpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
    import torch
    if not args.cpu and not torch.cuda.is_available():
        print("no CUDA device: use --cpu for the interpreter run", file=sys.stderr)
        return 2
    t0 = time.time()
    B = Bench(cpu=args.cpu, quick=args.quick)
    B.flex = not args.no_flex
    B.budget_s = args.budget_s or (420 if args.quick else 1500)
    if not args.cpu:
        emit(f"# Kernel bench on {torch.cuda.get_device_name()} ({'quick' if args.quick else 'full'} sweep)")
    else:
        emit("# Kernel bench, CPU interpreter (toy sizes; timings not meaningful)")
    emit()
    ok = check_correctness(B)
    skip = set(filter(None, args.skip.split(",")))
    for name, fn in [("decode", decode_sweep), ("prefill", prefill_sweep), ("fused", fused_ops), ("step", step_level)]:
        if name in skip:
            continue
        t = time.time()
        try:
            fn(B)
        except Exception as e:  # noqa: BLE001 - a one-shot GPU run should still report the rest
            import traceback
            traceback.print_exc()
            emit(f"**{name} section failed: {type(e).__name__}: {e}**")
            emit()
            ok = False
        print(f"[{name}: {time.time() - t:.0f} s]", file=sys.stderr, flush=True)
    emit(f"Total {time.time() - t0:.0f} s; correctness {'ok' if ok else 'FAILED'}.")
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(LINES) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
