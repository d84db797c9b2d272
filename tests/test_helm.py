"""The Helm chart, rendered offline: Kubernetes validity, wiring, toggles, schema and lint."""
from __future__ import annotations

import copy
import importlib.util
import json

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import SchemaNotFoundError

from tests.plugins.helm import (
    CASES,
    CHART,
    EVERYTHING,
    EXAMPLES,
    component,
    containers,
    example_values,
    find,
    render,
    render_error,
)

KUBE_VERSIONS = ["1.27.0", "1.33.0"]
GPU = "nvidia.com/gpu"

def merged(base: dict | None, **over) -> dict:
    """`base` with dotted-path overrides, e.g. merged(None, **{"router.pdb.enabled": False})."""
    out = copy.deepcopy(base or {})
    for path, value in over.items():
        node = out
        keys = path.split(".")
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = value
    return out


def names(docs) -> set[tuple[str, str]]:
    return {(d["kind"], d["metadata"]["name"]) for d in docs}


def selects(selector: dict, labels: dict) -> bool:
    """Kubernetes label-selector semantics (matchLabels and the In/NotIn/Exists operators)."""
    for k, v in (selector.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for e in selector.get("matchExpressions") or []:
        key, op, vals = e["key"], e["operator"], e.get("values", [])
        if (op == "In" and labels.get(key) not in vals) or (op == "NotIn" and labels.get(key) in vals) \
                or (op == "Exists" and key not in labels) or (op == "DoesNotExist" and key in labels):
            return False
    return True


def pod_labels(docs) -> dict[str, dict]:
    return {d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"] for d in find(docs, "Deployment")}


def test_examples_cover_the_issue():
    assert {"development", "production", "two-models", "disaggregated"} <= {p.stem for p in EXAMPLES}


# --- Kubernetes validity and lint ---------------------------------------------------------------------

def check_service_monitor(sm: dict, docs: list[dict]):
    """No Kubernetes schema for the Prometheus Operator CRD: check its shape and that it selects something."""
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(sm["spec"]) <= {"selector", "namespaceSelector", "endpoints"}
    scraped = [s for s in find(docs, "Service") if selects(sm["spec"]["selector"], s["metadata"]["labels"])
               and any(p["name"] == "metrics" for p in s["spec"]["ports"])]
    assert scraped and all(e["port"] == "metrics" for e in sm["spec"]["endpoints"])


@pytest.mark.parametrize("kube", KUBE_VERSIONS)
@pytest.mark.parametrize("case", list(CASES))
def test_manifests_validate_strict(case, kube):
    docs = render(CASES[case])
    assert docs
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, kube, strict=True)
        except SchemaNotFoundError:
            assert doc["kind"] == "ServiceMonitor", f"no schema for {doc['kind']}"
            check_service_monitor(doc, docs)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{case}: {doc['kind']}/{doc['metadata']['name']} invalid for {kube}: "
                        f"{'.'.join(map(str, e.path))}: {e.message}")


@pytest.mark.parametrize("kube", KUBE_VERSIONS)
@pytest.mark.parametrize("case", list(CASES))
def test_lint_clean(case, kube):
    import helm_python

    report = helm_python.lint(CHART, copy.deepcopy(CASES[case]), strict=True, kube_version=f"v{kube}")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not problems and not report["errors"], problems or report["errors"]


def test_strict_validation_catches_a_bad_manifest():
    """The validity test above can fail: an unknown field in a rendered object is reported."""
    dep = copy.deepcopy(find(render(), "Deployment")[0])
    dep["spec"]["template"]["spec"]["containers"][0]["bogusField"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, "1.27.0", strict=True)


