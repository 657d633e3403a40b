"""Node-level scaling in simulation: Ray's own autoscaler with its fake multi-node provider.

On Kubernetes, KubeRay adds a pod when Serve asks for a replica that fits on no node. The
same loop runs here on one machine: ``start_node_cluster`` starts a Ray head whose
autoscaler (the real one, ``ray start --autoscaling-config``) uses Ray's
``FakeMultiNodeProvider`` (``ray/autoscaler/_private/fake_multi_node/node_provider.py``, the
provider of Ray's own autoscaler tests): a "node" is one more raylet on this machine with
the node type's resources. Give each pool's replicas a resource only its node type has
(``drafter.scaling.resources = {"drafter_pool": 1}`` and a ``drafter_node`` type with
``drafter_pool: 1``): a replica that fits nowhere makes the autoscaler launch a node, a node
idle for ``idle_timeout_s`` is terminated.

Hygiene (a shared machine): the head gets a free GCS port (6379 may be taken), a private
temp dir, no dashboard, usage stats off, 127.0.0.1. ``stop()`` kills only the processes
whose command line names this cluster's temp dir and their descendants (by pid), never
``ray stop`` (that kills
every Ray process of the machine). Best is to run the whole program in its own PID
namespace (``in_private_namespaces``): whatever survives dies with it; and in a
loopback-only network namespace, since Ray probes 8.8.8.8 and Serve's gRPC proxy binds
every interface (``scripts/isolated``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from specserve.ports import free_port

HEAD_TYPE = "ray.head.default"
NS_ENV = "SPECSERVE_PRIVATE_NS"  # set inside the namespaces in_private_namespaces makes

# The pools of the service, one node type each (a replica needs its node's pool resource).
POOL_NODE_TYPES: dict[str, dict] = {
    "drafter_node": {"resources": {"CPU": 1, "drafter_pool": 1}, "max_workers": 3},
    "target_node": {"resources": {"CPU": 1, "target_pool": 1}, "max_workers": 3},
}
POOL_RESOURCES = {"drafter": {"drafter_pool": 1.0}, "target": {"target_pool": 1.0}}
# per fake node: a small object store (the default, 30% of RAM, is per node)
NODE_OBJECT_STORE_BYTES = 100 << 20


def autoscaling_config(node_types: Mapping[str, dict], head_resources: Mapping[str, float],
                       gcs_address: str, idle_timeout_s: float) -> dict:
    """The cluster config the autoscaler reads: provider ``fake_multinode`` (pointed at
    our GCS), the head type and ``node_types`` (``{"resources": {...}, "min_workers": 0,
    "max_workers": N}`` each), idle nodes removed after ``idle_timeout_s``."""
    types: dict[str, dict] = {HEAD_TYPE: {"resources": dict(head_resources),
                                          "node_config": {}, "max_workers": 0}}
    for name, t in node_types.items():
        res = {"object_store_memory": NODE_OBJECT_STORE_BYTES, **t["resources"]}
        types[name] = {"resources": res, "node_config": {},
                       "min_workers": int(t.get("min_workers", 0)),
                       "max_workers": int(t.get("max_workers", 1))}
    return {
        "cluster_name": "specserve-fake",
        "max_workers": sum(t["max_workers"] for t in types.values()),
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": idle_timeout_s / 60.0,
        # as Ray's fake_multi_node/example.yaml: fake nodes share one IP (load metrics keyed
        # by node id), nothing to ssh into, no launch-config drift to check
        "provider": {"type": "fake_multinode", "gcs_address": gcs_address,
                     "use_node_id_as_ip": True, "disable_node_updaters": True,
                     "disable_launch_config_check": True},
        "auth": {"ssh_user": "nobody"},
        "available_node_types": types,
        "head_node_type": HEAD_TYPE,
        "file_mounts": {}, "cluster_synced_files": [], "file_mounts_sync_continuously": False,
        "rsync_exclude": [], "rsync_filter": [], "initialization_commands": [],
        "setup_commands": [], "head_setup_commands": [], "worker_setup_commands": [],
        "head_start_ray_commands": [], "worker_start_ray_commands": [],
    }


def _head_command(config_path: str, port: int, temp_dir: str,
                  head_resources: Mapping[str, float]) -> list[str]:
    res = dict(head_resources)
    cmd = [str(Path(sys.executable).with_name("ray")), "start", "--head",
           f"--autoscaling-config={config_path}", "--node-ip-address=127.0.0.1",
           f"--port={port}", f"--temp-dir={temp_dir}", "--include-dashboard=false",
           "--disable-usage-stats", f"--num-cpus={res.pop('CPU', 1)}"]
    if "object_store_memory" in res:
        cmd.append(f"--object-store-memory={int(res.pop('object_store_memory'))}")
    if res:
        cmd.append(f"--resources={json.dumps(res)}")
    return cmd


def start_node_cluster(node_types: Mapping[str, dict] | None = None,
                       head_resources: Mapping[str, float] | None = None,
                       idle_timeout_s: float = 10.0) -> tuple[str, Callable[[], None]]:
    """Start the head (GCS, raylet, autoscaler monitor); returns ``(gcs_address, stop)``.
    Connect with ``ray.init(address=gcs_address)``. ``node_types``: default
    ``POOL_NODE_TYPES``; ``head_resources``: default 2 CPUs (Serve's controller, the
    proxy and the router run there)."""
    port = free_port()
    gcs = f"127.0.0.1:{port}"
    temp_dir = tempfile.mkdtemp(prefix="specserve-nodes-")
    head = dict(head_resources or {"CPU": 2})
    cfg = autoscaling_config(node_types or POOL_NODE_TYPES, head, gcs, idle_timeout_s)
    config_path = os.path.join(temp_dir, "autoscaling.json")
    Path(config_path).write_text(json.dumps(cfg, indent=1))
    # `ray start` turns token auth on when ~/.ray/auth_token exists and RAY_AUTH_MODE is
    # unset; the driver would then need the token: off for both (loopback-only anyway)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    env = {**os.environ, "RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1",
           "RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false"}
    subprocess.run(_head_command(config_path, port, temp_dir, head), env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=180)
    return gcs, lambda: stop_processes_of(temp_dir)


def _pids_naming(text: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            pids.append(int(entry.name))
    return pids


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:  # "pid (comm) state ppid ...": comm may hold spaces, split after it
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                parents[int(entry.name)] = int(fields[1])
            except (OSError, IndexError, ValueError):
                continue
    return parents


def _cluster_pids(temp_dir: str) -> list[int]:
    """The processes naming ``temp_dir`` and their descendants (workers rename
    themselves ``ray::...`` and keep no arguments)."""
    found = set(_pids_naming(temp_dir))
    parents = _parents()
    grew = True
    while grew:
        more = {pid for pid, ppid in parents.items() if ppid in found} - found - {os.getpid()}
        found |= more
        grew = bool(more)
    return sorted(found)


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def stop_processes_of(temp_dir: str, grace_s: float = 5.0) -> None:
    """Stop this cluster: every process whose command line names ``temp_dir`` (the head's
    and every fake node's GCS, raylet, monitor, agents) and their descendants (workers),
    by pid, SIGTERM then SIGKILL."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    pids = _cluster_pids(temp_dir)
    _signal_all(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in pids):
        time.sleep(0.2)
    _signal_all(sorted(set(pids) | set(_cluster_pids(temp_dir))), signal.SIGKILL)
    shutil.rmtree(temp_dir, ignore_errors=True)


def node_type_of(resources: Mapping[str, float], node_types: Mapping[str, dict]) -> str:
    """The node type whose custom resources (all but CPU/GPU/memory) a node has."""
    for name, t in node_types.items():
        custom = {k for k in t["resources"] if k not in ("CPU", "GPU", "object_store_memory")}
        if custom and custom <= set(resources):
            return name
    return "head"


def nodes_by_type(node_types: Mapping[str, dict] | None = None) -> dict[str, int]:
    """Alive nodes per node type right now (``ray.nodes()``; the head counts as "head")."""
    import ray

    types = node_types or POOL_NODE_TYPES
    counts = {name: 0 for name in types} | {"head": 0}
    for node in ray.nodes():
        if node.get("Alive"):
            counts[node_type_of(node.get("Resources", {}), types)] += 1
    return counts


def loopback_only() -> bool:
    """True when this network namespace has no interface but ``lo``."""
    try:
        return set(os.listdir("/sys/class/net")) <= {"lo"}
    except OSError:
        return False


def in_private_namespaces(argv: list[str] | None = None) -> None:
    """Re-run this program (``sys.argv``) in its own PID namespace (and, unless already
    loopback-only, its own network namespace with only ``lo`` up), then exit with its
    status. Every process it starts dies when it ends (PID 1 of the namespace is a bash
    that waits for the program; when bash exits the kernel kills the rest). A no-op when
    already inside (``SPECSERVE_PRIVATE_NS``)."""
    if os.environ.get(NS_ENV):
        return
    if shutil.which("unshare") is None:
        raise RuntimeError("unshare(1) is needed to run in a private PID namespace")
    argv = argv or [sys.executable, *sys.argv]
    flags = ["--pid", "--fork", "--mount-proc"] + ([] if loopback_only() else ["--net"])
    if os.getuid() != 0:
        flags.insert(0, "--map-root-user")
    script = 'ip link set lo up 2>/dev/null || true; "$@"; exit $?'
    env = {**os.environ, NS_ENV: "1", "RAY_USAGE_STATS_ENABLED": "0"}
    proc = subprocess.run(["unshare", *flags, "--", "bash", "-c", script, "ns", *argv],
                          env=env, check=False)
    sys.exit(proc.returncode)
