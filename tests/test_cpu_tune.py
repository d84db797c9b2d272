"""CPU linears chosen by timing (kernels/cpu_tune.py, parallel.tune_linears): the fastest wins on
injected timings, the choice is cached under a key of what the timings depend on and reused,
a changed key times again, the budget bounds the work, PAGODA_CPU_GEMM still forces a choice,
and every implementation computes the same linear."""
import json

import pytest
import torch
import torch.nn.functional as F

from pagoda.gpu_worker.models import parallel
from pagoda.kernels import cpu_gemm, cpu_tune

CPUINFO = "model name\t: Test CPU 9000\nflags\t\t: fpu sse avx2 fma\n"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGODA_KERNEL_CACHE", str(tmp_path))
    return tmp_path


def fake_work(timings: dict[str, dict[str, float]], calls: list[str]) -> list[cpu_tune.Work]:
    """Work items whose candidates return their injected time and record that they ran."""
    out = []
    for name, ts in timings.items():
        shape, bucket = name.split("@")
        n, k = map(int, shape.split("x"))

        def make(impl: str, t: float, name: str = name):
            def fn():
                calls.append(f"{name}:{impl}")
                return t
            return fn
        out.append(cpu_tune.Work(n, k, int(bucket), {impl: make(impl, t) for impl, t in ts.items()}, "torch"))
    return out


def measure_injected(fn):
    return fn()


def test_choose_takes_the_fastest():
    assert cpu_tune.choose({"gemm": 2.0, "onednn": 1.5, "torch": 3.0}) == "onednn"
    assert cpu_tune.choose({"torch": 1.0, "gemm": 1.0}) == "gemm"      # a tie: name order, reproducible
    assert [cpu_tune.bucket_index(r) for r in (1, 2, 8, 9, 64, 65, 5000)] == [0, 1, 1, 2, 2, 3, 3]
    assert all(parallel._bucket(r) == cpu_tune.bucket_index(r) for r in range(1, 300))


def test_tune_picks_caches_and_reuses(cache):
    timings = {"64x32@1": {"gemv": 1e-5, "gemm": 2e-5, "torch": 3e-5},
               "64x32@64": {"gemm": 5e-5, "onednn": 4e-5, "torch": 6e-5}}
    key = cpu_tune.cache_key(torch.float32, [(64, 32)], CPUINFO)
    assert key["cpu"] == "Test CPU 9000" and key["flags"] == "avx2 fma fpu sse"
    calls: list[str] = []
    got = cpu_tune.tune(key, fake_work(timings, calls), 10.0, measure=measure_injected)
    assert got == {"64x32@1": "gemv", "64x32@64": "onednn"}
    assert len(calls) == 6
    stored = json.loads(cpu_tune.cache_path(key).read_text())
    assert stored["key"] == key and stored["choices"]["64x32@64"]["impl"] == "onednn"
    assert stored["choices"]["64x32@64"]["ms"] == {"gemm": 0.05, "onednn": 0.04, "torch": 0.06}
    # The same key again: nothing is timed, the same choices come back.
    calls.clear()
    assert cpu_tune.tune(key, fake_work(timings, calls), 10.0, measure=measure_injected) == got
    assert calls == []
    # Any part of the key changed (another CPU, dtype, torch, C kernels, shapes): timed again.
    for other in (cpu_tune.cache_key(torch.float32, [(64, 32)], CPUINFO.replace("avx2", "avx512f")),
                  cpu_tune.cache_key(torch.bfloat16, [(64, 32)], CPUINFO),
                  cpu_tune.cache_key(torch.float32, [(64, 32), (8, 8)], CPUINFO),
                  {**key, "torch": "0.0"}, {**key, "kernels": "0" * 16}):
        assert cpu_tune.cache_path(other) != cpu_tune.cache_path(key)
        calls.clear()
        cpu_tune.tune(other, fake_work(timings, calls), 10.0, measure=measure_injected)
        assert len(calls) == 6
    # A file whose stored key differs (a hash collision, a hand edit) is not trusted.
    path = cpu_tune.cache_path(key)
    path.write_text(json.dumps({"key": {**key, "cpu": "else"}, "choices": stored["choices"]}))
    assert cpu_tune.load_cache(key) == {}


