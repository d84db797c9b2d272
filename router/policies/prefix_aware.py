"""prefix_aware (the default): router/scoring.py's cost with the cache saving: the overlap C saves
prefill(C), blocks in host memory save their prefill less the copy back (the host tier), a prefix
another worker holds costs the cheaper of computing and fetching it (fetch hints), and a hot
prefix's copy is priced at its share (SPREAD). The model is written down in scoring's docstring."""
from __future__ import annotations

import numpy as np

from pagoda.router.policies.base import Query, Settings
from pagoda.router.scoring import (
    DEFAULT_KV_COPY_TPS,
    Choice,
    Figures,
    FigureTables,
    WorkerState,
    add_lora_load,
    cheapest,
    device_hits,
    host_hits,
    load_and_cost,
    price_fetch,
)


class PrefixAware:
    name = "prefix_aware"

    def __init__(self, settings: Settings):
        self.rng, self.balance, self.spread = settings.rng, settings.balance, settings.spread
        self.fetch = settings.fetch
        self.tables = FigureTables()

    def rank(self, q: Query, workers: list[WorkerState], limit: int | None) -> list[Choice]:
        block = workers[0].lease.block_size
        f = self.tables.get(q.model, workers, q.adapter)
        load, cost, bound = load_and_cost(f, q.prompt_len, q.output_tokens, q.now, self.balance)
        cached = device_hits(f, q.overlap, block, q.cap)
        for i, c in cached.items():         # the overlap C saves prefill(C)
            cost[i] -= c * f.per_token[i]
        device = dict(cached) if q.tiered else cached    # host_hits extends `cached` in place
        if q.adapter:
            add_lora_load(cost, workers, q.adapter)
        if q.tiered:
            for i, extra in host_hits(f, cached, q.tiered, block, q.cap).items():     # its prefill less the copy
                per_token = f.per_token[i]
                copy = min(1.0 / (f.workers[i].lease.kv_copy_tps or DEFAULT_KV_COPY_TPS), per_token)
                cost[i] -= extra * (per_token - copy)
        lacking, plan = None, None
        if self.fetch and device and len(workers) > 1:
            lacking, plan = price_fetch(f, cost, device, cached, load, block)
        if self.spread and q.prefix is not None and device:
            price_copy(f, cost, device, q.prefix, load, bound, lacking)
        return cheapest(workers, cost, cached, q.prefix, limit, self.rng, plan)


def price_copy(f: Figures, cost: np.ndarray, cached: dict[int, int], prefix: bytes, load: np.ndarray,
               bound: float, lacking_s: np.ndarray | None = None) -> None:
    """Once every deepest holder of a hot prefix runs past the balance bound, its copy is priced at
    its share: a worker holding less of it pays the prefill of what it lacks (or `lacking_s`, the
    cheaper of that and its fetch, per worker) divided by the requests a new copy would take
    (SPREAD in router/scoring.py's docstring); `cost` is changed in place."""
    deepest = max(cached.values())
    holders = [i for i, c in cached.items() if c == deepest]
    live = 0
    for i in holders:
        if load[i] <= bound:        # a holder with room takes it: no copy is needed
            return
        live += f.workers[i].prefix_live.get(prefix, 0)
    share = live / (len(holders) + 1)
    if share <= 1.0:
        return
    if lacking_s is None:
        lacking = np.full(len(cost), float(deepest))
        for i, c in cached.items():
            lacking[i] -= c
        lacking *= f.per_token
    else:
        lacking = lacking_s.copy()
    lacking *= 1.0 - 1.0 / share
    cost -= lacking
