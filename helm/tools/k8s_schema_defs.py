"""Refreshes the Kubernetes object schemas embedded in helm/pagoda/values.schema.json.

Values such as `resources`, `tolerations`, `affinity`, `extraEnv` and network-policy peers are
passed through to manifests unchanged. Embedding Kubernetes' own strict schemas for them (from
the kubernetes-validate package, at the oldest Kubernetes the chart supports) lets the values
schema refuse unknown keys inside them too, as it does everywhere else.

    python helm/tools/k8s_schema_defs.py          # rewrite the $defs named k8s.*
    python helm/tools/k8s_schema_defs.py --check  # exit 1 if they are stale
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import importlib_resources

SCHEMA = Path(__file__).resolve().parents[1] / "pagoda" / "values.schema.json"
KUBE_VERSION = "1.27.0"
ROOTS = [
    "io.k8s.api.core.v1.Affinity",
    "io.k8s.api.core.v1.Toleration",
    "io.k8s.api.core.v1.ResourceRequirements",
    "io.k8s.api.core.v1.EnvVar",
    "io.k8s.api.networking.v1.NetworkPolicyPeer",
]
_REF = re.compile(r"^#/\$defs/(.+)$")


def _short(name: str) -> str:
    return "k8s." + name.rsplit(".", 1)[-1]


def _rewrite(node, found: list[str]):
    """Drop descriptions (size) and point refs at the short names; collect referenced names."""
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            if key == "description" or key.startswith("x-kubernetes-"):
                continue
            if key == "$ref":
                target = _REF.match(value).group(1)
                found.append(target)
                value = "#/$defs/" + _short(target)
            out[key] = _rewrite(value, found)
        return out
    if isinstance(node, list):
        return [_rewrite(v, found) for v in node]
    return node


def k8s_defs() -> dict:
    base = importlib_resources.files("kubernetes_validate") / "kubernetes-json-schema"
    source = json.loads((base / f"v{KUBE_VERSION}-local-strict" / "_definitions.json").read_text())["$defs"]
    defs: dict[str, dict] = {}
    todo, seen = list(ROOTS), set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        short = _short(name)
        if short in defs:
            raise SystemExit(f"two Kubernetes definitions shorten to {short}")
        refs: list[str] = []
        defs[short] = _rewrite(source[name], refs)
        todo.extend(refs)
    return dict(sorted(defs.items()))


def refreshed(schema: dict) -> dict:
    ours = {k: v for k, v in schema["$defs"].items() if not k.startswith("k8s.")}
    return {**schema, "$defs": {**ours, **k8s_defs()}}


def main(argv: list[str]) -> int:
    schema = json.loads(SCHEMA.read_text())
    new = refreshed(schema)
    if "--check" in argv:
        return 0 if new == schema else 1
    SCHEMA.write_text(json.dumps(new, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
