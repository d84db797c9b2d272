"""Shared helpers for the engine benchmarks: the benchmark model, seeded workloads, KV-usage
samplers for each system, machine description and markdown tables.

Every system in a benchmark gets the same model, the same requests and the same KV-cache
memory, expressed here in tokens (one token's K and V across all layers).
"""
from __future__ import annotations

import datetime
import math
import os
import platform
import random
import subprocess
import sys
import urllib.request
from dataclasses import dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# "Small but not trivial": 8 layers, hidden 512, GQA 8/4 heads of 64, fp32.
BENCH_MODEL = dict(num_hidden_layers=8, hidden_size=512, intermediate_size=1408,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                   max_position_embeddings=2048)
# --quick: same shape of code path, a model that runs in milliseconds.
QUICK_MODEL = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   max_position_embeddings=2048)


def build_model(path: str, quick: bool = False) -> str:
    """A random Llama checkpoint at `path` (reused when already there)."""
    from pagoda.gpu_worker.testing.tiny_model import make_tiny_model
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    return make_tiny_model(path, family="llama", seed=0, **(QUICK_MODEL if quick else BENCH_MODEL))


def kv_bytes_per_token(model_dir: str) -> int:
    """Bytes of K and V for one token across all layers, from the checkpoint's config (fp32)."""
    import json
    with open(os.path.join(model_dir, "config.json")) as f:
        c = json.load(f)
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * 4


# ---- workloads ---------------------------------------------------------------------------

@dataclass
class Req:
    prompt: list[int]
    output_len: int


@dataclass
class LengthDist:
    """Log-normal lengths, clipped: ShareGPT's shape (long right tail), scaled down."""
    median: float
    sigma: float
    lo: int
    hi: int

    def draw(self, rng: random.Random) -> int:
        return int(min(self.hi, max(self.lo, round(rng.lognormvariate(math.log(self.median), self.sigma)))))


@dataclass
class Workload:
    name: str
    requests: list[Req]
    prompt_dist: LengthDist
    output_dist: LengthDist
    seed: int
    notes: str = ""

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt) for r in self.requests)

    @property
    def output_tokens(self) -> int:
        return sum(r.output_len for r in self.requests)

    @property
    def max_len(self) -> int:
        return max(len(r.prompt) + r.output_len for r in self.requests)

    def describe(self) -> str:
        p = sorted(len(r.prompt) for r in self.requests)
        o = sorted(r.output_len for r in self.requests)
        return (f"{len(self.requests)} requests, seed {self.seed}; prompt tokens: log-normal median "
                f"{self.prompt_dist.median:g}, sigma {self.prompt_dist.sigma:g}, clipped to "
                f"[{self.prompt_dist.lo}, {self.prompt_dist.hi}] (drawn: median {p[len(p) // 2]}, "
                f"mean {sum(p) / len(p):.0f}, max {p[-1]}); output tokens: log-normal median "
                f"{self.output_dist.median:g}, sigma {self.output_dist.sigma:g}, clipped to "
                f"[{self.output_dist.lo}, {self.output_dist.hi}] (drawn: median {o[len(o) // 2]}, "
                f"mean {sum(o) / len(o):.0f}, max {o[-1]}); ignore_eos, greedy")


def sharegpt_like(num_requests: int, vocab_size: int, seed: int = 0, scale: float = 1.0,
                  first_token: int = 5) -> Workload:
    """ShareGPT-like prompt/output lengths scaled down to a CPU (see bench/RESULTS.md).

    `scale` shrinks every length further (the --quick smoke runs). Token ids are uniform
    over the non-special vocabulary: content does not matter for throughput, and random
    prompts share no prefix, so prefix caching neither helps nor hurts.
    """
    rng = random.Random(seed)
    pd = LengthDist(64 * scale, 0.8, max(4, int(8 * scale)), max(8, int(512 * scale)))
    od = LengthDist(64 * scale, 0.7, max(2, int(8 * scale)), max(4, int(256 * scale)))
    reqs = []
    for _ in range(num_requests):
        n_prompt, n_out = pd.draw(rng), od.draw(rng)
        reqs.append(Req([rng.randrange(first_token, vocab_size) for _ in range(n_prompt)], n_out))
    return Workload("sharegpt-like", reqs, pd, od, seed)


# ---- KV usage ----------------------------------------------------------------------------

