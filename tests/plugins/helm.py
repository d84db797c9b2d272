"""Fixtures for the Helm chart tests: offline rendering with helm-python-sdk, manifests as dicts."""
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


@pytest.fixture(params=["default"] + [p.stem for p in EXAMPLES])
def values_case(request) -> tuple[str, dict | None]:
    """Each shipped value set: the chart defaults and every file in helm/pagoda/examples/."""
    name = request.param
    return name, None if name == "default" else example_values(name)
