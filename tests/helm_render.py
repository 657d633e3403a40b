"""Render the chart offline with Helm's own Go library (helm-python-sdk) and read what it
renders (tests only): objects by kind, the RayService's groups and what each pod offers Ray.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm"
CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))
RELEASE, NAMESPACE = "demo", "inference"
KUBE_VERSION = "v1.35.0"


def load_values(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text()) or {}


@lru_cache(maxsize=1)
def _chart() -> Any:
    import helm_python

    return helm_python.Chart.load(str(CHART))


def render(values: dict[str, Any] | None = None,
           api_versions: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Every object the chart renders (as `helm template` would), NOTES.txt left out.

    ``Chart.render`` has no keyword for the API versions the cluster serves, but the C ABI's
    render options take ``api_versions`` and ``kube_version`` (``helm template
    --api-versions``, ``--kube-version``): the native call is made with them here.
    """
    from helm_python import _native

    opts = {"name": RELEASE, "namespace": NAMESPACE, "is_install": True,
            "kube_version": KUBE_VERSION, "api_versions": list(api_versions)}
    out = json.loads(_native.call_string("helm_render", _chart()._raw(),
                                         json.dumps(values or {}), json.dumps(opts)))
    docs = []
    for path, text in sorted(out.items()):
        if path.endswith(".yaml"):
            docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def render_notes(values: dict[str, Any] | None = None) -> str:
    out = _chart().render(values=values or {}, name=RELEASE, namespace=NAMESPACE)
    return next(v for k, v in out.items() if k.endswith("NOTES.txt"))


def of_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def rayservice(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (rs,) = of_kind(docs, "RayService")
    return rs


def serve_config(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return yaml.safe_load(rayservice(docs)["spec"]["serveConfigV2"])


def groups(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """name -> the KubeRay group spec ("head" for the head group)."""
    cluster = rayservice(docs)["spec"]["rayClusterConfig"]
    return {"head": cluster["headGroupSpec"],
            **{g["groupName"]: g for g in cluster["workerGroupSpecs"]}}


def ray_resources_param(value: str) -> dict[str, float]:
    """KubeRay's `resources` rayStartParam: a JSON object quoted for the shell."""
    inner = json.loads(value) if value.startswith('"') else value
    return {k: float(v) for k, v in json.loads(inner).items()}


def node_offer(group: dict[str, Any]) -> dict[str, float]:
    """What one pod of the group offers Ray: CPU, GPU and its custom resources."""
    p = group["rayStartParams"]
    offer = {"CPU": float(p["num-cpus"]), "GPU": float(p.get("num-gpus", 0))}
    offer.update(ray_resources_param(p.get("resources", '"{}"')))
    return offer


def ray_container(group: dict[str, Any]) -> dict[str, Any]:
    return group["template"]["spec"]["containers"][0]  # KubeRay: the first is Ray's


def plain_env(group: dict[str, Any]) -> dict[str, str]:
    """The Ray container's environment variables that have literal values."""
    return {e["name"]: e["value"] for e in ray_container(group).get("env", []) if "value" in e}
