"""pagoda.gpu_worker.serving.step_rates: the worker's own speed, fitted from its cumulative step counters."""
import random

import pytest

from pagoda.gpu_worker.serving.step_rates import PRIOR, StepRates


def feed(rates, samples, base=0.006, per_prompt=60e-6, per_gen=0.25e-3):
    steps = secs = prompt = gen = 0
    rates.observe(0, 0.0, 0, 0)
    for n_steps, n_prompt, n_gen in samples:
        steps, prompt, gen = steps + n_steps, prompt + n_prompt, gen + n_gen
        secs += n_steps * base + n_prompt * per_prompt + n_gen * per_gen
        rates.observe(steps, secs, prompt, gen)


def test_recovers_the_step_time_model_from_varied_samples():
    rng = random.Random(0)
    r = StepRates()
    feed(r, [(rng.randint(5, 50), rng.randint(0, 50_000), rng.randint(0, 3000)) for _ in range(40)])
    assert r.step_s == pytest.approx(0.006, rel=0.02)
    assert r.prefill_tps == pytest.approx(1 / 60e-6, rel=0.02)
    assert r.decode_tps == pytest.approx(1 / 0.25e-3, rel=0.02)


def test_prior_until_measured_and_no_sample_from_idle_or_reset_counters():
    r = StepRates()
    assert (r.step_s, r.prefill_tps, r.decode_tps) == pytest.approx((PRIOR[0], 1 / PRIOR[1], 1 / PRIOR[2]))
    r.observe(10, 1.0, 100, 100)
    r.observe(10, 1.0, 100, 100)          # idle: no steps ran
    r.observe(3, 0.2, 10, 10)             # counters went back (a new engine): no sample
    assert (r.step_s, r.prefill_tps) == pytest.approx((PRIOR[0], 1 / PRIOR[1]))


def test_decode_only_samples_keep_the_prefill_rate_near_the_prior_and_positive():
    r = StepRates()
    feed(r, [(20, 0, 20 * 32)] * 30)
    assert 0 < r.prefill_tps < 100 / PRIOR[1]
    assert r.step_s > 0 and r.decode_tps > 0


def test_transfer_rate_starts_at_its_prior_and_fits_overhead_and_rate_from_completed_fetches():
    from pagoda.gpu_worker.serving.step_rates import TRANSFER_PRIOR, TransferRate
    r = TransferRate()
    assert (r.overhead_s, r.bps) == pytest.approx((TRANSFER_PRIOR[0], 1 / TRANSFER_PRIOR[1]))
    for _ in range(4):                  # 17.5 ms a call and 14.6 MB/s (bench/RESULTS.md, this CPU)
        for blocks in (64, 128, 256):
            nbytes = blocks * 8192
            r.observe(nbytes, 0.0175 + nbytes / 14.6e6)
    assert r.overhead_s == pytest.approx(0.0175, rel=0.3) and r.bps == pytest.approx(14.6e6, rel=0.1)
    r.observe(0, 1.0)                   # a fetch that moved nothing says nothing of the rate
    r.observe(8192, 0.0)
    assert r.bps == pytest.approx(14.6e6, rel=0.1)