@dataclass
class KVSampler:
    """Per-step samples of (tokens stored, slots allocated) for one system.

    utilisation = stored / allocated, averaged over steps (each step weighs the same);
    occupancy = allocated / capacity, the share of the budget that is held at all.
    """
    capacity_tokens: int
    stored: list[int] = field(default_factory=list)
    allocated: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)

    def add(self, stored: int, allocated: int, t: float) -> None:
        if allocated <= 0:
            return
        self.stored.append(stored)
        self.allocated.append(allocated)
        self.times.append(t)

    @property
    def steps(self) -> int:
        return len(self.stored)

    def utilisation(self) -> float:
        if not self.stored:
            return float("nan")
        return sum(s / a for s, a in zip(self.stored, self.allocated)) / len(self.stored)

    def occupancy(self) -> float:
        if not self.allocated:
            return float("nan")
        return sum(self.allocated) / len(self.allocated) / self.capacity_tokens


def hook_hf_cb_kv(processor, sampler: KVSampler, clock) -> None:
    """Sample transformers' continuous-batching KV usage once per batch.

    After prepare_next_batch the cache holds this batch's blocks and each request's
    position_offset already counts the tokens written by the coming forward.
    """
    inner = processor.prepare_next_batch
    cache = processor.cache
    sched = processor.scheduler

    def prepare_next_batch():
        ok = inner()
        if ok:
            stored, slots = 0, 0
            for alloc in cache.cache_allocators.values():
                blocks = set()
                for rid, table in alloc.block_table.items():
                    state = sched.active_requests.get(rid)
                    if state is not None:
                        stored += state.position_offset
                    blocks.update(table)
                slots += len(blocks) * alloc.tokens_per_page
            sampler.add(stored, slots, clock())
        return ok

    processor.prepare_next_batch = prepare_next_batch


# ---- reporting ---------------------------------------------------------------------------

def lscpu_lines() -> list[str]:
    """`lscpu`'s model name and flags, as report lines (the CPU kernels' choices depend on them)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    return [f"- lscpu model name: {fields.get('Model name', '?').strip()}",
            f"- lscpu flags: {fields.get('Flags', '?').strip()}"]


def pagoda_cpu_kernels() -> str:
    """What this process's pagoda computes a CPU step with: each tuned linear shape's
    implementation per row bucket (parallel.tune_linears) and whether the C kernels built."""
    from pagoda.gpu_worker.models import parallel
    from pagoda.kernels import cpu_lib, cpu_tune
    lin = "; ".join(f"{n}x{k} {str(dt).replace('torch.', '')}: "
                    + ", ".join(f"<={b} {impl}" for b, impl in zip(cpu_tune.BUCKETS, picks))
                    for (n, k, dt), picks in sorted(parallel._choices.items(), key=str))
    return (f"C kernels {'built' if cpu_lib.available() else 'NOT built (torch reference)'}; "
            f"PAGODA_CPU_GEMM={parallel._CPU_GEMM}; linears: {lin or 'none tuned'}")


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    import torch
    import transformers
    return (f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} "
            f"({torch.get_num_threads()} threads), transformers {transformers.__version__}, "
            f"Python {platform.python_version()}")


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def command_line() -> str:
    return "python " + " ".join([os.path.relpath(sys.argv[0], REPO)] + sys.argv[1:])


def markdown_table(headers: list[str], rows: list[list]) -> str:
    def cell(v):
        if isinstance(v, float):
            return "n/a" if math.isnan(v) else f"{v:,.3g}" if abs(v) < 10 else f"{v:,.0f}"
        return str(v)
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def set_threads(n: int) -> None:
    """The same intra-op thread count for every system.

    One by default: on a shared, oversubscribed 2-core machine, torch's OpenMP threads wait
    for each other at every small op (a decode step measured 14x slower with 2 threads
    under load than with 1; see bench/RESULTS.md).
    """
    # The variable reaches threads torch has not started yet (transformers' batching thread).
    os.environ["OMP_NUM_THREADS"] = str(n)
    import torch
    torch.set_num_threads(n)


def scrape_metrics(port: int) -> dict[str, float]:
    """A process's Prometheus text on 127.0.0.1:`port`/metrics -> {'name{labels}': value}."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {k: float(v) for k, _, v in (line.rpartition(" ") for line in text.splitlines())
            if k and not k.startswith("#")}
