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