# --- wiring ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", list(CASES))
def test_selectors_match_labels(case):
    docs = render(CASES[case])
    pods = pod_labels(docs)
    for d in find(docs, "Deployment"):
        sel = d["spec"]["selector"]
        # Each Deployment owns exactly its own pods: selectors never overlap.
        assert [n for n, labels in pods.items() if selects(sel, labels)] == [d["metadata"]["name"]]
        for tsc in d["spec"]["template"]["spec"].get("topologySpreadConstraints", []):
            assert selects(tsc["labelSelector"], pods[d["metadata"]["name"]])
    for svc in find(docs, "Service"):
        owners = [n for n, labels in pods.items() if selects({"matchLabels": svc["spec"]["selector"]}, labels)]
        assert len(owners) == 1, (svc["metadata"]["name"], owners)
        dep = find(docs, "Deployment", owners[0])[0]
        port_names = {p["name"] for c in dep["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= port_names
    for pdb in find(docs, "PodDisruptionBudget"):
        assert len([n for n, labels in pods.items() if selects(pdb["spec"]["selector"], labels)]) == 1
    for hpa in find(docs, "HorizontalPodAutoscaler"):
        assert find(docs, "Deployment", hpa["spec"]["scaleTargetRef"]["name"])
    for np in find(docs, "NetworkPolicy"):
        assert any(selects(np["spec"]["podSelector"], labels) for labels in pods.values())
    for cm_user, _, c in containers(docs):
        for ref in c.get("envFrom", []):
            assert find(docs, "ConfigMap", ref["configMapRef"]["name"]), cm_user["metadata"]["name"]


@pytest.mark.parametrize("case", list(CASES))
def test_probes_are_grpc_on_numeric_ports(case):
    docs = render(CASES[case])
    pagoda = [(d, c) for d, _, c in containers(docs) if component(d) in ("router", "worker")]
    assert {component(d) for d, _ in pagoda} == {"router", "worker"}
    for d, c in pagoda:
        grpc_port = next(p["containerPort"] for p in c["ports"] if p["name"] == "grpc")
        # Kubelet gRPC probes cannot speak TLS: a TLS server's port is checked with tcpSocket.
        tls = "--tls-cert" in c["args"]
        check = "tcpSocket" if tls else "grpc"
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            spec = c[probe]
            assert set(spec) & {"httpGet", "tcpSocket", "exec", "grpc"} == {check}
            assert isinstance(spec[check]["port"], int) and spec[check]["port"] == grpc_port
        if component(d) == "worker":
            startup = c["startupProbe"]
            # Loading a checkpoint takes minutes: the default budget must allow at least ten.
            assert startup["periodSeconds"] * startup["failureThreshold"] >= (300 if case == "development" else 600)


@pytest.mark.parametrize("case", list(CASES))
def test_grpc_services_declare_app_protocol(case):
    docs = render(CASES[case])
    grpc_ports = [p for s in find(docs, "Service") for p in s["spec"]["ports"] if p["name"] == "grpc"]
    assert grpc_ports and all(p["appProtocol"] == "grpc" for p in grpc_ports)


@pytest.mark.parametrize("case", list(CASES))
def test_gpu_requests_land_on_workers_only(case):
    values = CASES[case]
    docs = render(values)
    groups = {g["name"]: g for g in (values or {}).get("workers", render_defaults()["workers"])}
    defaults = {**render_defaults()["workerDefaults"], **(values or {}).get("workerDefaults", {})}
    seen_gpu = False
    for d, _, c in containers(docs):
        res = c.get("resources", {})
        gpu_keys = {k for part in ("requests", "limits") for k in res.get(part, {}) if "gpu" in k}
        if component(d) != "worker":
            assert not gpu_keys, d["metadata"]["name"]
            continue
        group = d["metadata"]["labels"]["pagoda.io/worker-group"]
        want = groups[group].get("gpus", defaults["gpus"])
        if want:
            seen_gpu = True
            assert res["requests"][GPU] == res["limits"][GPU] == want
        else:
            assert not gpu_keys
    assert seen_gpu == (case != "development")


def render_defaults() -> dict:
    return yaml.safe_load((CHART / "values.yaml").read_text())


@pytest.mark.parametrize("case", list(CASES))
def test_secrets_are_referenced_never_inlined(case):
    values = CASES[case]
    docs = render(values)
    assert not find(docs, "Secret")
    redis_secret = ((values or {}).get("redis") or {}).get("passwordSecret", {}).get("name")
    for d, _, c in containers(docs):
        env = {e["name"]: e for e in c.get("env", [])}
        for name in ("REDIS_PASSWORD", "HF_TOKEN"):
            if name in env:
                assert "value" not in env[name] and env[name]["valueFrom"]["secretKeyRef"]["name"]
        if redis_secret and component(d) in ("router", "worker"):
            assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == redis_secret
    # Nothing that looks like a credential travels in a ConfigMap or an argument.
    for cm in find(docs, "ConfigMap"):
        url = cm["data"].get("PAGODA_FLAG_REDIS_URL", "")
        assert "@" not in url


def test_security_contexts_are_non_root():
    docs = render(EVERYTHING)
    for d, spec, c in containers(docs):
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] > 0
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
        assert sc["capabilities"]["drop"] == ["ALL"]
        assert spec["automountServiceAccountToken"] is False


def test_worker_wiring_per_model_source():
    docs = render(EVERYTHING)
    by_group = {d["metadata"]["labels"]["pagoda.io/worker-group"]: d for d in find(docs, "Deployment")
                if component(d) == "worker"}
    vols = {g: {v["name"]: v for v in d["spec"]["template"]["spec"]["volumes"]} for g, d in by_group.items()}
    assert vols["a"]["model"]["persistentVolumeClaim"] == {"claimName": "m", "readOnly": True}
    assert vols["b"]["model"]["hostPath"]["path"] == "/data/m"
    assert "model" not in vols["c"]
    for g, d in by_group.items():
        c = d["spec"]["template"]["spec"]["containers"][0]
        mounts = {m["name"]: m for m in c["volumeMounts"]}
        assert ("model" in mounts) == (g != "c")
        if g != "c":
            assert mounts["model"]["readOnly"] is True and mounts["model"]["mountPath"] == "/models"
        env = {e["name"]: e for e in c["env"]}
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "token"}
        i = c["args"].index("--advertise-address")
        assert c["args"][i + 1] == f"$(POD_IP):{c['ports'][0]['containerPort']}"
    served = {find(docs, "ConfigMap", f"rel-pagoda-worker-{g}")[0]["data"]["PAGODA_FLAG_SERVED_MODEL_NAME"]
              for g in by_group}
    assert served == {"a", "org/b", "c"}


