"""Which implementation computes each CPU linear, chosen by timing them on this machine.

At model load (pagoda.gpu_worker.models.parallel.tune_linears) every candidate that takes a linear
shape of the model (the C GEMV and GEMM, oneDNN's prepacked matmul, plain F.linear) is timed at a
few row counts, the bucket ceilings of BUCKETS, and the fastest is kept per (shape, bucket): no
rule of thumb from the developer's CPU decides. (At 1 and 8 rows only the kernels' pool's GEMV
and GEMM are candidates: a small step keeps that pool spinning, beside which OpenMP's threads
lose what they win alone; parallel.tune_linears says more.) Choices are cached as JSON beside the kernel
cache (cpu_lib.cache_dir), under a key of everything the timings depend on: the CPU's model name
and flags, the dtype, torch's version, the C kernels' build (their sources: a kernel changed or
added is timed again) and the model's linear shapes. A start whose key is cached
times nothing, except a choice timed while the machine was oversubscribed (its load is stored
with it), which is timed again at a start at most half as busy.

The tuning is bounded: each candidate runs once untimed (it packs its weight, warms caches),
then at most MAX_REPS timed calls or MIN_SECONDS of them, the minimum kept (a call of tens of
microseconds is timed up to MAX_REPS times: at 3, noise decided between candidates tens of
microseconds apart, and a 1-row 512x1408 fp32 linear on a quiet Zen 3 picked F.linear, which
longer timings put 1.6x behind the C GEMV); the work goes from
the cheapest (shape, bucket) up, and stops when the budget (PAGODA_CPU_TUNE_BUDGET_S, default
3 s) would be overrun. What was not timed runs the default implementation this start and is
timed at the next; a (shape, bucket) that alone would overrun the whole budget keeps the default
for good (cached as untimed).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from pagoda.kernels.cpu_lib import cache_dir, env_number, library_key

log = logging.getLogger(__name__)

BUCKETS = (1, 8, 64, 256)     # a linear of m rows runs what was fastest at the first bucket >= m
MAX_REPS = 20
MIN_SECONDS = 0.03
DEFAULT_BUDGET_S = 3.0
FORMAT = 3                    # of the cache file; part of the key (2: MAX_REPS 3 -> 20; 3: small buckets pool-only)


def bucket_index(rows: int) -> int:
    """Index into BUCKETS of the bucket a call of `rows` rows falls in (the last one above)."""
    for i, b in enumerate(BUCKETS):
        if rows <= b:
            return i
    return len(BUCKETS) - 1


def choose(timings: dict[str, float]) -> str:
    """The fastest candidate (ties: the first in name order, so the choice is reproducible)."""
    return min(sorted(timings), key=lambda name: timings[name])


def budget_s() -> float:
    return env_number("PAGODA_CPU_TUNE_BUDGET_S", DEFAULT_BUDGET_S, float, 0, 3600, "seconds from 0 to 3600")


def cpu_identity(cpuinfo: str | None = None) -> tuple[str, str]:
    """(model name, flags) of this CPU from /proc/cpuinfo (`cpuinfo`: its text, for tests)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            cpuinfo = ""
    model = flags = ""
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        name = name.strip()
        if name in ("model name", "Model", "CPU part") and not model:
            model = value.strip()
        elif name in ("flags", "Features") and not flags:
            flags = " ".join(sorted(value.split()))
    return model or platform.processor() or platform.machine(), flags


def cache_key(dtype: torch.dtype, shapes: list[tuple[int, int]], cpuinfo: str | None = None) -> dict:
    model, flags = cpu_identity(cpuinfo)
    return {"format": FORMAT, "cpu": model, "flags": flags, "dtype": str(dtype).replace("torch.", ""),
            "torch": torch.__version__, "kernels": library_key(), "threads": torch.get_num_threads(),
            "shapes": sorted([list(s) for s in set(shapes)])}


def cache_path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / f"linear-choices-{digest}.json"