def test_budget_bounds_the_work(cache):
    key = cpu_tune.cache_key(torch.float32, [(16, 16), (64, 64), (4096, 4096)], CPUINFO)
    now = [0.0]

    def clock():
        return now[0]

    def slow_measure(fn):
        now[0] += 1.0            # every candidate costs a second of the budget
        return fn()
    # Fast candidates (a high flop rate): the estimates are small, the clock runs out.
    timings = {"16x16@1": {"gemv": 2e-9, "torch": 1e-9}, "64x64@1": {"gemv": 1e-9, "torch": 2e-9},
               "4096x4096@1": {"gemv": 1e-6, "torch": 2e-6}}
    calls: list[str] = []
    got = cpu_tune.tune(key, fake_work(timings, calls), 2.5, measure=slow_measure, clock=clock)
    # Cheapest first: two items fit in 2.5 s, the third runs its default, untimed and uncached.
    assert got == {"16x16@1": "torch", "64x64@1": "gemv", "4096x4096@1": "torch"}
    assert len(calls) == 4 and calls[0].startswith("16x16@1")
    stored = cpu_tune.load_cache(key)
    assert set(stored) == {"16x16@1", "64x64@1"}
    # The next start times only what is missing.
    calls.clear()
    now[0] = 0.0
    got = cpu_tune.tune(key, fake_work(timings, calls), 2.5, measure=slow_measure, clock=clock)
    assert got["4096x4096@1"] == "gemv" and all(c.startswith("4096x4096@1") for c in calls)
    assert set(cpu_tune.load_cache(key)) == set(timings)


def test_an_item_over_the_whole_budget_keeps_its_default(cache):
    key = cpu_tune.cache_key(torch.float32, [(16, 16), (4096, 4096)], CPUINFO)
    # 16x16 at 1 row in a second: the big one's estimate is days.
    timings = {"16x16@1": {"gemv": 1.0, "torch": 0.5}, "4096x4096@256": {"gemm": 1.0, "torch": 2.0}}
    calls: list[str] = []
    got = cpu_tune.tune(key, fake_work(timings, calls), 5.0, measure=measure_injected)
    assert got == {"16x16@1": "torch", "4096x4096@256": "torch"} and len(calls) == 2
    assert cpu_tune.load_cache(key)["4096x4096@256"] == {"impl": "torch", "ms": {}}    # never timed again


