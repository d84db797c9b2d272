"""Prometheus metrics of one worker, named as vLLM names them: under `pagoda:` by default, or
with prefix "vllm" exactly as vLLM exposes them (`vllm:` names, labels model_name and engine),
so that vLLM's dashboards, KEDA rules and alerts work unchanged. Series vLLM has no name for
stay under `pagoda:` either way.

Load gauges and cumulative token counters are read from engine.stats() at scrape time, so they
cost nothing per step; latency histograms are observed by the server as tokens stream out.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily

from pagoda.runtime.metrics_http import start_metrics_server

if TYPE_CHECKING:     # outputs and kv_transfer import torch; the metrics need only the field names
    from pagoda.gpu_worker.core.outputs import EngineStats
    from pagoda.gpu_worker.serving.kv_transfer import TransferTally

# Same bucket edges as vLLM's, so existing dashboards' quantiles read the same.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


PREFIXES = ("pagoda", "vllm")
# Where vLLM's name differs from ours (vLLM v1's PrometheusStatLogger), and ours it lacks.
_VLLM_NAMES = {"inter_token_latency_seconds": "time_per_output_token_seconds"}
_PAGODA_ONLY = {"num_kv_blocks", "num_free_kv_blocks", "prefill_tokens_computed", "num_host_kv_blocks",
                "host_kv_cached_blocks", "kv_tier_copied_blocks", "num_swaps", "kv_transfer_blocks",
                "kv_transfer_bytes", "kv_transfer_seconds", "kv_transfer_failures"}


class _Naming:
    def __init__(self, prefix: str, model_name: str):
        if prefix not in PREFIXES:
            raise ValueError(f"metrics_prefix: must be one of {', '.join(PREFIXES)} (got {prefix!r})")
        self.vllm = prefix == "vllm"
        # vLLM labels every series with its engine index; one engine per pagoda worker.
        self.labels = ["model_name", "engine"] if self.vllm else ["model_name"]
        self.values = [model_name, "0"] if self.vllm else [model_name]

    def __call__(self, name: str) -> str:
        if self.vllm and name not in _PAGODA_ONLY:
            return "vllm:" + _VLLM_NAMES.get(name, name)
        return "pagoda:" + name


class _EngineCollector:
    """Turns one engine.stats() snapshot into the load gauges and token counters."""

    def __init__(self, stats: Callable[[], "EngineStats"], naming: _Naming):
        self.stats, self.naming = stats, naming

    def collect(self):
        s, n = self.stats(), self.naming

        def gauge(name, doc, value):
            g = GaugeMetricFamily(n(name), doc, labels=n.labels)
            g.add_metric(n.values, value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(n(name), doc, labels=n.labels)
            c.add_metric(n.values, value)
            return c

        yield gauge("num_requests_running", "Requests in the running batch.", s.running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", s.waiting)
        yield gauge("kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent.", s.kv_usage)
        yield gauge("num_kv_blocks", "Blocks in the KV-cache pool.", s.num_blocks)
        yield gauge("num_free_kv_blocks", "Free or evictable KV-cache blocks.", s.free_blocks)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits)
        yield counter("num_preemptions", "Preemptions (requests sent back to recompute).", s.preemptions)
        # As vLLM: a request's whole prompt, computed or cached, once it starts generating.
        yield counter("prompt_tokens", "Prompt tokens of requests, computed or served from the prefix cache.",
                      s.request_prompt_tokens)
        by_source = CounterMetricFamily(n("prompt_tokens_by_source"), "Prompt tokens of requests by source.",
                                        labels=n.labels + ["source"])
        by_source.add_metric(n.values + ["local_compute"], s.request_prompt_tokens - s.request_cached_tokens)
        by_source.add_metric(n.values + ["local_cache_hit"], s.request_cached_tokens)
        yield by_source
        yield counter("prompt_tokens_cached", "Prompt tokens of requests served from the prefix cache.",
                      s.request_cached_tokens)
        yield counter("prefill_tokens_computed", "Prefill tokens computed (recompute after preemption "
                      "included).", s.prompt_tokens)
        yield counter("generation_tokens", "Tokens generated.", s.generation_tokens)
        if s.host_blocks:                       # a host KV tier (--kv-offloading-size)
            yield gauge("num_host_kv_blocks", "Blocks in the host KV tier.", s.host_blocks)
            yield gauge("host_kv_cached_blocks", "Prefix-cache blocks the host tier holds.", s.host_cached_blocks)
            yield counter("kv_tier_copied_blocks", "Blocks copied between the device pool and the host tier.",
                          s.kv_copied_blocks)
            yield counter("num_swaps", "Preemptions that swapped the request's KV to the host tier.", s.swaps)
        if s.max_lora:      # multi-LoRA on: vLLM's info gauge, its labels the adapters in use
            info = GaugeMetricFamily(n("lora_requests_info"), "Running stats on LoRA requests.",
                                     labels=n.labels + ["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
            info.add_metric(n.values + [str(s.max_lora), ",".join(s.waiting_lora_adapters),
                                        ",".join(s.running_lora_adapters)], time.time())
            yield info
        if s.spec_num_drafts is not None:       # speculative decoding on
            yield counter("spec_decode_num_drafts", "Speculative proposals verified (one per sequence "
                          "and step).", s.spec_num_drafts)
            yield counter("spec_decode_num_draft_tokens", "Draft tokens verified.", s.spec_num_draft_tokens)
            yield counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.", s.spec_num_accepted_tokens)
            per_pos = CounterMetricFamily(n("spec_decode_num_accepted_tokens_per_pos"),
                                          "Draft tokens accepted, by position in the draft.",
                                          labels=n.labels + ["position"])
            for pos, count in enumerate(s.spec_accepted_per_pos):
                per_pos.add_metric(n.values + [str(pos)], count)
            yield per_pos


class _TransferCollector:
    """KV transfer between workers (gpu_worker/serving/kv_transfer.py), by role: "fetcher" (this
    worker pulled a prefix from a peer) and "source" (a peer pulled from it)."""

    def __init__(self, tallies: dict[str, "TransferTally"], naming: _Naming):
        self.tallies, self.naming = tallies, naming

    def collect(self):
        n = self.naming
        labels = n.labels + ["role"]
        blocks = CounterMetricFamily(n("kv_transfer_blocks"), "KV blocks moved between workers (by failed "
                                     "transfers too: those that arrived whole).", labels=labels)
        nbytes = CounterMetricFamily(n("kv_transfer_bytes"), "Bytes of KV blocks moved between workers.",
                                     labels=labels)
        seconds = SummaryMetricFamily(n("kv_transfer_seconds"), "KV transfer calls and their seconds, "
                                      "failed ones included.", labels=labels)
        failures = CounterMetricFamily(n("kv_transfer_failures"), "KV transfers that failed, by reason "
                                       "(the request recomputed what did not arrive).", labels=labels + ["reason"])
        for role, t in self.tallies.items():
            values = n.values + [role]
            blocks.add_metric(values, t.blocks)
            nbytes.add_metric(values, t.bytes)
            seconds.add_metric(values, t.calls, t.seconds)
            for reason, count in sorted(t.failures.items()):
                failures.add_metric(values + [reason], count)
        yield from (blocks, nbytes, seconds, failures)


class WorkerMetrics:
    """One registry per worker (not the process-global one), so tests can run several."""

    def __init__(self, stats: Callable[[], "EngineStats"], model_name: str, prefix: str = "pagoda",
                 kv_role: str = "both"):
        self.registry = r = CollectorRegistry()
        n = self.naming = _Naming(prefix, model_name)
        r.register(_EngineCollector(stats, n))
        # Latency by the worker's --kv-role, so one dashboard sets prefill and decode pools apart
        # (under disaggregation a decode worker's TTFT includes its KV fetch).
        by_role = (n.labels + ["kv_role"], n.values + [kv_role])
        self.ttft = Histogram(n("time_to_first_token_seconds"), "Time to first token.", by_role[0],
                              registry=r, buckets=TTFT_BUCKETS).labels(*by_role[1])
        self.itl = Histogram(n("inter_token_latency_seconds"), "Time between streamed tokens.", by_role[0],
                             registry=r, buckets=ITL_BUCKETS).labels(*by_role[1])
        self.e2e = Histogram(n("e2e_request_latency_seconds"), "Request latency, arrival to finish.", n.labels,
                             registry=r, buckets=E2E_BUCKETS).labels(*n.values)
        self.success = Counter(n("request_success"), "Finished requests by finish reason.",
                               n.labels + ["finished_reason"], registry=r)
        self._server: Any = None

    def add_kv_transfer(self, fetched: "TransferTally", served: "TransferTally") -> None:
        """Export the worker's KV transfer tallies (read at scrape time)."""
        self.registry.register(_TransferCollector({"fetcher": fetched, "source": served}, self.naming))

    def request_finished(self, reason: str) -> None:
        self.success.labels(*self.naming.values, reason or "abort").inc()

    def serve(self, host: str, port: int) -> int:
        """Starts the HTTP exporter in a daemon thread; returns the bound port."""
        self._server = start_metrics_server(port, host, self.registry)
        return self._server.server_port

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
