"""Per-worker circuit breaker: after repeated failures a worker sits out a cooldown that
doubles while it keeps failing; after the cooldown one trial request is let through."""
from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class _State:
    failures: int = 0
    open_until: float = 0.0
    cooldown: float = 0.0


class CircuitBreaker:
    def __init__(self, threshold: int = 2, cooldown_s: float = 2.0, max_cooldown_s: float = 30.0):
        self.threshold, self.cooldown_s, self.max_cooldown_s = threshold, cooldown_s, max_cooldown_s
        self._states: dict[str, _State] = {}

    def allow(self, worker: str, now: float | None = None) -> bool:
        s = self._states.get(worker)
        if s is None or s.failures < self.threshold:
            return True
        now = time.monotonic() if now is None else now
        if now < s.open_until:
            return False
        s.open_until = now + s.cooldown      # half-open: this one trial, then closed again or longer
        return True

    def is_open(self, worker: str, now: float | None = None) -> bool:
        s = self._states.get(worker)
        now = time.monotonic() if now is None else now
        return s is not None and s.failures >= self.threshold and now < s.open_until

    def open_workers(self, now: float | None = None) -> set[str]:
        """Workers sitting out a cooldown now (one pass over the few with failures, not the fleet)."""
        now = time.monotonic() if now is None else now
        return {w for w, s in self._states.items() if s.failures >= self.threshold and now < s.open_until}

    def failure(self, worker: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        s = self._states.setdefault(worker, _State())
        s.failures += 1
        if s.failures >= self.threshold:
            s.cooldown = min(s.cooldown * 2 if s.cooldown else self.cooldown_s, self.max_cooldown_s)
            s.open_until = now + s.cooldown

    def trip(self, worker: str, now: float | None = None) -> None:
        """Open at once: a worker that broke the stream protocol sits out a cooldown without a
        second chance first."""
        s = self._states.setdefault(worker, _State())
        s.failures = max(s.failures, self.threshold - 1)
        self.failure(worker, now)

    def success(self, worker: str) -> None:
        self._states.pop(worker, None)

    def forget(self, worker: str) -> None:
        self._states.pop(worker, None)
