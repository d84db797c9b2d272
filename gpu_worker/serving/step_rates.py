"""A worker's own speed, measured, in the step-time model the router's cost is written in:

    step seconds = step_s + prompt tokens computed / prefill_tps + tokens generated / decode_tps

fitted by least squares over the engine's cumulative counters (steps, seconds spent in steps,
prompt and generated tokens), one sample per heartbeat, older samples decaying. A weak prior
keeps the fit sane until the samples vary enough to tell the three terms apart (an idle worker,
or one that only ever decodes, still reports numbers of the right size). The publisher puts the
result in the lease; routers turn queued work into time with it.
"""
from __future__ import annotations

import math
from typing import Sequence

# A generic GPU until measured: 5 ms per step, 10k prompt tokens/s, 2k decoding sequences/s.
PRIOR = (0.005, 1e-4, 5e-4)


class StepRates:
    def __init__(self, prior: Sequence[float] = PRIOR, decay: float = 0.97, prior_weight: float = 1e-3):
        self.prior, self.decay, self.prior_weight = tuple(prior), decay, prior_weight
        self.theta = list(self.prior)          # step_s, seconds per prompt token, per generated token
        self._ata = [[0.0] * 3 for _ in range(3)]
        self._aty = [0.0] * 3
        self._last: tuple[float, ...] | None = None

    def observe(self, steps: int, step_seconds: float, prompt_tokens: int, generation_tokens: int) -> None:
        """Cumulative counters; the difference from the previous call is one sample."""
        now = (float(steps), float(step_seconds), float(prompt_tokens), float(generation_tokens))
        last, self._last = self._last, now
        if last is None or now[0] <= last[0]:
            return                              # first call, idle, or counters reset
        x = (now[0] - last[0], now[2] - last[2], now[3] - last[3])
        y = now[1] - last[1]
        if y <= 0 or min(x) < 0:
            return
        for i in range(3):
            self._aty[i] = self.decay * self._aty[i] + x[i] * y
            for j in range(3):
                self._ata[i][j] = self.decay * self._ata[i][j] + x[i] * x[j]
        self._fit()

    def _fit(self) -> None:
        # Ridge toward the prior, scaled per term by how much data there is on it.
        a = [row[:] for row in self._ata]
        b = self._aty[:]
        for i in range(3):
            w = self.prior_weight * a[i][i] + 1e-12
            a[i][i] += w
            b[i] += w * self.prior[i]
        theta = _solve3(a, b)
        if theta is not None:
            # Negative or vanishing terms mean the samples cannot separate them yet: floor at
            # a hundredth of the prior rather than report an infinite rate.
            self.theta = [max(t, p / 100) for t, p in zip(theta, self.prior)]

    @property
    def step_s(self) -> float:
        return self.theta[0]

    @property
    def prefill_tps(self) -> float:
        return 1.0 / self.theta[1]

    @property
    def decode_tps(self) -> float:
        return 1.0 / self.theta[2]


def _solve3(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when singular."""
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for c in range(3):
        p = max(range(c, 3), key=lambda r: abs(m[r][c]))
        if abs(m[p][c]) < 1e-300:
            return None
        m[c], m[p] = m[p], m[c]
        for r in range(c + 1, 3):
            f = m[r][c] / m[c][c]
            for k in range(c, 4):
                m[r][k] -= f * m[c][k]
    x = [0.0] * 3
    for r in (2, 1, 0):
        x[r] = (m[r][3] - sum(m[r][k] * x[k] for k in range(r + 1, 3))) / m[r][r]
    return x if all(math.isfinite(v) for v in x) else None


# A KV fetch from a peer until measured: 20 ms a call (engine-thread commands, a gRPC stream) and
# 200 MB/s (one gRPC message a block; on this CPU a tiny model's 8 KiB blocks ran at ~15 MB/s
# after ~17 ms, bench/RESULTS.md, and a real model's 1-2 MiB blocks run far faster).
TRANSFER_PRIOR = (0.02, 1.0 / 200e6)


class TransferRate:
    """seconds = overhead_s + bytes / bps, fitted over completed fetches by least squares, older
    ones decaying, ridge toward TRANSFER_PRIOR weighted as `prior_weight` of a fetch of
    `prior_bytes`: the first fetch moves the figures most of the way, and fetches of one size
    alone cannot tell overhead from rate, which then stay near the prior's split."""

    def __init__(self, prior: Sequence[float] = TRANSFER_PRIOR, decay: float = 0.9, prior_bytes: float = 1 << 20,
                 prior_weight: float = 0.1):
        self.prior, self.decay = tuple(prior), decay
        self._w = [prior_weight ** 0.5, prior_weight ** 0.5 * prior_bytes]   # per term, in its unit
        self._s = [0.0] * 5                   # decayed sums: n, x, x^2, y, xy
        self.theta = list(self.prior)

    def observe(self, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or not seconds > 0:
            return
        x, y, s = float(nbytes), float(seconds), self._s
        for i, v in enumerate((1.0, x, x * x, y, x * y)):
            s[i] = self.decay * s[i] + v
        (wa, wb), (a0, b0) = self._w, self.prior
        a11, a12, a22 = s[0] + wa, s[1], s[2] + wb * wb
        b1, b2 = s[3] + wa * a0, s[4] + wb * wb * b0
        det = a11 * a22 - a12 * a12
        if det > 0:
            a, b = (b1 * a22 - a12 * b2) / det, (a11 * b2 - a12 * b1) / det
            self.theta = [max(a, 0.0), max(b, b0 / 1000)]

    @property
    def overhead_s(self) -> float:
        return self.theta[0]

    @property
    def bps(self) -> float:
        return 1.0 / self.theta[1]
