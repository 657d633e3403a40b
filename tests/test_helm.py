"""The Helm chart (helm/): rendered offline by Helm's own Go library (helm-python-sdk), linted
strictly, every built-in kind validated by kubernetes-validate (strict schemas), the
RayService validated against KubeRay's CRD (openAPIV3Schema), its serveConfigV2 args
validated by AppConfig, every deployment checked to fit the group it is pinned to; bad
values fail at render with a clear message. Then the stand-in for a cluster: a local
multi-node Ray cluster built from the rendered RayService receives the rendered
serveConfigV2 through Serve's REST API, as KubeRay does (tests/helm_cluster.py).
"""

from __future__ import annotations

import copy
import importlib
import json
import re
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path
from typing import Any

import pytest
import yaml
from helm_render import (
    CHART,
    CI_VALUES,
    KUBE_VERSION,
    ROOT,
    groups,
    load_values,
    node_offer,
    of_kind,
    plain_env,
    ray_container,
    rayservice,
    render,
    render_notes,
    serve_config,
)

from deployments.config import AppConfig

unit = pytest.mark.unit
CASES = [None, *CI_VALUES]  # None: the chart's defaults
IDS = ["defaults", *(p.stem for p in CI_VALUES)]
# KubeRay's CRD, unchanged (ray-operator/config/crd/bases): shared/ sits beside the checkout
CRD = ROOT.parent / "shared" / "kuberay" / "ray.io_rayservices.yaml"
BUILTIN_KINDS = {"Service", "StatefulSet", "NetworkPolicy", "PodDisruptionBudget"}
DEPLOYMENTS = ("router", "drafter", "target")


def _values(case: Path | None) -> dict[str, Any]:
    return load_values(case) if case else {}


@lru_cache(maxsize=16)
def _rendered(case: Path | None) -> list[dict[str, Any]]:
    return render(_values(case))


def _merged(case: Path | None) -> dict[str, Any]:
    from helm_render import _chart

    return _chart().merge_values(_values(case))


def _app(docs: list[dict[str, Any]]) -> AppConfig:
    (app,) = serve_config(docs)["applications"]
    return AppConfig.model_validate(app["args"])


@unit
def test_chart_is_a_v2_chart_with_a_strict_draft07_schema() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2"
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"
    loose = []

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            if "properties" in node and node.get("additionalProperties") is not False:
                loose.append(path)
            for k, v in node.items():
                walk(v, f"{path}/{k}")
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{path}/{i}")

    walk(schema, "")
    assert not loose, f"objects with fixed keys that accept unknown ones: {loose}"


@unit
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_lint_strict(case: Path | None) -> None:
    import helm_python

    report = helm_python.lint(str(CHART), _values(case), strict=True,
                              kube_version=KUBE_VERSION)
    bad = [m for m in report["messages"] if m["severity"] >= 2]
    assert not report["errors"] and not bad, report
    assert report["total_charts_linted"] == 1


@unit
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_builtin_kinds_validate_strictly(case: Path | None) -> None:
    import kubernetes_validate
    from kubernetes_validate.utils import latest_version

    docs = _rendered(case)
    kinds = {d["kind"] for d in docs}
    assert {"RayService", "Service"} <= kinds
    assert kinds <= BUILTIN_KINDS | {"RayService", "PodMonitor"}, kinds
    # the chart's oldest supported version (Chart.yaml kubeVersion) and the newest shipped
    for version in ("1.27.0", latest_version()):
        for doc in docs:
            if doc["kind"] in BUILTIN_KINDS:
                kubernetes_validate.validate(doc, version, strict=True)


def _strict(node: Any) -> Any:
    """An openAPIV3Schema as the API server applies it with strict field validation:
    unknown fields refused (unless x-kubernetes-preserve-unknown-fields), nullable."""
    if isinstance(node, list):
        return [_strict(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _strict(v) for k, v in node.items()}
    if "properties" in out and not out.get("x-kubernetes-preserve-unknown-fields"):
        out.setdefault("additionalProperties", False)
    if out.get("nullable") and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    return out


@lru_cache(maxsize=1)
def _rayservice_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD.read_text())
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return _strict(v1["schema"]["openAPIV3Schema"])


