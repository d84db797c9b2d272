"""The discrete-event loop of the routing simulator, and the figures it reports.

Simulated time drives everything: request arrivals, worker steps, and publish ticks at
which every worker's KV events, leases and snapshots go to Redis and the router catches
up from Redis. So the router decides on a view that lags the truth by up to one publish
interval (block events) or one heartbeat (load), as in production. Wall time is measured
only around the router's decisions.
"""
from __future__ import annotations

import heapq
import itertools
import statistics
from dataclasses import dataclass

from pagoda.protos.block_hash import block_hashes

from .worker import SimWorker
from .workloads import SimRequest


@dataclass
class SimConfig:
    block_size: int = 16
    num_blocks: int = 4096                 # per worker: 64k tokens of KV
    max_num_seqs: int = 128
    max_batched_tokens: int = 4096
    publish_interval_s: float = 0.05       # KV events reach Redis (and the router) this often
    heartbeat_s: float = 0.5               # leases with load figures
    snapshot_s: float = 5.0
    ttft_slo_s: float = 0.5                # goodput counts requests whose first token came within this


@dataclass
class Result:
    policy: str
    workload: str
    workers: int
    requests: int
    hit_rate: float
    regret: float
    imbalance: float          # max / mean of requests per worker
    busy_imbalance: float     # max / mean of GPU-busy seconds per worker
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    goodput: float            # requests/s meeting the TTFT SLO
    throughput: float         # output tokens/s, first arrival to last finish
    decision_p50_us: float    # wall clock: includes time this process waited for a CPU
    decision_p99_us: float
    decision_cpu_p50_us: float   # this thread's CPU time: the decision's own cost
    decision_cpu_p99_us: float
    decisions_per_s: float    # one router process, one core: 1 / mean CPU time per decision
    sim_seconds: float


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


class Simulation:
    def __init__(self, firsts: list[SimRequest], workers: list[SimWorker], policy, bus,
                 config: SimConfig, root: bytes):
        self.workers, self.policy, self.bus, self.cfg, self.root = workers, policy, bus, config, root
        self.heap: list = []
        self._seq = itertools.count()
        self.done: list[SimRequest] = []
        self.busy_s = [0.0] * len(workers)
        self.decision_ns: list[int] = []
        self.pending = 0
        for r in firsts:
            self._push(r.arrival, "arrive", r)
            n = r
            while n is not None:
                self.pending += 1
                n = n.follow_up

    def _push(self, t: float, kind: str, obj) -> None:
        heapq.heappush(self.heap, (t, next(self._seq), kind, obj))

    def run(self) -> None:
        self.bus.publish(self.workers, 0.0, force=True)
        self.policy.sync(0.0)
        self._push(self.cfg.publish_interval_s, "tick", None)
        while self.pending:
            now, _, kind, obj = heapq.heappop(self.heap)
            if kind == "arrive":
                self._arrive(obj, now)
            elif kind == "step":
                self._step(obj, now)
            elif kind == "fetched":
                self._fetched(*obj, now)
            else:
                self.bus.publish(self.workers, now)
                self.policy.sync(now)
                self._push(now + self.cfg.publish_interval_s, "tick", None)

    def _arrive(self, r: SimRequest, now: float) -> None:
        if not r.hashes:
            r.hashes = block_hashes(r.prompt, self.cfg.block_size, self.root)
        r.arrival = now
        r.best_hit = max(w.cached_prefix_tokens(r) for w in self.workers)
        w, wall_ns, cpu_ns = self.policy.choose(r, now)
        self.decision_ns.append((wall_ns, cpu_ns))
        r.worker = w
        if r.fetch is not None:         # the hint: pull what the source holds of the prefix first
            src, blocks = r.fetch
            worker, source = self.workers[w], self.workers[src]
            have = source.holds(r.hashes[:blocks])
            lacking = have - worker.holds(r.hashes[:have])
            if lacking > 0:
                dt = worker.cost.fetch_time(lacking, self.cfg.block_size)
                self._push(now + dt, "fetched", (w, r, r.hashes[:have]))
                return
        self._fetched(w, r, [], now)

    def _fetched(self, w: int, r: SimRequest, hashes: list[bytes], now: float) -> None:
        worker = self.workers[w]
        worker.import_blocks(hashes)
        worker.add(r)
        if not worker.busy:
            self._start(w, now)

    def _start(self, w: int, now: float) -> None:
        dt = self.workers[w].plan_step()
        self.workers[w].busy = dt > 0
        if dt > 0:
            self.workers[w].step_end = now + dt
            self.busy_s[w] += dt
            self._push(now + dt, "step", w)

    def _step(self, w: int, now: float) -> None:
        first, finished = self.workers[w].end_step(now)
        for r in first:
            self.policy.on_first_token(r, now)
        for r in finished:
            self.policy.on_finish(r, now)
            self.done.append(r)
            self.pending -= 1
            if r.follow_up is not None:
                self._push(now + r.follow_up.think, "arrive", r.follow_up)
        self._start(w, now)

    def result(self, policy: str, workload: str) -> Result:
        reqs = self.done
        prompt = sum(len(r.prompt) for r in reqs)
        hit = sum(r.hit for r in reqs)
        paid = prompt - hit
        avoidable = sum(max(0, r.best_hit - r.hit) for r in reqs)
        counts = [0] * len(self.workers)
        for r in reqs:
            counts[r.worker] += 1
        ttft = [r.t_first - r.arrival for r in reqs]
        span = max(r.t_finish for r in reqs) - min(r.arrival for r in reqs)
        wall = [w / 1000 for w, _ in self.decision_ns]
        cpu = [c / 1000 for _, c in self.decision_ns]
        mean_cpu = statistics.fmean(cpu)
        mean_busy = statistics.fmean(self.busy_s)
        return Result(policy, workload, len(self.workers), len(reqs), hit / prompt,
                      avoidable / paid if paid else 0.0,
                      max(counts) / statistics.fmean(counts),
                      max(self.busy_s) / mean_busy if mean_busy else 1.0,
                      pct(ttft, 0.5), pct(ttft, 0.9), pct(ttft, 0.99),
                      sum(1 for t in ttft if t <= self.cfg.ttft_slo_s) / span,
                      sum(len(r.output) for r in reqs) / span,
                      pct(wall, 0.5), pct(wall, 0.99), pct(cpu, 0.5), pct(cpu, 0.99),
                      1e6 / mean_cpu if mean_cpu else float("nan"), span)
