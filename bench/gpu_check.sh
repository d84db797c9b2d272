#!/usr/bin/env bash
# The GPU check of issue 11, in one run of at most 8 minutes on one H200 (the parts' limits add up
# to 480 s, under the device's 600 s a command and leaving room in its 15-minute budget), installing nothing:
#   1. the GPU tests (and the CPU twins beside them, which must pass on a GPU host too),
#   2. python bench/gpu_kernels.py --quick, 38 s of budget (decode attention vs the 4.3 TB/s bound, fused ops),
#   3. bench/gpu_e2e.py: random bf16 Llama-3.2-1B and Llama-3-8B shapes at batch 1, 64, 256,
#      CUDA graphs against --enforce-eager: tok/s, decode step, forward/host split, bound share.
#   4. bench/quant.py --gpu: a Llama-3-8B layer's linears in bf16, fp8 (torch._scaled_mm) and
#      int4 (the Triton dequantize-matmul) at M = 1, 16, 256 (quant.md); the quantized-weight
#      GPU tests (tests/test_quant_kernels.py) run in part 1.
#   5. bench/lora.py --gpu: a Llama-3-8B layer's projections, bf16, against the same plus the
#      multi-LoRA Triton kernels (rank 16, 1 and 4 adapters mixed) at M = 1, 16, 256 (lora.md);
#      the LoRA kernel GPU test and the Triton-path LoRA parity run in part 1.
#   6. bench/kv_tier.py --gpu: TTFT of 8 tenants' 2k-token prompts through a device pool half their
#      size, with and without the pinned host KV tier (kv_tier.md); the tier's CUDA twin
#      (tests/test_kv_tier.py::test_cuda_copy_path_matches_the_cpu_twin) runs in part 1.
#   7. bench/kv_copy.py: a KV fetch's copies (issue 36) on CUDA: N Llama-3-8B-shaped bf16 blocks
#      exported from a device pool to bytes with digests and imported into another pool, per MiB;
#      their CUDA test (tests/test_kv_transfer_copy.py, beside its CPU twin) runs in part 1.
# Everything lands under $OUT (default ./gpu_check_out): one log per part, summary.txt, e2e.md,
# kernels.md. Each part has its own time limit, so one that hangs cannot eat the others' time.
#
# The machine has torch, triton, transformers and numpy. pytest, pytest-timeout and llguidance
# (which the sampler imports) travel with the tree: on a CPU host run
#   bench/gpu_check.sh --vendor        # copies them from this Python into .gpu_vendor/
# and carry .gpu_vendor to the GPU host. --dry-run prints the plan and runs the CPU-runnable
# parts (the e2e harness, the quant layer bench and the KV copies at tiny shapes) so the script itself is
# checked without a GPU.
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu_check_out}
VENDOR=${GPU_VENDOR:-$ROOT/.gpu_vendor}
PY=${PYTHON:-python}

if [ "${1:-}" = "--vendor" ]; then
    rm -rf "$VENDOR" && mkdir -p "$VENDOR"
    "$PY" - "$VENDOR" <<'EOF'
import importlib.metadata as md, os, shutil, sys
dst = sys.argv[1]
for name in ("pytest", "pluggy", "iniconfig", "pytest-timeout", "packaging", "llguidance"):
    dist = md.distribution(name)
    base = str(dist.locate_file(""))
    tops = {str(f).split("/")[0] for f in dist.files if not str(f).startswith(("..", "bin/"))}
    for top in sorted(tops - {"__pycache__"}):
        src = os.path.join(base, top)
        (shutil.copytree if os.path.isdir(src) else shutil.copy2)(src, os.path.join(dst, top))
print("vendored into", dst, sorted(os.listdir(dst)))
EOF
    exit $?
fi

DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
mkdir -p "$OUT"
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
[ -d "$VENDOR" ] && export PYTHONPATH=$PYTHONPATH:$VENDOR
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/pagoda-triton-cache}
SUMMARY=$OUT/summary.txt
: > "$SUMMARY"

# part NAME LIMIT_S CMD...: runs CMD with a time limit, its output in $OUT/NAME.log.
part() {
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit}s): $*" | tee -a "$SUMMARY"
    if [ $DRY = 1 ] && [ "$name" != e2e ] && [ "$name" != quant ] && [ "$name" != kv_copy ]; then
        return 0
    fi
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "   $name: rc=$rc in $((SECONDS - t0))s; last line: $(tail -n 1 "$OUT/$name.log")" | tee -a "$SUMMARY"
}

GPU_TESTS="tests/test_kernels.py tests/test_kernels_norm.py tests/test_kernels_launch.py tests/test_cuda_graphs.py
           tests/test_kv_fp8.py tests/test_models.py::test_cuda_runner_matches_cpu tests/test_parity_triton.py
           tests/test_async_scheduling.py tests/test_prompt_logprobs.py
           tests/test_spec_decode.py::test_speculation_on_cuda_matches_plain
           tests/test_quant_kernels.py tests/test_kv_tier.py::test_cuda_copy_path_matches_the_cpu_twin
           tests/test_beam_search.py::test_beam_search_on_cuda_matches_cpu tests/test_beam_search.py::test_copy_blocks_cpu
           tests/test_kernels_lora.py tests/test_lora.py::test_lora_on_cuda_matches_the_merged_models
           tests/test_kv_transfer_copy.py"
if [ $DRY = 0 ]; then
    { nvidia-smi; "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"; } \
        > "$OUT/machine.txt" 2>&1
fi
# shellcheck disable=SC2086
part gpu_tests 170 "$PY" -m pytest -q -rs -p no:cacheprovider $GPU_TESTS
part kernels 50 "$PY" bench/gpu_kernels.py --quick --no-flex --budget-s 38 --out "$OUT/kernels.md"
if [ $DRY = 1 ]; then
    part e2e 120 "$PY" bench/gpu_e2e.py --dry-run --out "$OUT"
else
    part e2e 130 "$PY" bench/gpu_e2e.py --out "$OUT"
fi
if [ $DRY = 1 ]; then
    part quant 60 "$PY" bench/quant.py --gpu --dry-run --out "$OUT/quant.md"
else
    part quant 35 "$PY" bench/quant.py --gpu --out "$OUT/quant.md"
fi
part lora 30 "$PY" bench/lora.py --gpu --out "$OUT/lora.md"
part kv_tier 45 "$PY" bench/kv_tier.py --gpu --rounds 2 --prefix-len 2048 --out "$OUT/kv_tier.md" --json "$OUT/kv_tier.json"
if [ $DRY = 1 ]; then
    part kv_copy 60 "$PY" bench/kv_copy.py --dry-run --out "$OUT/kv_copy.md"
else
    part kv_copy 20 "$PY" bench/kv_copy.py --device cuda --reps 2 --out "$OUT/kv_copy.md"
fi
echo "done: $OUT" | tee -a "$SUMMARY"