def test_forced_choice_wins(monkeypatch):
    # PAGODA_CPU_GEMM is read at import (tests/test_cpu_forward.py runs it in processes); here
    # its parsed value, over a shape whose measured choice says otherwise.
    w = torch.nn.Parameter(torch.randn(32, 16), requires_grad=False)
    monkeypatch.setattr(parallel, "_choices", {(32, 16, torch.float32): ("onednn",) * 4})
    one, many = torch.randn(1, 16), torch.randn(40, 16)
    for forced, want in (("torch", ("torch", "torch")), ("c", ("gemv", "gemm"))):
        monkeypatch.setattr(parallel, "_CPU_GEMM", forced)
        assert parallel.tune_linears([(w, None)]) == {}          # nothing timed when forced
        assert (parallel._impl(one, w, None), parallel._impl(many, w, None)) == want
    monkeypatch.setattr(parallel, "_CPU_GEMM", "onednn")
    assert parallel._impl(many, w, None) == "onednn"
    bf16 = torch.randn(4, 16).bfloat16()
    assert parallel._impl(bf16, w.bfloat16(), None) == ("onednn" if parallel.onednn_takes(torch.bfloat16) else "torch")
    monkeypatch.setattr(parallel, "_CPU_GEMM", "c")        # the C kernels take bf16 and fp16 too
    for dtype in (torch.bfloat16, torch.float16):
        assert (parallel._impl(one.to(dtype), w.to(dtype), None), parallel._impl(many.to(dtype), w.to(dtype), None)) \
            == ("gemv", "gemm")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_tune_linears_installs_the_measured_choices(cache, monkeypatch, dtype):
    g = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(48, 40, generator=g).to(dtype), requires_grad=False)
    b = torch.nn.Parameter(torch.randn(48, generator=g).to(dtype), requires_grad=False)
    monkeypatch.setattr(parallel, "_choices", {})
    # The C GEMV and GEMM are candidates in every dtype.
    assert parallel._candidates(torch.randn(1, 40).to(dtype), w, b)[:2] == ["gemv", "gemm"]
    assert parallel._candidates(torch.randn(9, 40).to(dtype), w, b)[0] == "gemm"
    tuned = parallel.tune_linears([(w, b), (w, b)])
    picks = tuned[(48, 40, dtype)]
    assert len(picks) == len(cpu_tune.BUCKETS) and set(picks) <= set(parallel.IMPLS)
    assert picks[2] != "gemv" and picks[3] != "gemv"          # past 8 rows the GEMV does not apply
    # up to 8 rows, a step keeps the pool spinning: only its kernels are candidates
    assert picks[0] in cpu_tune.POOL_IMPLS and picks[1] in cpu_tune.POOL_IMPLS
    for rows, pick in zip((1, 8, 64, 256), picks):
        assert parallel._impl(torch.randn(rows, 40).to(dtype), w, b) == pick
    assert list(cache.glob("linear-choices-*.json"))
    # Forced onto one implementation, a tuned shape: dense_linear runs that one.
    monkeypatch.setattr(parallel, "_choices", {(48, 40, dtype): ("torch",) * 4})
    assert parallel._impl(torch.randn(3, 40).to(dtype), w, b) == "torch"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 5, 70])
def test_every_implementation_computes_the_same_linear(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    w = torch.nn.Parameter(torch.randn(96, 200, generator=g).to(dtype), requires_grad=False)
    b = torch.randn(96, generator=g).to(dtype)
    x = torch.randn(rows, 200, generator=g).to(dtype)
    want = F.linear(x.double(), w.double(), b.double())
    names = parallel._candidates(x, w, b)
    assert "torch" in names and "gemm" in names and ("gemv" in names) == (rows <= 8)
    # Each within its own tested tolerance: fp32 sums in fp32; bf16/fp16 round the output.
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=0.1)
    with torch.inference_mode():
        for impl in names:
            got = parallel.run_linear(impl, x, w, b)
            assert got.dtype == dtype, impl
            torch.testing.assert_close(got.double(), want, **tol, msg=impl)


def test_a_row_bucket_runs_on_one_thread_family():
    """one_family: a bucket's linears all on the pool (gemm) or all on OpenMP (onednn/torch),
    whichever sums to less; within it each shape's fastest. Without timings of both: as picked."""
    timed = {"8x8@64": {"ms": {"gemm": 1.0, "onednn": 1.2, "torch": 3.0}},      # the pool wins here...
             "9x9@64": {"ms": {"gemm": 5.0, "onednn": 2.0, "torch": 1.9}},      # ... OpenMP by more here
             "8x8@256": {"ms": {"gemm": 1.0, "onednn": 4.0}}, "9x9@256": {"ms": {"gemm": 2.0, "onednn": 1.5}}}
    picked = {"8x8@64": "gemm", "9x9@64": "torch", "8x8@256": "gemm", "9x9@256": "onednn", "8x8@1": "gemv"}
    out = cpu_tune.one_family(picked, timed, ["8x8@64", "9x9@64"])
    assert out == {**picked, "8x8@64": "onednn", "9x9@64": "torch"}          # OpenMP: 1.2 + 1.9 < 1.0 + 5.0
    assert cpu_tune.one_family(picked, timed, ["8x8@256", "9x9@256"]) == {**picked, "9x9@256": "gemm"}  # 3.0 < 5.5
    untimed = {**timed, "9x9@64": {"impl": "torch", "ms": {}}}
    assert cpu_tune.one_family(picked, untimed, ["8x8@64", "9x9@64"]) == picked
    only_pool = {**timed, "9x9@64": {"ms": {"gemm": 5.0}}}
    assert cpu_tune.one_family(picked, only_pool, ["8x8@64", "9x9@64"]) == picked