@unit
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_rayservice_matches_the_kuberay_crd(case: Path | None) -> None:
    import jsonschema

    rs = rayservice(_rendered(case))
    assert rs["apiVersion"] == "ray.io/v1"
    jsonschema.Draft7Validator(_rayservice_schema()).validate(rs)
    bad = copy.deepcopy(rs)  # the validation has teeth: a misspelt field is refused
    bad["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParam"] = {}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(_rayservice_schema()).validate(bad)


@unit
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_serve_config_is_the_apps_config(case: Path | None) -> None:
    from deployments.local import SERVICER_FUNCTIONS

    docs, merged = _rendered(case), _merged(case)
    cfg = serve_config(docs)
    (app,) = cfg["applications"]
    assert app["import_path"] == "deployments.app:build_app"
    for path in SERVICER_FUNCTIONS:  # each resolves to a function
        module, name = path.rsplit(".", 1)
        assert callable(getattr(importlib.import_module(module), name))
    assert cfg["grpc_options"] == {"port": merged["serve"]["grpcPort"],
                                   "grpc_servicer_functions": SERVICER_FUNCTIONS}
    assert cfg["http_options"]["port"] == merged["serve"]["http"]["port"]
    parsed = _app(docs)
    assert parsed.models.target == merged["app"]["models"]["target"]
    assert parsed.target.tp_size == merged["app"]["target"]["tp_size"]
    for dep in DEPLOYMENTS:
        want = {k: v for k, v in merged["app"][dep]["scaling"].items() if v is not None}
        got = getattr(parsed, dep).scaling.model_dump()
        assert {k: got[k] for k in want} == want, dep
    # Redis, OTel and the bind address come from the pod, TLS is not the server's here
    assert (parsed.redis_url, parsed.bind_host, parsed.otlp_endpoint) == (None, None, None)
    assert parsed.security.tls_cert is None


def _home(need: dict[str, float], offers: dict[str, dict[str, float]]) -> str:
    custom = [k for k in need if k not in ("CPU", "GPU") and ":" not in k]
    homes = [g for g, offer in offers.items() if all(k in offer for k in custom)]
    assert len(homes) == 1, f"{need} is pinned to {homes}, not to exactly one group"
    return homes[0]


@unit
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_every_deployment_fits_the_group_it_is_pinned_to(case: Path | None) -> None:
    docs, merged = _rendered(case), _merged(case)
    cfg = _app(docs)
    offers = {name: node_offer(g) for name, g in groups(docs).items()}
    assert offers["head"]["GPU"] == 0
    for dep in DEPLOYMENTS:
        section = getattr(cfg, dep)
        tp = cfg.target.tp_size if dep == "target" else 1
        need = {k: v * tp for k, v in section.scaling.bundle().items()}  # STRICT_PACK
        home = _home(need, offers)
        assert home == merged["placement"][dep], (dep, home)
        for key, amount in need.items():
            if key.startswith("accelerator_type:"):
                group = merged["workerGroups"][home]
                assert group["gpus"] > 0 and key == f"accelerator_type:{group['acceleratorType']}"
            else:
                assert amount <= offers[home].get(key, 0) + 1e-9, (dep, key, amount, offers[home])
        if dep == "target" and offers[home]["GPU"]:
            assert offers[home]["GPU"] % tp == 0
            assert section.scaling.num_gpus > 0