def test_two_models_are_separate_deployments():
    values = example_values("two-models")
    docs = render(values)
    workers = [d for d in find(docs, "Deployment") if component(d) == "worker"]
    assert len(workers) == len(values["workers"]) == 2
    models = set()
    for d, g in zip(sorted(workers, key=lambda d: d["metadata"]["name"]),
                    sorted(values["workers"], key=lambda g: g["name"])):
        assert d["spec"]["replicas"] == g["replicas"]
        cm = find(docs, "ConfigMap", d["spec"]["template"]["spec"]["containers"][0]["envFrom"][0]["configMapRef"]["name"])[0]
        assert cm["data"]["PAGODA_FLAG_MODEL"] == g["model"]["path"]
        models.add(cm["data"]["PAGODA_FLAG_SERVED_MODEL_NAME"])
    assert len(models) == 2


# --- toggles --------------------------------------------------------------------------------------------

BUNDLED = {"redis": {"mode": "bundled"}}
EXTERNAL = {"redis": {"mode": "external", "url": "redis://r.infra:6379/0"}}

TOGGLES = [
    # (dotted key, on, off, base values, objects that "on" adds)
    ("router.autoscaling.enabled", True, False, None, {("HorizontalPodAutoscaler", "rel-pagoda-router")}),
    ("router.pdb.enabled", True, False, None, {("PodDisruptionBudget", "rel-pagoda-router")}),
    ("workerDefaults.pdb.enabled", True, False, None, {("PodDisruptionBudget", "rel-pagoda-worker-default")}),
    ("metrics.serviceMonitor.enabled", True, False, None, {("ServiceMonitor", "rel-pagoda")}),
    ("networkPolicy.enabled", True, False, BUNDLED, {("NetworkPolicy", "rel-pagoda-router"),
                                                     ("NetworkPolicy", "rel-pagoda-worker-default"),
                                                     ("NetworkPolicy", "rel-pagoda-redis")}),
    ("networkPolicy.enabled", True, False, EXTERNAL, {("NetworkPolicy", "rel-pagoda-router"),
                                                      ("NetworkPolicy", "rel-pagoda-worker-default")}),
    # NetworkPolicy is on by default: the bundled Redis brings its own.
    ("redis.mode", "bundled", "external", EXTERNAL, {("Deployment", "rel-pagoda-redis"),
                                                     ("Service", "rel-pagoda-redis"),
                                                     ("NetworkPolicy", "rel-pagoda-redis")}),
    ("router.metricsPort", 9101, 0, None, {("Service", "rel-pagoda-router-metrics")}),
]


