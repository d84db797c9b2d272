"""The router's Prometheus metrics, in a registry of its own (so tests can run several routers)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# The workers' (and vLLM's) bucket edges, so router and worker quantiles line up on one dashboard.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
ERROR_BUCKETS = (-4096, -1024, -256, -64, -16, -1, 0, 16, 64, 256, 1024, 4096)


class RouterMetrics:
    def __init__(self, cluster, index):
        self.registry = r = CollectorRegistry()
        self.decisions = Counter("pagoda_router_decisions", "Routing decisions by policy and outcome",
                                 ["policy", "outcome"], registry=r)
        pm = ["policy", "model"]
        self.decision_seconds = Histogram(
            "pagoda_router_decision_seconds", "Time to tokenize, hash and score one request", pm, registry=r,
            buckets=(0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0))
        self.ttft = Histogram("pagoda_router_time_to_first_token_seconds",
                              "Request arrival at the router to the first token relayed", pm, registry=r,
                              buckets=TTFT_BUCKETS)
        self.e2e = Histogram("pagoda_router_e2e_request_latency_seconds",
                             "Request arrival at the router to its last token relayed", pm, registry=r,
                             buckets=E2E_BUCKETS)
        self.cached_error = Histogram(
            "pagoda_router_cached_tokens_error",
            "Per decision, prompt tokens the worker reported cached minus those the router predicted "
            "(negative: the router expected a hit that was gone)", pm, registry=r, buckets=ERROR_BUCKETS)
        # Labelled by the worker's stable name (pod or --worker-name), not its per-process id,
        # so that restarts do not grow the label set.
        self.attempts = Counter("pagoda_router_worker_attempts", "Requests sent to each worker by result",
                                ["worker", "result"], registry=r)
        self.predicted_cached = Counter("pagoda_router_predicted_cached_tokens",
                                        "Prompt tokens the router expected the chosen worker to have cached",
                                        registry=r)
        self.reported_cached = Counter("pagoda_router_reported_cached_tokens",
                                       "Prompt tokens workers reported as served from their cache", registry=r)
        self.prompt_tokens = Counter("pagoda_router_prompt_tokens", "Prompt tokens routed", registry=r)
        # Prefill/decode disaggregation (router/disagg.py).
        self.pd_requests = Counter("pagoda_router_pd_requests", "Requests whose prompt a prefill worker "
                                   "computed, sent on to a decode worker with a KV fetch hint", registry=r)
        self.pd_fallbacks = Counter("pagoda_router_pd_fallbacks", "Disaggregated requests whose prompt was "
                                    "computed by the decode worker after all: prefill_failed (no prefill worker "
                                    "answered), recomputed (the fetch failed or came up short)",
                                    ["reason"], registry=r)
        self.kv_fetch_hints = Counter("pagoda_router_kv_fetch_hints",
                                      "Requests sent with a fetch hint: the worker pulls the prefix it lacks "
                                      "from a peer that holds it (--kv-fetch-hints)", ["model"], registry=r)
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
        yield GaugeMetricFamily("pagoda_router_redis_sync_healthy", "1 while the Redis sync rounds are current",
                                value=1.0 if self.cluster.healthy() else 0.0)
        yield CounterMetricFamily("pagoda_router_redis_sync_errors", "Unexpected errors the sync loop survived",
                                  value=self.cluster.sync_errors)
        yield CounterMetricFamily("pagoda_router_redis_rejected_values", "Redis values refused by their schema",
                                  value=self.cluster.rejected)