def test_a_large_linear_sets_the_pools_spin_to_its_family(monkeypatch):
    """The pool's threads spin kernel to kernel while the large linears are its GEMM, and stop
    when they run on OpenMP (where a spinner would take a core from oneDNN)."""
    from pagoda.kernels import cpu_lib
    monkeypatch.setattr(cpu_lib, "_spin_always", cpu_lib._spin_always)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(32, 24, generator=g)
    big, small = torch.randn(64, 24, generator=g), torch.randn(2, 24, generator=g)
    with torch.inference_mode():
        parallel.run_linear("gemm", big, w)
        assert cpu_lib._spin_always
        parallel.run_linear("torch", small, w)         # a small step's linear leaves it
        assert cpu_lib._spin_always
        parallel.run_linear("torch", big, w)
        assert not cpu_lib._spin_always
        parallel.run_linear("gemm", big, w)
        assert cpu_lib._spin_always
    cpu_lib.set_spin_always(parallel._POOL)


def test_tune_linears_keeps_each_large_bucket_on_one_family(cache, monkeypatch):
    g = torch.Generator().manual_seed(1)
    w1 = torch.nn.Parameter(torch.randn(48, 40, generator=g), requires_grad=False)
    w2 = torch.nn.Parameter(torch.randn(40, 48, generator=g), requires_grad=False)
    monkeypatch.setattr(parallel, "_choices", {})
    # Cached per-shape picks that mix the families at 64 rows, with their timings.
    timed = {"48x40@64": {"impl": "gemm", "ms": {"gemm": 1.0, "onednn": 1.1, "torch": 1.5}},
             "40x48@64": {"impl": "onednn", "ms": {"gemm": 3.0, "onednn": 1.0, "torch": 2.0}}}
    monkeypatch.setattr(cpu_tune, "load_cache", lambda key: timed)
    monkeypatch.setattr(cpu_tune, "save_cache", lambda key, choices: None)
    tuned = parallel.tune_linears([(w1, None), (w2, None)])
    assert tuned[(48, 40, torch.float32)][2] == tuned[(40, 48, torch.float32)][2] == "onednn"


def test_a_choice_timed_on_a_busy_machine_is_timed_again_when_quieter(cache):
    """Timed at 3 runnable threads per core, the choice measured the other load: a start at most half
    as busy times it again (and stores the new load); one timed at a normal load stays for good."""
    key = cpu_tune.cache_key(torch.float32, [(64, 32)], CPUINFO)
    busy_timings = {"64x32@1": {"gemv": 3e-5, "torch": 1e-5}}       # torch won under load
    quiet_timings = {"64x32@1": {"gemv": 1e-5, "torch": 2e-5}}
    calls: list[str] = []

    def run(timings, load):
        return cpu_tune.tune(key, fake_work(timings, calls), 10.0, measure=measure_injected, load=lambda: load)
    assert run(busy_timings, 3.0) == {"64x32@1": "torch"}
    assert json.loads(cpu_tune.cache_path(key).read_text())["choices"]["64x32@1"]["busy"] == 3.0
    calls.clear()
    assert run(quiet_timings, 2.0) == {"64x32@1": "torch"} and calls == []     # not quiet enough
    assert run(quiet_timings, 0.6) == {"64x32@1": "gemv"} and len(calls) == 2  # timed again
    calls.clear()
    assert run(busy_timings, 0.1) == {"64x32@1": "gemv"} and calls == []      # 0.6 per CPU: kept for good


