"""round_robin: each model's workers in turn, by worker id, whatever their load or cache (for
comparison, and as a fallback that needs no reports)."""
from __future__ import annotations

import itertools

from pagoda.router.policies.base import Query, Settings
from pagoda.router.scoring import Choice, WorkerState


class RoundRobin:
    name = "round_robin"
    spread = False

    def __init__(self, settings: Settings):
        """Rotation reads none of the settings."""
        self._turns: dict[str, itertools.count] = {}

    def rank(self, q: Query, workers: list[WorkerState], limit: int | None) -> list[Choice]:
        block = workers[0].lease.block_size
        workers = sorted(workers, key=lambda w: w.id)
        start = next(self._turns.setdefault(q.model, itertools.count())) % len(workers)
        order = workers[start:] + workers[:start]
        return [Choice(w, float(i), min(q.overlap.get(w.id, 0) * block, q.cap), q.prefix)
                for i, w in enumerate(order)][:limit]
