"""Every flag the chart passes is one `pagoda router` / `pagoda worker` accepts, and values map one to one.

The container args are resolved the way the kubelet does it ($(VAR) from the container's env and
its envFrom ConfigMap), then parsed by the real argparse parsers of router/args.py and
gpu_worker/serving/args.py.
"""
from __future__ import annotations

import contextlib
import importlib
import io
import re

import pytest

from pagoda.gpu_worker.core.spec_config import SpeculativeConfig
from tests.plugins.helm import CASES, EVERYTHING, component, containers, find, render

# `pagoda <command>` execs `python -m <module>`, whose flags live in <module>/args.py.
MODULES = {"router": "pagoda.router", "worker": "pagoda.gpu_worker"}
ARGS = {"router": "pagoda.router.args", "worker": "pagoda.gpu_worker.serving.args"}
POD = {"POD_IP": "10.1.2.3", "POD_NAME": "rel-pagoda-worker-a-5d9c-xk2"}
_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def resolved_args(docs: list[dict], container: dict) -> list[str]:
    env: dict[str, str] = {}
    for ref in container.get("envFrom", []):
        env.update(find(docs, "ConfigMap", ref["configMapRef"]["name"])[0]["data"])
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "fieldRef" in e["valueFrom"]:
            env[e["name"]] = POD[e["name"]]
        else:
            env[e["name"]] = "<from a Secret>"

    def expand(arg: str) -> str:
        unknown = [v for v in _VAR.findall(arg) if v not in env]
        assert not unknown, f"{arg!r} refers to {unknown}, which the container's env does not define"
        return _VAR.sub(lambda m: env[m.group(1)], arg)

    return [expand(a) for a in container["args"]]


def parse(cmd: str, argv: list[str]):
    parser = importlib.import_module(ARGS[cmd]).build_parser()
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            return parser, parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"pagoda {cmd} refuses the chart's args {argv}: {err.getvalue()}")


def pagoda_containers(values):
    docs = render(values)
    for d, _, c in containers(docs):
        if component(d) in MODULES:
            yield docs, d, c


def test_chart_commands_are_cli_commands():
    from pagoda.clients import cli

    seen = set()
    for _, d, c in pagoda_containers(EVERYTHING):
        assert c["command"][0] == "pagoda" and len(c["command"]) == 2
        cmd = c["command"][1]
        assert cmd == component(d) and cli._EXEC[cmd] == MODULES[cmd]
        seen.add(cmd)
    assert seen == {"router", "worker"}


@pytest.mark.parametrize("case", list(CASES))
def test_every_flag_the_chart_passes_is_accepted(case):
    for docs, d, c in pagoda_containers(CASES[case]):
        parse(c["command"][1], resolved_args(docs, c))


# Worker flags the chart does not pass yet, each with its reason (none now).
NOT_IN_CHART_YET: set[str] = set()


def option_strings(parser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings if s.startswith("--")} - {"--help"} - NOT_IN_CHART_YET