def load_cache(key: dict) -> dict[str, dict]:
    """Cached entries ("NxK@bucket" -> {"impl", "ms"}) for exactly this key; {} for none."""
    try:
        data = json.loads(cache_path(key).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("key") != key or not isinstance(data.get("choices"), dict):
        return {}
    return data["choices"]


def save_cache(key: dict, choices: dict[str, dict]) -> None:
    path = cache_path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Written beside the target and renamed: workers starting together never read half a file.
        fd, tmp = tempfile.mkstemp(suffix=".json", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump({"key": key, "choices": choices}, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as e:
        log.warning("CPU linear tuning: cannot write %s (%s); the choices are not cached", path, e)


def measure(fn: Callable[[], object], clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds per call of fn: one untimed call, then the fastest of at most MAX_REPS calls
    (fewer when they pass MIN_SECONDS together)."""
    fn()
    best, spent = float("inf"), 0.0
    for _ in range(MAX_REPS):
        t0 = clock()
        fn()
        dt = clock() - t0
        best, spent = min(best, dt), spent + dt
        if spent >= MIN_SECONDS:
            break
    return best


@dataclass
class Work:
    """One (shape, bucket) to choose for: its candidates, each a call at the bucket's rows."""
    n: int
    k: int
    bucket: int
    candidates: dict[str, Callable[[], object]]
    default: str             # what runs when it is not timed

    @property
    def name(self) -> str:
        return f"{self.n}x{self.k}@{self.bucket}"

    @property
    def flops(self) -> float:
        return 2.0 * self.n * self.k * self.bucket


def busy() -> float:
    """This machine's load: the 1-minute load average per CPU (1.0: every core had work)."""
    try:
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:
        return 0.0


def stale(hit: dict, now_busy: float) -> bool:
    """A cached choice timed while the machine was oversubscribed (more runnable threads than
    cores: the timings then measure the other load as much as the candidates), and the machine is
    now at most half as busy: time it again. A choice timed at a normal load stays for good."""
    then = float(hit.get("busy", 0.0))
    return then > 1.0 and now_busy < then / 2


def tune(key: dict, work: list[Work], budget: float, measure: Callable[[Callable[[], object]], float] = measure,
         clock: Callable[[], float] = time.perf_counter, load: Callable[[], float] = busy,
         one_family_above: int | None = None) -> dict[str, str]:
    """The implementation for each work item's name: cached, timed now, or its default (untimed).
    Logs one line per choice and writes what it timed to the cache, with the load it was timed at
    (a choice timed on an oversubscribed machine is timed again once it is quieter: stale).
    one_family_above: the row buckets past it each keep one thread family (one_family)."""
    cached = load_cache(key)
    choices, fresh = dict(cached), False
    start, rate = clock(), 0.0          # rate: the slowest flops per second seen, for estimates
    now_busy = load()
    out: dict[str, str] = {}
    for w in sorted(work, key=lambda w: (w.flops, w.name)):
        hit = cached.get(w.name)
        if hit is not None and hit.get("impl") in w.candidates:
            if not (hit.get("ms") and stale(hit, now_busy)):
                out[w.name] = hit["impl"]
                log.info("CPU linear %s rows<=%d: %s (cached)", f"{w.n}x{w.k}", w.bucket, hit["impl"])
                continue
            log.info("CPU linear %s rows<=%d: timed again (cached %s was timed at load %.1f per CPU, now %.1f)",
                     f"{w.n}x{w.k}", w.bucket, hit["impl"], hit["busy"], now_busy)
        # Each candidate makes an untimed call, then timed ones up to MAX_REPS or MIN_SECONDS.
        t = w.flops / rate if rate else 0.0
        estimate = len(w.candidates) * (t + min(MAX_REPS * t, MIN_SECONDS + t))
        if len(w.candidates) < 2 or estimate > budget:
            out[w.name] = w.default
            choices[w.name], fresh = {"impl": w.default, "ms": {}}, True
            why = "the only candidate" if len(w.candidates) < 2 else f"timing it would take ~{estimate:.1f}s"
            log.info("CPU linear %s rows<=%d: %s (untimed: %s)", f"{w.n}x{w.k}", w.bucket, w.default, why)
            continue
        if clock() - start + estimate > budget:
            out[w.name] = hit["impl"] if hit is not None and hit.get("impl") in w.candidates else w.default
            log.info("CPU linear %s rows<=%d: %s (untimed: tuning budget of %.1fs spent; timed at a later start)",
                     f"{w.n}x{w.k}", w.bucket, out[w.name], budget)
            continue
        timings = {name: measure(fn) for name, fn in w.candidates.items()}
        best = choose(timings)
        slowest = max(timings.values())
        if slowest > 0:
            rate = w.flops / slowest if not rate else min(rate, w.flops / slowest)
        out[w.name] = best
        choices[w.name], fresh = {"impl": best, "ms": {n: round(t * 1e3, 4) for n, t in timings.items()},
                                  "busy": round(now_busy, 2)}, True
        log.info("CPU linear %s rows<=%d: %s (%s)", f"{w.n}x{w.k}", w.bucket, best,
                 ", ".join(f"{n} {t * 1e3:.3f} ms" for n, t in sorted(timings.items(), key=lambda kv: kv[1])))
    if fresh:
        save_cache(key, choices)
    if one_family_above is not None:
        for bucket in sorted({w.bucket for w in work if w.bucket > one_family_above}):
            out = one_family(out, choices, [w.name for w in work if w.bucket == bucket])
    return out


# The implementations that run on the C kernels' thread pool; the others run on torch's OpenMP threads.
POOL_IMPLS = ("gemv", "gemm")


def one_family(picked: dict[str, str], timed: dict[str, dict], names: list[str]) -> dict[str, str]:
    """picked, with the linears `names` (one row bucket's shapes) all on one thread family: the
    pool's (POOL_IMPLS) or OpenMP's, whichever sums to less over them at their timings (`timed`:
    load_cache's entries), each shape then its fastest in that family. A step runs every linear
    at the same rows, and a mix makes the families share the cores: the pool's threads spin for
    its next GEMM while oneDNN's run (a 64-row fp32 step at 0.7x of either family alone on a
    2-core Zen 4), or sleep and are woken for every pool GEMM. Left as picked when any of them
    lacks timings of both families."""
    fastest: dict[bool, dict[str, str]] = {True: {}, False: {}}     # pool? -> name -> its fastest impl
    total = {True: 0.0, False: 0.0}
    for name in names:
        ms = (timed.get(name) or {}).get("ms") or {}
        for pool in (True, False):
            fam = {impl: t for impl, t in ms.items() if (impl in POOL_IMPLS) == pool}
            if not fam:
                return picked
            fastest[pool][name] = min(sorted(fam), key=lambda i: fam[i])
            total[pool] += fam[fastest[pool][name]]
    return {**picked, **fastest[total[True] <= total[False]]}
