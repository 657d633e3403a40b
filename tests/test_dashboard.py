"""The Grafana dashboard (helm/dashboards/specserve.json): every PromQL expression
names only metrics a running service exports (Ray's metrics endpoint, scraped after a
workload that exercises every panel: drafts, ngram, spec-off, cache misses, an error)."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path

import pytest
from test_service import _clients

DASHBOARD = Path(__file__).parent.parent / "helm" / "dashboards" / "specserve.json"
APP = "specserve-dash"
METRIC = re.compile(r"\bray_specserve_[a-z0-9_]+\b")


def _expressions() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dash["panels"] for t in p["targets"]]


def test_dashboard_is_well_formed():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "specserve" and len(dash["panels"]) >= 12
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    for topic in ("tokens/s", "time to first token", "inter-token", "acceptance rate",
                  "acceptance length", "position", "k chosen", "round time split",
                  "batch size", "cache repairs", "errors"):
        assert topic in titles, topic
    for expr in _expressions():
        assert expr.count("(") == expr.count(")") and METRIC.search(expr), expr
    ids = [p["id"] for p in dash["panels"]]
    assert len(set(ids)) == len(ids)


@pytest.fixture(scope="module")
def small_cache_app(service):
    """An app whose 64 KiB KV budgets force cache misses (the repair panels)."""
    from ray import serve

    from deployments.app import build_app

    serve.run(build_app({"target": {"cache_bytes": 1 << 16}, "drafter": {"cache_bytes": 1 << 16},
                         "redis_url": service.redis_url}),
              name=APP, route_prefix=f"/{APP}")
    yield APP
    serve.delete(APP)


def _exported(url: str) -> set[str]:
    with urllib.request.urlopen(url, timeout=30) as r:
        text = r.read().decode()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines()
            if line and not line.startswith("#")}


def test_every_panel_query_names_an_exported_metric(service, small_cache_app):
    jobs = ([{"prompt": "def read_config(path):\n", "max_tokens": 24, "spec": "draft", "k": 4}]
            * 2 + [{"prompt": "class Stack:\n", "max_tokens": 16, "spec": "ngram", "k": 3},
                   {"prompt": "import os\n", "max_tokens": 8, "spec": "off", "k": 0},
                   {"prompt": "x", "max_tokens": 8, "temperature": -1.0}])  # an error
    results = _clients(service.grpc_address, jobs, app=small_cache_app)
    assert [r.get("error") for r in results] == [None] * 4 + ["INVALID_ARGUMENT"]
    wanted = {m for e in _expressions() for m in METRIC.findall(e)}
    deadline = time.monotonic() + 90  # Ray exports metrics periodically
    while True:
        missing = wanted - _exported(service.metrics_url)
        if not missing:
            break
        assert time.monotonic() < deadline, sorted(missing)
        time.sleep(2)
