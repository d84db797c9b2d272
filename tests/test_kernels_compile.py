"""The Triton kernels compile for a Hopper GPU (sm_90) with no register spills, on any machine.

The interpreter accepts code the GPU compiler rejects (and the reverse), so without a device this
is the check that the real code path builds. Triton's NVIDIA backend ships ptxas and cuobjdump, so
ahead-of-time compilation to a cubin needs no GPU. The interpreter patches triton.language
in-process, so compilation runs in a child process without TRITON_INTERPRET.
Run as a script it prints one JSON line per variant.
"""
import json
import os
import re
import subprocess
import sys
import tempfile

import pytest

# (cache dtype, q heads, kv heads, head dim, block size, decode?, splits)
ATTENTION_VARIANTS = [
    ("bf16", 32, 8, 128, 16, True, 1),    # Llama-3-8B decode
    ("bf16", 32, 8, 128, 16, True, 8),    # ... split-KV
    ("bf16", 32, 8, 128, 16, False, 1),   # ... prefill / mixed
    ("fp16", 32, 4, 128, 32, False, 2),   # GQA 8
    ("bf16", 14, 2, 64, 8, True, 1),      # GQA 7 (padded group), head dim 64
    ("fp32", 8, 8, 64, 16, False, 1),     # fp32 (ieee dot), no GQA
    ("fp32", 32, 8, 128, 16, False, 1),   # fp32, Llama-3-8B heads
    ("fp32", 32, 8, 128, 16, True, 4),
    ("fp8e4nv", 32, 8, 128, 16, True, 1),   # --kv-cache-dtype fp8: bf16 q/out, e4m3 K/V
    ("fp8e4nv", 32, 8, 128, 16, False, 1),
]
# Variants compiled again with every feature on (sliding window, soft-cap, sinks).
FEATURE_VARIANTS = [ATTENTION_VARIANTS[1], ATTENTION_VARIANTS[2], ATTENTION_VARIANTS[6]]


def _compile(fn, pointers: dict, scalars: dict, constexprs: dict, num_warps: int = 4) -> dict:
    """Compile as a launch would: pointers 16-byte aligned, ints specialised like the runtime
    does (1 becomes a constant, multiples of 16 carry a divisibility hint).

    pointers: name -> element type ("bf16"); scalars: name -> an example value (int or float).
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    constexprs = dict(constexprs)
    sig, hinted = {}, []
    for name in fn.arg_names:
        if name in pointers:
            sig[name] = "*" + pointers[name]
            hinted.append(name)
        elif name in scalars:
            value = scalars[name]
            if isinstance(value, float):
                sig[name] = "fp32"
            elif value == 1:
                constexprs[name] = 1
            else:
                sig[name] = "i32"
                if value % 16 == 0:
                    hinted.append(name)
        if name in constexprs:
            sig[name] = "constexpr"
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in hinted if sig[n] != "constexpr"}
    kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=2))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
    field = {k: int(v) for k, v in re.findall(r"\b(REG|STACK|LOCAL|SHARED):(\d+)", usage)}
    return dict(kernel=fn.__name__, regs=field["REG"], local=field["LOCAL"], stack=field["STACK"],
                shared=kernel.metadata.shared)


def compile_all():
    import torch

    from pagoda.kernels.triton_attention import _merge_splits_kernel, _paged_attn_kernel, launch_config
    from pagoda.kernels.triton_cache import _write_kv_kernel
    from pagoda.kernels.triton_norm import _add_rms_norm_kernel, _rotary_kernel
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8e4nv": torch.float8_e4m3fn}
    variants = [(v, False) for v in ATTENTION_VARIANTS] + [(v, True) for v in FEATURE_VARIANTS]
    for (dt, hq, hkv, d, bs, decode, splits), features in variants:
        n_tok = 4 if decode else 64
        cfg = launch_config(n_tok, 4, hq, hkv, d, bs, dtypes[dt], True)
        warps = cfg.pop("num_warps")
        act = "bf16" if dt == "fp8e4nv" else dt
        ptrs = dict(q=act, k_cache=dt, v_cache=dt, block_tables="i32", seq_lens="i32", query_start_loc="i32",
                    out=act, part_acc="fp32", part_ml="fp32", sinks="fp32")
        # q as a view into the fused QKV output, as the model passes it.
        ints = dict(scale_log2=0.1, v_scale=0.5, window=4096, softcap=30.0, num_seqs=37, num_tokens=n_tok * 3 + 1, num_q_heads=hq,
                    stride_qt=(hq + 2 * hkv) * d, stride_qh=d, stride_ot=hq * d, stride_oh=d,
                    stride_cb=bs * hkv * d, stride_cs=hkv * d, stride_ch=d, stride_bt=129)
        flags = dict(HAS_WINDOW=features, HAS_SOFTCAP=features, HAS_SINKS=features)
        yield dict(_compile(_paged_attn_kernel, ptrs, ints, {**cfg, "NUM_SPLITS": splits, **flags}, warps),
                   variant=[dt, hq, hkv, d, bs, decode, splits, features])
    ints = dict(num_tokens=7, num_q_heads=32, stride_ot=4096, stride_oh=128)
    yield _compile(_merge_splits_kernel, dict(part_acc="fp32", part_ml="fp32", out="bf16"), ints,
                   dict(HEAD_DIM=128, D_PAD=128, NUM_SPLITS=8, HEADS_BLOCK=1), 1)
    for src, dst, slot in [("bf16", "bf16", "i64"), ("fp32", "bf16", "i32"), ("fp16", "fp16", "i64"),
                           ("bf16", "fp8e4nv", "i64")]:
        ptrs = dict(key=src, value=src, k_cache=dst, v_cache=dst, slot_mapping=slot)
        ints = dict(stride_kt=6144, stride_kh=128, stride_vt=6144, stride_vh=128, stride_cb=16384,
                    stride_cs=1024, stride_ch=128, block_size=16, num_kv_heads=8, k_scale=0.5, v_scale=0.25)
        yield _compile(_write_kv_kernel, ptrs, ints, dict(HEAD_DIM=128, HEADS_PAD=8, D_PAD=128,
                                                          FP8=dst == "fp8e4nv"))
    ptrs = dict(x="bf16", residual="bf16", weight="bf16", out="bf16", res_out="bf16")
    ints = dict(stride_x=4096, stride_r=4096, stride_o=4096, stride_ro=4096, n_cols=4096, eps=1e-5)
    yield _compile(_add_rms_norm_kernel, ptrs, ints, dict(HAS_RESIDUAL=True, BLOCK=4096), 8)
    ptrs = dict(positions="i64", q="bf16", k="bf16", cos="fp32", sin="fp32")
    ints = dict(stride_qt=6144, stride_qh=128, stride_kt=6144, stride_kh=128, stride_cos=128,
                num_q_heads=32, num_kv_heads=8)
    yield _compile(_rotary_kernel, ptrs, ints, dict(HALF=64, HALF_PAD=64, HEADS_PAD=32))


@pytest.mark.timeout(240)
def test_kernels_compile_for_sm90_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)], cwd=root, env=env,
                          capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(results) >= len(ATTENTION_VARIANTS) + len(FEATURE_VARIANTS) + 4
    for r in results:
        assert r["local"] == 0 and r["stack"] == 0, f"register spills: {r}"
        assert r["shared"] <= 227 * 1024, f"too much shared memory for sm_90: {r}"
        assert r["regs"] <= 255, r


if __name__ == "__main__":
    for result in compile_all():
        print(json.dumps(result), flush=True)
