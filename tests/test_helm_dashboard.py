"""The chart's Grafana dashboard: shipped as a ConfigMap when asked, and every series it queries is
one the router or a worker (under either metrics prefix) really exports."""
from __future__ import annotations

import json
import re

from tests.plugins.helm import EVERYTHING, find, render


def dashboard(values) -> dict | None:
    maps = [d for d in find(render(values), "ConfigMap") if d["metadata"]["name"].endswith("-dashboard")]
    return json.loads(maps[0]["data"]["pagoda.json"]) if maps else None


def exported_names() -> set[str]:
    """Every series name a router and a worker (with either prefix) export, suffixes included."""
    from pagoda.gpu_worker.core.outputs import EngineStats
    from pagoda.gpu_worker.serving.metrics import WorkerMetrics
    from pagoda.router.cluster import Cluster
    from pagoda.router.index import BlockIndex
    from pagoda.router.metrics import RouterMetrics
    # Every optional part on (speculation, a host KV tier, multi-LoRA), so that all series show.
    stats = EngineStats(running=0, waiting=0, queued_prefill_tokens=0, num_blocks=1, free_blocks=1, kv_usage=0.0,
                        prefix_cache_queries=0, prefix_cache_hits=0, preemptions=0, prompt_tokens=0,
                        generation_tokens=0, tokens_stored=0, blocks_held=0, block_size=16,
                        spec_num_drafts=0, spec_accepted_per_pos=(0,), host_blocks=1, max_lora=1)
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_count", "_sum"], "gauge": [""]}
    names = set()
    for registry in [RouterMetrics(Cluster("redis://127.0.0.1:1", BlockIndex()), BlockIndex()).registry] + \
            [WorkerMetrics(lambda: stats, "m", p).registry for p in ("pagoda", "vllm")]:
        for family in registry.collect():
            names |= {family.name + x for x in suffixes[family.type]}
    return names


def test_off_by_default_and_labelled_for_the_grafana_sidecar_when_on():
    assert dashboard(None) is None
    cm = [d for d in find(render(EVERYTHING), "ConfigMap") if d["metadata"]["name"].endswith("-dashboard")][0]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"


def test_every_queried_series_is_exported():
    dash = dashboard(EVERYTHING)
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 15
    have = exported_names()
    wanted = set()
    for e in exprs:
        wanted |= set(re.findall(r"\b(pagoda_router_[a-z0-9_]+)", e))
        for stem in re.findall(r'__name__=~"\(vllm\|pagoda\):([a-z_]+)"', e):
            wanted |= {f"vllm:{stem}", f"pagoda:{stem}"}
    assert any(w.startswith("vllm:") for w in wanted) and any(w.startswith("pagoda_router_") for w in wanted)
    missing = {w for w in wanted if w not in have}
    assert not missing, missing