def test_values_map_one_to_one_onto_flags():
    """With every value set, the chart passes every flag each CLI has (one value each), and the parsed
    results equal the values."""
    w = EVERYTHING["workerDefaults"]
    r = EVERYTHING["router"]
    expect = {
        "router": {"index_max_blocks": r["indexMaxBlocks"], "speculative_ttl": r["speculativeTtl"],
                   "max_attempts": r["maxAttempts"], "port": 50050, "metrics_port": 9101, "http_port": 8000,
                   "redis_url": "redis://rel-pagoda-redis:6379/0", "policy": "prefix_aware",
                   "tool_call_parser": "llama3_json", "kv_fetch_hints": "off",
                   "first_token_timeout": 20, "max_snapshot_bytes": 1 << 24, "max_concurrent_streams": 512,
                   "http_max_body_bytes": 1 << 22, "http_max_json_depth": 32, "http_read_timeout": 12.5,
                   "http_idle_timeout": 40, "http_write_timeout": 15, "http_send_buffer_bytes": 1 << 17,
                   "http_batch_seqs_per_worker": 16,
                   "max_n": 4, "max_id_bytes": 128, "tls_cert": "/etc/pagoda/tls/tls.crt",
                   "tls_client_ca": "/etc/pagoda/tls/ca.crt", "api_keys_file": "/etc/pagoda/api-keys/api-keys",
                   "worker_tls_ca": "/etc/pagoda/worker-tls/ca.crt", "worker_tls_key": "/etc/pagoda/worker-tls/tls.key",
                   "worker_api_key_file": "/etc/pagoda/worker-api-key/worker-api-key"},
        "worker": {"kv_cache_memory": w["kvCacheMemory"], "num_kv_blocks": w["numKvBlocks"],
                   "max_num_batched_tokens": w["maxNumBatchedTokens"], "max_model_len": w["maxModelLen"],
                   "max_waiting": w["maxWaiting"], "heartbeat_interval": w["heartbeatInterval"],
                   "snapshot_interval": w["snapshotInterval"], "scheduling_policy": "priority", "async_scheduling": "off",
                   "scheduling_fairness": "fifo",
                   "quantization": "fp8",
                   "kv_offloading_size": 4.5, "preemption_mode": "swap",
                   "stream_interval": 4,
                   "enable_lora": True, "lora_modules": ["chat=/models/lora/chat", "sql=/models/lora/sql"],
                   "max_loras": 4, "max_lora_rank": 64,
                   "speculative_config": SpeculativeConfig("ngram", 3, prompt_lookup_max=4, prompt_lookup_min=4),
                   "metrics_prefix": "vllm", "model_impl": "transformers", "revision": "v1.2",
                   "dtype": "bfloat16", "block_size": 32, "no_prefix_caching": True, "enforce_eager": True, "port": 50051,
                   "redis_url": "redis://rel-pagoda-redis:6379/0", "gpu_memory_utilization": 0.9,
                   "max_num_seqs": 256, "drain_grace_seconds": 30, "log_level": "INFO",
                   "max_concurrent_streams": 4096, "max_prompt_bytes": 1 << 19, "max_stop": 8,
                   "tls_key": "/etc/pagoda/tls/tls.key", "api_keys_file": "/etc/pagoda/api-keys/api-keys",
                   "kv_peer_api_key_file": "/etc/pagoda/kv-peer-api-key/kv-peer-api-key",
                   "kv_fetch_max_blocks": 256, "kv_fetch_timeout": 2.5},
    }
    covered = {"router": False, "worker": False}
    for docs, d, c in pagoda_containers(EVERYTHING):
        cmd = c["command"][1]
        argv = resolved_args(docs, c)
        parser, ns = parse(cmd, argv)
        passed = [a for a in argv if a.startswith("--")]
        assert len(passed) == len(set(passed)), f"a flag passed twice: {passed}"
        assert set(passed) == option_strings(parser), \
            f"chart and `pagoda {cmd}` disagree: chart-only {set(passed) - option_strings(parser)}, " \
            f"CLI-only {option_strings(parser) - set(passed)}"
        for dest, want in expect[cmd].items():
            assert getattr(ns, dest) == want, (cmd, dest)
        if cmd == "worker":
            group = d["metadata"]["labels"]["pagoda.io/worker-group"]
            spec = next(g for g in EVERYTHING["workers"] if g["name"] == group)
            assert ns.model == spec["model"]["path"]
            assert ns.served_model_name == spec.get("servedModelName", group)
            assert ns.advertise_address == f"{POD['POD_IP']}:50051" and ns.worker_id == POD["POD_NAME"]
            assert ns.worker_name == POD["POD_NAME"]
            assert ns.device == spec.get("device", w["device"])
            assert ns.kv_role == spec.get("kvRole", w["kvRole"])
            assert ns.tensor_parallel_size == max(spec.get("gpus", 1), 1)
        covered[cmd] = True
    assert all(covered.values())


def test_unset_values_leave_the_cli_defaults():
    """null values pass no flag, so the process default applies."""
    for docs, d, c in pagoda_containers(None):
        cmd = c["command"][1]
        parser, ns = parse(cmd, resolved_args(docs, c))
        defaults = parser.parse_args(["--model", "m"] if cmd == "worker" else ["--redis-url", "redis://x"])
        unset = ["index_max_blocks", "speculative_ttl", "max_attempts", "http_max_body_bytes", "http_max_json_depth",
                 "http_read_timeout", "http_idle_timeout", "http_write_timeout", "http_send_buffer_bytes",
                 "http_batch_seqs_per_worker"] if cmd == "router" else \
            ["num_kv_blocks", "kv_cache_memory", "max_model_len", "max_num_batched_tokens", "max_waiting",
             "heartbeat_interval", "snapshot_interval", "quantization",
             "stream_interval", "kv_fetch_max_blocks", "kv_fetch_timeout", "kv_peer_api_key_file"]
        for dest in unset:
            assert getattr(ns, dest) == getattr(defaults, dest), dest


def test_several_gpus_shard_the_model_with_a_memory_backed_shm():
    """gpus: 2 -> --tensor-parallel-size 2 and /dev/shm an in-memory emptyDir (NCCL); gpus 0 or 1 -> neither."""
    seen = {}
    for docs, d, c in pagoda_containers(EVERYTHING):
        if c["command"][1] != "worker":
            continue
        group = d["metadata"]["labels"]["pagoda.io/worker-group"]
        _, ns = parse("worker", resolved_args(docs, c))
        pod = d["spec"]["template"]["spec"]
        shm = [v for v in pod["volumes"] if v["name"] == "dshm"]
        mounts = [m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        seen[group] = (ns.tensor_parallel_size, shm, mounts)
    assert seen["b"] == (2, [{"name": "dshm", "emptyDir": {"medium": "Memory"}}], [{"name": "dshm", "mountPath": "/dev/shm"}])
    assert seen["a"] == (1, [], []) and seen["c"] == (1, [], [])