def test_router_service_exposes_the_http_port():
    def ports(http_port):
        docs = render(merged(None, **{"router.httpPort": http_port, "router.service.httpPort": 80}))
        svc = find(docs, "Service", "rel-pagoda-router")[0]
        return ({p["name"]: p["port"] for p in svc["spec"]["ports"]},
                {p["name"]: p["containerPort"] for p in container_of(docs, "rel-pagoda-router")["ports"]})
    assert ports(8080) == ({"grpc": 50050, "http": 80}, {"grpc": 50050, "http": 8080, "metrics": 9101})
    assert ports(0) == ({"grpc": 50050}, {"grpc": 50050, "metrics": 9101})


@pytest.mark.parametrize("key,on,off,base,added", TOGGLES, ids=[f"{t[0]}={t[1]}" for t in TOGGLES])
def test_toggle_adds_and_removes_what_it_names(key, on, off, base, added):
    with_on, with_off = render(merged(base, **{key: on})), render(merged(base, **{key: off}))
    assert names(with_on) - names(with_off) == added
    assert names(with_off) - names(with_on) == set()


def test_autoscaling_takes_over_replicas():
    on = find(render(merged(None, **{"router.autoscaling.enabled": True})), "Deployment", "rel-pagoda-router")[0]
    off = find(render(merged(None, **{"router.replicas": 3})), "Deployment", "rel-pagoda-router")[0]
    assert "replicas" not in on["spec"] and off["spec"]["replicas"] == 3


def container_of(docs, deployment: str) -> dict:
    return find(docs, "Deployment", deployment)[0]["spec"]["template"]["spec"]["containers"][0]


FIELD_TOGGLES = [
    # (dotted key, on, off, deployment, predicate on its container/pod that holds only when on)
    ("redis.passwordSecret.name", "auth", "", "rel-pagoda-router",
     lambda c, p: any(e["name"] == "REDIS_PASSWORD" for e in c["env"])),
    ("redis.passwordSecret.name", "auth", "", "rel-pagoda-worker-default",
     lambda c, p: any(e["name"] == "REDIS_PASSWORD" for e in c["env"])),
    ("redis.passwordSecret.name", "auth", "", "rel-pagoda-redis",
     lambda c, p: "--requirepass" in c["args"] and c["env"][0]["valueFrom"]["secretKeyRef"]["name"] == "auth"),
    ("workerDefaults.hfTokenSecret.name", "hf", "", "rel-pagoda-worker-default",
     lambda c, p: any(e["name"] == "HF_TOKEN" for e in c["env"])),
    ("workerDefaults.prefixCaching", False, True, "rel-pagoda-worker-default",
     lambda c, p: "--no-prefix-caching" in c["args"]),
    ("workerDefaults.gpus", 2, 0, "rel-pagoda-worker-default",
     lambda c, p: c["resources"]["limits"].get(GPU) == 2),
    ("router.topologySpread.enabled", True, False, "rel-pagoda-router",
     lambda c, p: "topologySpreadConstraints" in p),
    ("workerDefaults.topologySpread.enabled", True, False, "rel-pagoda-worker-default",
     lambda c, p: "topologySpreadConstraints" in p),
    ("workerDefaults.metricsPort", 9100, 0, "rel-pagoda-worker-default",
     lambda c, p: any(port["name"] == "metrics" for port in c["ports"])),
    ("workerDefaults.compileCache.claimName", "triton", "", "rel-pagoda-worker-default",
     lambda c, p: {"name": "compile-cache", "persistentVolumeClaim": {"claimName": "triton"}} in p["volumes"]),
]