@unit
def test_gpu_values_put_tp_groups_on_the_large_gpu_pods() -> None:
    docs = _rendered(CHART / "ci" / "gpu-tp2.yaml")
    g = groups(docs)
    limits = ray_container(g["target"])["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == g["target"]["rayStartParams"]["num-gpus"] == "4"
    assert "nvidia.com/gpu" not in ray_container(g["head"])["resources"].get("limits", {})
    assert g["head"]["rayStartParams"]["num-gpus"] == "0"
    opts = _app(docs).target.scaling.deployment_options(2)
    assert opts["placement_group_strategy"] == "STRICT_PACK"
    assert opts["placement_group_bundles"] == [
        {"CPU": 2.0, "GPU": 1.0, "specserve/target": 1.0, "accelerator_type:H100": 0.001}] * 2
    assert g["target"]["template"]["spec"]["nodeSelector"]
    assert g["drafter"]["template"]["spec"]["tolerations"]


BAD_VALUES = [  # (id, values, what the message must say)
    ("wrong-type", {"image": {"tag": 1}}, r"/image/tag.*got number, want string"),
    ("wrong-type-nested", {"app": {"target": {"tp_size": "2"}}},
     r"/app/target/tp_size.*got string, want integer"),
    ("unknown-key", {"imagee": {"tag": "x"}}, r"additional properties 'imagee' not allowed"),
    ("unknown-key-nested", {"app": {"router": {"scaling": {"replicas": 2}}}},
     r"/app/router/scaling.*additional properties 'replicas' not allowed"),
    ("chart-owned-appconfig-key", {"app": {"redis_url": "redis://x"}},
     r"/app.*additional properties 'redis_url' not allowed"),
    ("no-tls-values", {"app": {"security": {"tls_cert": "/x.pem"}}},
     r"additional properties 'tls_cert' not allowed"),
    ("tp-does-not-divide-gpus", {"app": {"target": {"tp_size": 3}}},
     r"app\.target\.tp_size=3 must divide workerGroups\.target\.gpus=8"),
    ("tp-ranks-exceed-slots", {"workerGroups": {"target": {"replicaSlots": 1}},
                               "app": {"target": {"tp_size": 2}}},
     r"app\.target: one replica needs 2 slots \(2 ranks: tp_size\).*replicaSlots"),
    ("router-on-cpu-less-head", {"placement": {"router": "head"}},
     r"app\.router: one replica needs 1 CPU but a \"head\" pod offers 0 \(head\.rayCpus\)"),
    ("unknown-group", {"placement": {"drafter": "cheap"}},
     r"placement\.drafter: \"cheap\" is not a group"),
    ("gpus-but-cpu-replicas", {"app": {"target": {"scaling": {"num_gpus": 0}}}},
     r"app\.target\.scaling\.num_gpus is 0 but group \"target\" has 8 GPU"),
    ("gpu-replicas-on-cpu-pods", {"workerGroups": {"drafter": {"gpus": 0}}},
     r"app\.drafter: one replica needs 0\.25 GPU but a \"drafter\" pod offers 0"),
    ("min-replicas-do-not-fit", {"app": {"target": {"scaling": {"min_replicas": 17,
                                                                   "max_replicas": 20}}}},
     r"app\.target\.scaling\.min_replicas=17 cannot fit"),
    ("min-above-max", {"app": {"drafter": {"scaling": {"min_replicas": 3, "max_replicas": 2}}}},
     r"app\.drafter\.scaling: min_replicas \(3\) must be <= max_replicas \(2\)"),
    ("group-bounds", {"workerGroups": {"drafter": {"minReplicas": 3}}},
     r"workerGroups\.drafter: need minReplicas \(3\) <= replicas \(1\)"),
    ("accelerator-mismatch", {"app": {"drafter": {"scaling": {"accelerator_type": "A100"}}}},
     r"accelerator_type=\"A100\" but its group \"drafter\" has acceleratorType \"L4\""),
    ("external-redis-without-secret", {"redis": {"mode": "external"}},
     r"redis\.mode=external needs redis\.external\.existingSecret"),
    ("api-key-required-without-keys", {"app": {"security": {"require_api_key": True}}},
     r"require_api_key needs API keys"),
    ("podmonitor-blocked-by-policy", {"observability": {"metrics": {"podMonitor": {
        "enabled": True}}}}, r"needs networkPolicy\.metricsFrom"),
    ("port-clash", {"serve": {"grpcPort": 8080}},
     r"observability\.metrics\.port and serve\.grpcPort are both port 8080"),
    ("admission-outlasts-the-call-timeout", {"app": {"target": {"admit_wait_s": 30}}},
     r"app\.target\.admit_wait_s \(30\) must be below app\.router\.call_timeout_s \(30\)"),
    ("chart-owned-ray-param", {"workerGroups": {"target": {"rayStartParams": {"num-cpus": "4"}}}},
     r"workerGroups\.target\.rayStartParams\.num-cpus is set by the chart"),
]


@unit
@pytest.mark.parametrize(("values", "message"), [b[1:] for b in BAD_VALUES],
                         ids=[b[0] for b in BAD_VALUES])
def test_bad_values_fail_at_render_with_a_clear_message(values: dict, message: str) -> None:
    import helm_python

    with pytest.raises(helm_python.HelmError) as err:
        render(values)
    assert re.search(message, str(err.value)), str(err.value)


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _pod_labels(docs: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    """group name (or "redis") -> labels of its pods."""
    out = {n: g["template"]["metadata"]["labels"] for n, g in groups(docs).items()}
    for sts in of_kind(docs, "StatefulSet"):
        out["redis"] = sts["spec"]["template"]["metadata"]["labels"]
    return out


@unit
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_public_service_reaches_the_heads_grpc_proxy(case: Path | None) -> None:
    docs, merged = _rendered(case), _merged(case)
    (svc,) = [s for s in of_kind(docs, "Service") if s["metadata"]["name"].endswith("specserve")]
    pods = _pod_labels(docs)
    selected = [n for n, labels in pods.items() if _matches(svc["spec"]["selector"], labels)]
    assert selected == ["head"]
    head = ray_container(groups(docs)["head"])
    head_ports = {p["name"]: p["containerPort"] for p in head["ports"]}
    ports = {p["name"]: p for p in svc["spec"]["ports"]}
    assert head_ports[ports["grpc"]["targetPort"]] == serve_config(docs)["grpc_options"]["port"]
    assert ("http" in ports) == merged["serve"]["http"]["enabled"]


def _policy_peers_everyone(rule: dict[str, Any]) -> bool:
    return not rule.get("from")


@unit
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_network_policy_admits_outsiders_only_to_the_public_ports(case: Path | None) -> None:
    docs, merged = _rendered(case), _merged(case)
    policies = of_kind(docs, "NetworkPolicy")
    pods = _pod_labels(docs)
    release = of_kind(docs, "RayService")[0]["metadata"]["labels"]["app.kubernetes.io/instance"]
    public = {"grpc", *(["serve"] if merged["serve"]["http"]["enabled"] else [])}
    covered: set[str] = set()
    for pol in policies:
        sel = pol["spec"]["podSelector"]["matchLabels"]
        selected = {n for n, labels in pods.items() if _matches(sel, labels)}
        covered |= selected
        for rule in pol["spec"]["ingress"]:
            ports = {p["port"] for p in rule.get("ports", [])}
            peers = rule.get("from", [])
            if _policy_peers_everyone(rule) or merged["networkPolicy"]["clientsFrom"] == peers:
                assert selected == {"head"} and ports == public, pol["metadata"]["name"]
            elif not ports:  # every port: only from this release's own pods
                assert [p["podSelector"]["matchLabels"]["app.kubernetes.io/instance"]
                        for p in peers] == [release]
            else:
                assert ports in ({"dashboard"}, {"metrics"}), ports
    assert covered == set(pods)  # every pod of the release is under a policy
    for group in groups(docs).values():  # the named ports the policies use exist
        assert {"metrics", "serve"} <= {p["name"] for p in ray_container(group)["ports"]}


@unit
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_every_ray_container_gets_redis_otel_and_limits(case: Path | None) -> None:
    docs, merged = _rendered(case), _merged(case)
    mode = merged["redis"]["mode"]
    for name, group in groups(docs).items():
        env = {e["name"]: e for e in ray_container(group)["env"]}
        if mode == "bundled":
            (svc,) = [s for s in of_kind(docs, "Service")
                      if s["metadata"]["name"].endswith("-redis")]
            assert env["REDIS_URL"]["value"] == f"redis://{svc['metadata']['name']}:6379/0"
        elif mode == "external":
            ref = env["REDIS_URL"]["valueFrom"]["secretKeyRef"]
            assert ref == {"name": merged["redis"]["external"]["existingSecret"],
                           "key": merged["redis"]["external"]["secretKey"]}
        otel = merged["observability"]["otel"]
        assert ("OTEL_EXPORTER_OTLP_ENDPOINT" in env) == bool(otel["endpoint"])
        if otel["endpoint"]:
            assert plain_env(group)["OTEL_EXPORTER_OTLP_ENDPOINT"] == otel["endpoint"]
            assert float(plain_env(group)["OTEL_TRACES_SAMPLER_ARG"]) == otel["samplerArg"]
        assert int(plain_env(group)["RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"]) == (
            merged["app"]["security"]["max_message_bytes"])
        assert ray_container(group)["resources"]["limits"], name
    sts = of_kind(docs, "StatefulSet")
    assert bool(sts) == (mode == "bundled")
    if sts:
        args = sts[0]["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--maxmemory") + 1] == merged["redis"]["bundled"]["maxmemory"]


@unit
def test_api_keys_secret_is_mounted_where_the_router_reads_it() -> None:
    docs = _rendered(CHART / "ci" / "external-redis.yaml")
    keys_file = _app(docs).security.api_keys_file
    assert keys_file and _app(docs).security.require_api_key
    for group in groups(docs).values():
        spec = group["template"]["spec"]
        (vol,) = [v for v in spec["volumes"] if v.get("secret")]
        assert vol["secret"]["secretName"] == "specserve-api-keys"
        (mount,) = [m for m in ray_container(group)["volumeMounts"] if m["name"] == vol["name"]]
        assert keys_file == f"{mount['mountPath']}/api-keys" and "subPath" not in mount
    assert _app(_rendered(None)).security.api_keys_file is None


@unit
def test_pod_monitor_only_where_the_prometheus_operator_api_is_served() -> None:
    values = load_values(CHART / "ci" / "observability.yaml")
    assert not of_kind(render(values), "PodMonitor")
    docs = render(values, api_versions=("monitoring.coreos.com/v1",))
    (pm,) = of_kind(docs, "PodMonitor")
    pods = _pod_labels(docs)
    sel = pm["spec"]["selector"]
    picked = {n for n, labels in pods.items() if _matches(sel["matchLabels"], labels)
              and labels["app.kubernetes.io/component"] in sel["matchExpressions"][0]["values"]}
    assert picked == set(groups(docs))  # every Ray pod, not Redis
    assert pm["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    assert pm["metadata"]["labels"]["release"] == "kube-prometheus-stack"


@unit
def test_grafana_dashboard_configmap_is_the_repos_dashboard() -> None:
    def dashboards(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [d for d in of_kind(docs, "ConfigMap")
                if d["metadata"]["name"].endswith("-dashboard")]

    assert not dashboards(render(None))
    (cm,) = dashboards(render({"observability": {"grafanaDashboard": {"enabled": True}}}))
    shipped = json.loads((CHART / "dashboards" / "specserve.json").read_text())
    assert json.loads(cm["data"]["specserve.json"]) == shipped
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"


@unit
def test_pdbs_cover_each_worker_group() -> None:
    docs = _rendered(None)
    pods = _pod_labels(docs)
    covered = sorted(n for pdb in of_kind(docs, "PodDisruptionBudget")
                     for n, labels in pods.items()
                     if _matches(pdb["spec"]["selector"]["matchLabels"], labels))
    assert covered == sorted(g for g in groups(docs) if g != "head")


@unit
def test_notes_tell_how_to_reach_the_service() -> None:
    notes = render_notes(load_values(CHART / "ci" / "observability.yaml"))
    assert "port-forward svc/demo-specserve 9000:9000" in notes
    assert "specserve generate" in notes and "--server 127.0.0.1:9000" in notes
    assert "http://otel-collector.observability:4317" in notes
    assert "ray_specserve_spec_decode_num_accepted_tokens_total" in notes


@unit
def test_values_reference_in_docs_is_up_to_date() -> None:
    import sys

    sys.path.insert(0, str(CHART))
    try:
        import gen_values_doc
    finally:
        sys.path.remove(str(CHART))
    doc = ROOT / "docs" / "kubernetes.md"
    assert gen_values_doc.render_doc(doc.read_text()) == doc.read_text(), (
        "run: .venv/bin/python helm/gen_values_doc.py")
    with pytest.raises(SystemExit, match="no `# --` comment on \\['rayVersion'\\]"):
        gen_values_doc.table((CHART / "values.yaml").read_text().replace(
            "# -- Ray version inside the image", "# Ray version inside the image"),
            json.loads((CHART / "values.schema.json").read_text()))


@unit
def test_dockerfile_matches_the_charts_ray_and_python() -> None:
    text = (CHART / "Dockerfile").read_text()
    ray = _merged(None)["rayVersion"]
    assert f"rayproject/ray:{ray}-py311" in text
    assert f'"ray[serve]=={ray}"' in (ROOT / "pyproject.toml").read_text()
    torch = re.search(r"^ARG TORCH_VERSION=(\S+)$", text, re.M)  # pinned, as scripts/install
    assert torch and f'"torch=={torch.group(1)}"' in (ROOT / "scripts" / "install").read_text()


def _start_nodes(cluster: Any, docs: list[dict[str, Any]]) -> dict[str, list[str]]:
    """One Ray node per pod of the rendered RayService (head on 127.0.0.1, then 127.0.0.2,
    ...), each with its group's rendered CPUs, GPUs and custom resources."""
    gs = groups(docs)
    head = node_offer(gs["head"])
    cluster.start_head(head.pop("CPU"), {k: v for k, v in head.items() if k != "GPU"})
    ips: dict[str, list[str]] = {"head": ["127.0.0.1"]}
    for name, group in gs.items():
        if name == "head":
            continue
        offer = node_offer(group)
        for _ in range(group["replicas"]):
            ip = f"127.0.0.{len(cluster.ips) + 1}"
            cluster.add_worker(ip, offer["CPU"], offer["GPU"],
                               {k: v for k, v in offer.items() if k not in ("CPU", "GPU")})
            ips.setdefault(name, []).append(ip)
    cluster.wait_nodes(len(cluster.ips))
    return ips


def _wait_running(cluster: Any, timeout_s: float = 150) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    status = "?"
    while time.monotonic() < deadline:
        app = cluster.request("GET", "/api/serve/applications/")["applications"].get("specserve")
        status = app["status"] if app else "?"
        if status == "RUNNING":
            return app
        assert status not in ("DEPLOY_FAILED", "UNHEALTHY"), app
        time.sleep(2)
    raise TimeoutError(f"application not RUNNING after {timeout_s}s (last: {status})")


def _greedy(address: str, prompts: list[str], spec: str) -> list[Any]:
    from specserve.client import Client

    with Client(address, timeout=120) as client, ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: client.generate(p, max_tokens=24, temperature=0.0,
                                                       spec=spec, k=4), prompts))


@pytest.mark.service
@pytest.mark.slow
def test_rendered_rayservice_on_a_local_multi_node_cluster() -> None:
    """KubeRay's job, done by hand: nodes from the rendered groups, the rendered
    serveConfigV2 PUT to Serve's REST API; replicas must land on their group's node and
    serve exact greedy output through the gRPC port across nodes."""
    from helm_cluster import LocalRayCluster, free_port

    from deployments.local import start_embedded_redis
    from specserve.models.corpus import heldout_prompts

    values = load_values(CHART / "ci" / "cpu-small.yaml")
    grpc_port, http_port = free_port(), free_port()  # this machine's free ports
    values["serve"].update(grpcPort=grpc_port, http={"enabled": True, "port": http_port,
                                                     "host": "127.0.0.1"})
    docs = render(values)
    redis_url, redis = start_embedded_redis()
    env = {**plain_env(groups(docs)["head"]), "REDIS_URL": redis_url}  # as in the pod
    root = Path(tempfile.mkdtemp(prefix="helm-ray-"))  # short: Ray's sockets live there
    cluster = LocalRayCluster(root, env=env)
    try:
        ips = _start_nodes(cluster, docs)
        assert cluster.request("PUT", "/api/serve/applications/", serve_config(docs)) == {}
        app = _wait_running(cluster)
        placement = _merged(CHART / "ci" / "cpu-small.yaml")["placement"]
        for dep, name in (("router", "Router"), ("drafter", "Drafter"), ("target", "Target")):
            replicas = app["deployments"][name]["replicas"]
            assert replicas and {r["node_ip"] for r in replicas} <= set(ips[placement[dep]]), (
                dep, [r["node_ip"] for r in replicas], ips)
        prompts = heldout_prompts(n=8)
        off = _greedy(f"127.0.0.1:{grpc_port}", prompts, "off")
        for spec in ("draft", "ngram"):
            out = _greedy(f"127.0.0.1:{grpc_port}", prompts, spec)
            assert [r.token_ids for r in out] == [r.token_ids for r in off], spec
        drafts = _greedy(f"127.0.0.1:{grpc_port}", prompts[:2], "draft")
        assert all(r.stats["drafts"] > 0 and not r.stats.get("speculation_disabled_reason")
                   for r in drafts)  # the drafter on its own node answered
    finally:
        cluster.stop()
        redis.shutdown()
        shutil.rmtree(root, ignore_errors=True)
