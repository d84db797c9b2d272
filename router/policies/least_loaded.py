"""least_loaded: router/scoring.py's cost with no cache saving (C = 0): the least loaded worker
wins, whatever it holds of the prompt. What each holds is still reported (Choice.cached_tokens)."""
from __future__ import annotations

from pagoda.router.policies.base import Query, Settings
from pagoda.router.scoring import Choice, FigureTables, WorkerState, add_lora_load, cheapest, device_hits, host_hits, load_and_cost


class LeastLoaded:
    name = "least_loaded"
    spread = False

    def __init__(self, settings: Settings):
        self.rng, self.balance = settings.rng, settings.balance
        self.tables = FigureTables()

    def rank(self, q: Query, workers: list[WorkerState], limit: int | None) -> list[Choice]:
        block = workers[0].lease.block_size
        f = self.tables.get(q.model, workers, q.adapter)
        _, cost, _ = load_and_cost(f, q.prompt_len, q.output_tokens, q.now, self.balance)
        cached = device_hits(f, q.overlap, block, q.cap)
        if q.adapter:
            add_lora_load(cost, workers, q.adapter)
        if q.tiered:
            host_hits(f, cached, q.tiered, block, q.cap)
        return cheapest(workers, cost, cached, q.prefix, limit, self.rng)
