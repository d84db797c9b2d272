"""The router's Prometheus metrics, in a registry of its own (so tests can run several routers)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily


class RouterMetrics:
    def __init__(self, cluster, index):
        self.registry = r = CollectorRegistry()
        self.decisions = Counter("pagoda_router_decisions", "Routing decisions by policy and outcome",
                                 ["policy", "outcome"], registry=r)
        self.decision_seconds = Histogram(
            "pagoda_router_decision_seconds", "Time to tokenize, hash and score one request", registry=r,
            buckets=(0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0))
        self.attempts = Counter("pagoda_router_worker_attempts", "Requests sent to each worker by result",
                                ["worker", "result"], registry=r)
        self.predicted_cached = Counter("pagoda_router_predicted_cached_tokens",
                                        "Prompt tokens the router expected the chosen worker to have cached",
                                        registry=r)
        self.reported_cached = Counter("pagoda_router_reported_cached_tokens",
                                       "Prompt tokens workers reported as served from their cache", registry=r)
        self.prompt_tokens = Counter("pagoda_router_prompt_tokens", "Prompt tokens routed", registry=r)
        r.register(_ClusterCollector(cluster, index))


class _ClusterCollector:
    """Read at scrape time, so the figures are never stale."""

    def __init__(self, cluster, index):
        self.cluster, self.index = cluster, index

    def collect(self):
        yield GaugeMetricFamily("pagoda_router_index_blocks", "Block hashes in the router's index",
                                value=len(self.index))
        live = GaugeMetricFamily("pagoda_router_live_workers", "Workers with a live lease", labels=["model"])
        for model in self.cluster.models():
            live.add_metric([model], len(self.cluster.live(model)))
        yield live
        yield GaugeMetricFamily("pagoda_router_redis_connected", "1 while Redis answers",
                                value=1.0 if self.cluster.connected else 0.0)