def test_worker_triton_cache_is_on_its_volume():
    c = container_of(render(BUNDLED), "rel-pagoda-worker-default")
    cache_dir = next(e["value"] for e in c["env"] if e["name"] == "TRITON_CACHE_DIR")
    assert {"name": "compile-cache", "mountPath": cache_dir} in c["volumeMounts"]


@pytest.mark.parametrize("key,on,off,deployment,holds", FIELD_TOGGLES,
                         ids=[f"{t[0]}@{t[3]}" for t in FIELD_TOGGLES])
def test_field_toggles(key, on, off, deployment, holds):
    for value, expected in ((on, True), (off, False)):
        docs = render(merged(BUNDLED, **{key: value}))
        dep = find(docs, "Deployment", deployment)[0]
        assert holds(container_of(docs, deployment), dep["spec"]["template"]["spec"]) is expected, value


def test_config_change_rolls_only_the_pods_it_configures():
    def checksums(values):
        return {d["metadata"]["name"]: d["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
                for d in find(render(values), "Deployment") if "checksum/config" in
                d["spec"]["template"]["metadata"].get("annotations", {})}

    two = example_values("two-models")
    base = checksums(two)
    assert set(base) == {"rel-pagoda-router", "rel-pagoda-worker-llama", "rel-pagoda-worker-qwen"}
    policy = checksums(merged(two, **{"router.policy": "least_loaded"}))
    assert {n for n in base if base[n] != policy[n]} == {"rel-pagoda-router"}
    bumped = copy.deepcopy(two)
    bumped["workers"][1]["maxNumSeqs"] = 64
    seqs = checksums(bumped)
    assert {n for n in base if base[n] != seqs[n]} == {"rel-pagoda-worker-qwen"}
    redis = checksums(merged(two, **{"redis.url": "redis://other:6379/0"}))
    assert {n for n in base if base[n] != redis[n]} == set(base)


# --- bad values -----------------------------------------------------------------------------------------

DEFAULT_GROUP = {"name": "g", "model": {"source": "pvc", "claimName": "m", "mountPath": "/models",
                                        "path": "/models/x"}}

SCHEMA_REFUSES = [
    ({"router": {"replicas": -1}}, "/router/replicas"),
    ({"workerDefaults": {"replicas": -1}}, "/workerDefaults"),
    ({"workers": [{**DEFAULT_GROUP, "replicas": -2}]}, "/workers/0"),
    ({"bogus": 1}, "'bogus'"),
    ({"router": {"bogus": 1}}, "'bogus'"),
    ({"router": {"autoscaling": {"enabled": True, "bogus": 1}}}, "'bogus'"),
    ({"router": {"resources": {"request": {"cpu": "1"}}}}, "'request'"),
    ({"workerDefaults": {"tolerations": [{"kye": "x", "operator": "Exists"}]}}, "'kye'"),
    ({"workers": [{**DEFAULT_GROUP, "modle": {}}]}, "'modle'"),
    ({"workerDefaults": {"name": "x"}}, "/workerDefaults/name"),
    ({"redis": {"mode": "external", "url": "redis-master:6379"}}, "/redis/url"),
    ({"redis": {"mode": "external", "url": "redis.infra/0"}}, "/redis/url"),
    ({"redis": {"mode": "external"}}, "/redis/url"),
    ({"redis": {"mode": "external", "url": "redis://:hunter2@redis:6379/0"}}, "/redis/url"),
    ({"redis": {"password": "hunter2"}}, "'password'"),
    ({"router": {"policy": "random"}}, "/router/policy"),
    ({"router": {"metricsPort": 70000}}, "/router/metricsPort"),
    ({"router": {"http": {"maxJsonDepth": 1000}}}, "/router/http/maxJsonDepth"),
    ({"router": {"http": {"readTimeout": 0}}}, "/router/http/readTimeout"),
    ({"router": {"http": {"idleTimeut": 5}}}, "'idleTimeut'"),
    ({"workers": []}, "/workers"),
    ({"workers": [{**DEFAULT_GROUP, "name": "Bad_Name"}]}, "/workers/0"),
    ({"workerDefaults": {"gpuMemoryUtilization": 1.5}}, "/workerDefaults"),
    ({"workerDefaults": {"gpus": -1}}, "/workerDefaults"),
    ({"workerDefaults": {"kvCacheMemory": "lots"}}, "/workerDefaults"),
    ({"securityContext": {"runAsUser": 0}}, "/securityContext/runAsUser"),
    ({"workerDefaults": {"speculativeConfig": {"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}}},
     "/workerDefaults"),
    ({"workerDefaults": {"speculativeConfig": {"method": "ngram", "num_speculative_tokens": 0}}}, "/workerDefaults"),
    ({"workerDefaults": {"kvOffloadingSize": -1}}, "/workerDefaults"),
    ({"workerDefaults": {"preemptionMode": "drop"}}, "/workerDefaults"),
    ({"workerDefaults": {"maxLoras": 0}}, "/workerDefaults"),
    ({"workerDefaults": {"enableLora": True, "loraModules": {"a=b": "/models/x"}}}, "/workerDefaults"),
    ({"workerDefaults": {"enableLora": True, "loraModules": {"sql": ""}}}, "/workerDefaults"),
]


@pytest.mark.parametrize("values,where", SCHEMA_REFUSES, ids=[json.dumps(v)[:60] for v, _ in SCHEMA_REFUSES])
def test_schema_refuses_bad_values(values, where):
    message = render_error(values)
    assert "schema" in message and where in message, message


TEMPLATE_REFUSES = [
    ({"workers": [DEFAULT_GROUP, DEFAULT_GROUP]}, 'workers[1].name: "g" is used by two groups'),
    ({"workers": [{"name": "g", "model": {"source": "pvc", "path": "/models/x"}}]}, "model.claimName: required"),
    ({"workers": [{"name": "g", "model": {"source": "hostPath", "path": "/models/x"}}]}, "model.hostPath: required"),
    ({"workers": [{"name": "g", "model": {"source": "image"}}]}, "model.path: required"),
    ({"workers": [{**DEFAULT_GROUP, "model": {**DEFAULT_GROUP["model"], "path": "/elsewhere/x"}}]},
     "model.path: \"/elsewhere/x\" is not under model.mountPath"),
    ({"router": {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}}},
     "router.autoscaling.minReplicas"),
    ({"router": {"autoscaling": {"enabled": True}, "resources": {"requests": {"cpu": None}}}},
     "router.resources.requests.cpu"),
    ({"workerDefaults": {"drainGraceSeconds": 300}}, "probes.liveness"),
    ({"workerDefaults": {"rollingUpdate": {"maxSurge": 0, "maxUnavailable": 0}}}, "rollingUpdate"),
    ({"workerDefaults": {"asyncScheduling": "on", "speculativeConfig": {"method": "ngram", "num_speculative_tokens": 2}}},
     "speculativeConfig: needs asyncScheduling auto or off"),
    ({"workerDefaults": {"preemptionMode": "swap"}}, "preemptionMode: swap needs kvOffloadingSize > 0"),
    ({"workerDefaults": {"loraModules": {"sql": "/models/sql"}}}, "loraModules: adapters need enableLora"),
]


@pytest.mark.parametrize("values,fragment", TEMPLATE_REFUSES, ids=[f[:40] for _, f in TEMPLATE_REFUSES])
def test_templates_refuse_inconsistent_values(values, fragment):
    message = render_error(values)
    assert fragment in message, message


def test_schema_has_no_open_objects():
    """additionalProperties is false on every object with named keys; maps constrain their values."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    open_objects = []

    def walk(node, path):
        if isinstance(node, dict):
            if "properties" in node and node.get("additionalProperties") is not False:
                open_objects.append(path)
            if node.get("type") in ("object", ["object", "null"]) and "properties" not in node:
                if not isinstance(node.get("additionalProperties"), dict):
                    open_objects.append(path)
            for k, v in node.items():
                if k in ("if", "then", "else", "not"):
                    continue    # constraints on an object described elsewhere, not objects of their own
                if k == "allOf" and any("$ref" in m for m in v):
                    v = [m for m in v if "$ref" in m]   # the other members only add constraints to the $ref
                walk(v, f"{path}/{k}")
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{path}/{i}")

    walk(schema, "")
    assert not open_objects


def test_schema_embeds_current_kubernetes_definitions():
    spec = importlib.util.spec_from_file_location("k8s_schema_defs", CHART.parent / "tools" / "k8s_schema_defs.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert tool.refreshed(schema) == schema, "run python helm/tools/k8s_schema_defs.py"


def test_tls_and_key_files_the_chart_passes_come_from_the_named_secrets():
    docs = render(EVERYTHING)
    want = {"router": {"router-tls", "keys", "worker-ca", "router-key"}, "worker": {"worker-tls", "keys", "peer-key"}}
    for d, spec, c in containers(docs):
        if component(d) not in want:
            continue
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        secrets = {v["name"]: v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
        assert set(secrets.values()) == want[component(d)]
        assert all(m["readOnly"] for m in c["volumeMounts"] if m["name"] in secrets)
        cm = find(docs, "ConfigMap", c["envFrom"][0]["configMapRef"]["name"])[0]["data"]
        files = [v for k, v in cm.items() if k.endswith(("_CERT", "_KEY", "_CA", "_FILE"))]
        assert files and all(any(f.startswith(mounts[n] + "/") for n in secrets) for f in files), files


def test_direct_mode_clients_may_reach_workers_when_named():
    """networkPolicy.directFrom adds peers to the workers' gRPC ingress, beside the routers."""
    peer = {"namespaceSelector": {"matchLabels": {"team": "search"}}}
    for extra, want in ((None, []), ({"networkPolicy": {"directFrom": [peer]}}, [peer])):
        np = find(render(extra), "NetworkPolicy", "rel-pagoda-worker-default")[0]
        grpc_rule = np["spec"]["ingress"][0]
        assert [p for p in grpc_rule["from"] if "podSelector" not in p] == want
        assert any(p.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/component") == "router"
                   for p in grpc_rule["from"])
        # Peers of its group fetch KV from it (a router's fetch hint).
        assert any(p.get("podSelector", {}).get("matchLabels", {}).get("pagoda.io/worker-group") == "default"
                   for p in grpc_rule["from"])


def test_decode_workers_may_fetch_from_prefill_workers():
    """Prefill/decode disaggregation: two groups of one model, one per --kv-role; the prefill
    group's gRPC port also admits the release's workers (decode workers fetch KV blocks there),
    other groups' only the routers and their own group's peers."""
    from tests.test_helm_flags import resolved_args
    docs = render(example_values("disaggregated"))
    roles = {}
    for d, _, c in containers(docs):
        if component(d) == "worker":
            args = resolved_args(docs, c)
            roles[d["metadata"]["labels"]["pagoda.io/worker-group"]] = args[args.index("--kv-role") + 1]
    assert roles == {"prefill": "prefill", "decode": "decode"}
    for group, fetched in (("prefill", True), ("decode", False)):
        rule = find(docs, "NetworkPolicy", f"rel-pagoda-worker-{group}")[0]["spec"]["ingress"][0]
        comps = [p["podSelector"]["matchLabels"] for p in rule["from"]]
        workers = [m for m in comps if m.get("app.kubernetes.io/component") == "worker"
                   and "pagoda.io/worker-group" not in m]      # beyond its own group's peers
        assert workers == ([{"app.kubernetes.io/name": "pagoda", "app.kubernetes.io/instance": "rel",
                             "app.kubernetes.io/component": "worker"}] if fetched else [])
