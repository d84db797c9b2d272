"""Helpers and shared value sets for the Helm chart tests: offline rendering with helm-python-sdk."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

CHART = Path(__file__).resolve().parents[2] / "helm" / "pagoda"
EXAMPLES = sorted((CHART / "examples").glob("*.yaml"))
RELEASE, NAMESPACE = "rel", "ns"


def example_values(name: str) -> dict:
    return yaml.safe_load((CHART / "examples" / f"{name}.yaml").read_text())


# Every optional feature on at once, bundled Redis with a password: the widest render.
EVERYTHING = {
    "commonLabels": {"team": "ml"},
    "imagePullSecrets": [{"name": "regcred"}],
    "redis": {"mode": "bundled", "passwordSecret": {"name": "redis-auth", "key": "pw"}},
    "router": {
        "autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 5},
        "pdb": {"enabled": True, "minAvailable": "50%"},
        "indexMaxBlocks": 200000, "speculativeTtl": 5.5, "maxAttempts": 2, "toolCallParser": "llama3_json",
        "firstTokenTimeout": 20, "maxSnapshotBytes": 1 << 24, "maxConcurrentStreams": 512,
        "http": {"maxBodyBytes": 1 << 22, "maxJsonDepth": 32, "readTimeout": 12.5, "idleTimeout": 40,
                 "writeTimeout": 15, "sendBufferBytes": 1 << 17, "batchSeqsPerWorker": 16},
        "limits": {"maxN": 4, "maxPromptBytes": 1 << 19, "maxMessages": 64, "maxPromptTokens": 8192,
                   "maxLogitBias": 100, "maxStop": 8, "maxIdBytes": 128},
        "tls": {"secretName": "router-tls", "clientCa": True}, "apiKeysSecret": {"name": "keys", "key": "k"},
        "workerTls": {"secretName": "worker-ca", "clientCert": True},
        "workerApiKeySecret": {"name": "router-key", "key": "key"}, "kvFetchHints": "off",
        "extraEnv": [{"name": "GRPC_VERBOSITY", "value": "info"}],
        "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 50, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                               "labelSelector": {"matchLabels": {"a": "b"}}}}]}},
        "service": {"type": "LoadBalancer", "annotations": {"x": "y"}},
    },
    "workerDefaults": {
        "hfTokenSecret": {"name": "hf", "key": "token"},
        "pdb": {"enabled": True, "maxUnavailable": 1},
        "topologySpread": {"enabled": True},
        "kvCacheMemory": "20GiB", "numKvBlocks": 4096, "maxNumBatchedTokens": 4096, "maxModelLen": 8192,
        "maxWaiting": 100, "heartbeatInterval": 0.25, "snapshotInterval": 2, "prefixCaching": False, "enforceEager": True,
        "schedulingPolicy": "priority", "schedulingFairness": "fifo", "metricsPrefix": "vllm", "asyncScheduling": "off",
        "streamInterval": 4,
        "quantization": "fp8",
        "speculativeConfig": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4},
        "kvOffloadingSize": 4.5, "preemptionMode": "swap", "kvRole": "decode",
        "enableLora": True, "loraModules": {"sql": "/models/lora/sql", "chat": "/models/lora/chat"},
        "maxLoras": 4, "maxLoraRank": 64,
        "modelImpl": "transformers", "revision": "v1.2", "dtype": "bfloat16", "device": "cuda", "blockSize": 32,
        "maxConcurrentStreams": 4096, "limits": {"maxN": 4, "maxPromptBytes": 1 << 19, "maxMessages": 64,
                                                  "maxPromptTokens": 8192, "maxLogitBias": 100, "maxStop": 8,
                                                  "maxIdBytes": 128},
        "tls": {"secretName": "worker-tls", "clientCa": True}, "apiKeysSecret": {"name": "keys", "key": "k"},
        "kvPeerApiKeySecret": {"name": "peer-key", "key": "key"}, "kvFetchMaxBlocks": 256, "kvFetchTimeout": 2.5,
        "nodeSelector": {"gpu": "h100"},
        "podAnnotations": {"note": "x"},
    },
    "workers": [
        {"name": "a", "replicas": 2, "kvRole": "prefill", "model": {"source": "pvc", "claimName": "m", "mountPath": "/models",
                                               "path": "/models/a"}},
        {"name": "b", "servedModelName": "org/b", "model": {"source": "hostPath", "hostPath": "/data/m",
                                                             "mountPath": "/models", "path": "/models/b"},
         "gpus": 2},
        {"name": "c", "gpus": 0, "device": "cpu", "model": {"source": "image", "path": "/opt/c"}},
    ],
    "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
                "dashboard": {"enabled": True, "labels": {"grafana_dashboard": "1"}}},
    "networkPolicy": {"enabled": True, "metricsFrom": [{"namespaceSelector": {"matchLabels": {"n": "mon"}}}]},
}

CASES = {"default": None, **{p.stem: example_values(p.stem) for p in EXAMPLES}, "everything": EVERYTHING}


def render_raw(values: dict | None = None) -> dict[str, str]:
    """Template path -> rendered text. A fresh chart per render: the SDK mutates loaded charts."""
    import helm_python

    with helm_python.Chart.load(CHART) as chart:
        return chart.render(copy.deepcopy(values), name=RELEASE, namespace=NAMESPACE)


def render(values: dict | None = None) -> list[dict]:
    """Every manifest the chart renders for `values` (NOTES.txt left out)."""
    docs = []
    for path, text in sorted(render_raw(values).items()):
        if path.endswith("NOTES.txt"):
            continue
        docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs


def render_error(values: dict) -> str:
    """The message of the error rendering `values` raises (fails the test if none)."""
    import helm_python

    with pytest.raises(helm_python.HelmError) as info:
        render_raw(values)
    return str(info.value)


def find(docs: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def containers(docs: list[dict]):
    """(deployment, pod spec, container) for every container of every workload."""
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            spec = d["spec"]["template"]["spec"]
            for c in spec.get("containers", []) + spec.get("initContainers", []):
                yield d, spec, c


def component(doc: dict) -> str:
    return doc["metadata"]["labels"].get("app.kubernetes.io/component", "")