def test_measure_keeps_the_fastest_of_many_short_calls():
    # A call of tens of microseconds is timed up to MAX_REPS times, and the fastest is kept: one
    # late wake-up in a few reps must not decide the pick.
    durations = iter([5e-3] + [80e-6] * 5 + [30e-6] + [90e-6] * 100)   # untimed call, then timed ones
    now, calls = [0.0], [0]

    def fn():
        now[0] += next(durations)
        calls[0] += 1
    assert cpu_tune.measure(fn, clock=lambda: now[0]) == pytest.approx(30e-6)
    assert calls[0] == 1 + cpu_tune.MAX_REPS
    # A long call stops at MIN_SECONDS: two timed calls of 20 ms.
    now[0], calls[0] = 0.0, 0
    durations = iter([20e-3] * 100)
    assert cpu_tune.measure(fn, clock=lambda: now[0]) == pytest.approx(20e-3)
    assert calls[0] == 3


@pytest.mark.parametrize("gemm", ["auto", "c", "onednn", "torch"])
def test_model_load_packs_what_large_batches_will_run(monkeypatch, gemm):
    # pack_linears at load makes every packing a batch past GEMV_MAX_M rows would make, so the
    # first such batch packs nothing (a 0.5B model's first prefill used to repack 2 GB).
    g = torch.Generator().manual_seed(2)
    w1 = torch.nn.Parameter(torch.randn(48, 40, generator=g), requires_grad=False)
    w2 = torch.nn.Parameter(torch.randn(40, 48, generator=g), requires_grad=False)
    plain = torch.randn(24, 40, generator=g)          # not a parameter: packed per call, never kept
    monkeypatch.setattr(parallel, "_CPU_GEMM", gemm)
    monkeypatch.setattr(parallel, "_packs", {})
    monkeypatch.setattr(parallel, "_choices", {(48, 40, torch.float32): ("gemv", "gemm", "onednn", "gemm"),
                                               (40, 48, torch.float32): ("gemv", "gemv", "torch", "torch")})
    made = parallel.pack_linears([(w1, None), (w2, None), (plain, None)])
    onednn = parallel.onednn_takes(torch.float32)
    want = {"auto": {(w1, "gemm"), (w1, "onednn")} if onednn else {(w1, "gemm")},
            "c": {(w1, "gemm"), (w2, "gemm")},
            "onednn": {(w1, "onednn"), (w2, "onednn")} if onednn else set(),
            "torch": set()}[gemm]
    fns = {cpu_gemm.pack: "gemm", parallel._onednn_layout: "onednn"}
    got = {(w, fns[fn]) for w in (w1, w2) for (i, fn) in parallel._packs if i == id(w)}
    assert got == want and made == len(want)
    assert parallel.pack_linears([(w1, None), (w2, None)]) == 0      # packed once
    before = dict(parallel._packs)
    with torch.inference_mode():
        for rows in (1, 8, 64, 256):
            for w in (w1, w2):
                x = torch.randn(rows, w.shape[1], generator=g)
                torch.testing.assert_close(parallel.dense_linear(x, w), F.linear(x, w), rtol=1e-4, atol=1e-4)
    assert parallel._packs == before                                   # no batch packed anything


def test_small_buckets_time_only_the_pools_kernels(cache, monkeypatch):
    # a step of at most 8 rows keeps the kernels' pool spinning: OpenMP's threads (oneDNN, F.linear)
    # are no candidates there, whatever they would win alone; above, all are
    w = torch.nn.Parameter(torch.randn(48, 40), requires_grad=False)
    monkeypatch.setattr(parallel, "_choices", {})
    seen: dict[int, set[str]] = {}
    real_tune = cpu_tune.tune

    def tune(key, work, budget, **kw):
        for item in work:
            seen[item.bucket] = set(item.candidates)
        return real_tune(key, work, budget, **kw)
    monkeypatch.setattr(cpu_tune, "tune", tune)
    parallel.tune_linears([(w, None)])
    assert seen[1] == {"gemv", "gemm"} and seen[8] == {"gemv", "gemm"}
    assert {"gemm", "torch"} <= seen[64] and {"gemm", "torch"} <= seen[256]
