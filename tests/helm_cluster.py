"""A local multi-node Ray cluster standing in for the chart's RayCluster (tests only).

One ``ray start --block`` per node, each in its own process group, on its own loopback
address (127.0.0.1 for the head, 127.0.0.2, 127.0.0.3, ... for the workers: the suite runs
in a loopback-only network namespace, where every 127.0.0.0/8 address answers on ``lo``),
each with a private ``--temp-dir`` and its own agent/metrics ports (one machine, so no two
nodes may share one). ``stop()`` kills exactly the processes started here (their process
groups and every descendant), never ``ray stop`` (which stops every Ray on the machine).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from specserve.ports import free_port

RAY = str(Path(sys.executable).with_name("ray"))


def ray_env() -> dict[str, str]:
    """Environment of every node: no usage stats, no token auth (a token in ~/.ray, left by
    any earlier ``ray.init``, would otherwise switch some nodes to token mode), one thread."""
    env = dict(os.environ)
    env.update({"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled",
                "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"})
    return env


@dataclass
class LocalRayCluster:
    root: Path
    gcs_port: int = field(default_factory=free_port)
    dashboard_port: int = field(default_factory=free_port)
    env: dict[str, str] = field(default_factory=dict)  # as a pod's: on every node
    procs: list[subprocess.Popen] = field(default_factory=list)
    ips: list[str] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def _start(self, ip: str, args: list[str]) -> None:
        tmp = self.root / f"node-{ip}"
        tmp.mkdir(parents=True, exist_ok=True)
        cmd = [RAY, "start", "--block", "--disable-usage-stats", "--node-ip-address", ip,
               "--temp-dir", str(tmp), "--dashboard-agent-listen-port", str(free_port()),
               "--metrics-export-port", str(free_port()),
               "--object-store-memory", str(100 << 20), *args]
        log = open(tmp / "ray-start.log", "wb")  # noqa: SIM115 (closed with the process)
        self.procs.append(subprocess.Popen(cmd, env={**ray_env(), **self.env}, stdout=log,
                                           stderr=log, start_new_session=True))
        self.ips.append(ip)

    def start_head(self, num_cpus: float, resources: dict[str, float]) -> None:
        self._start("127.0.0.1", [
            "--head", "--port", str(self.gcs_port), "--num-cpus", str(int(num_cpus)),
            "--resources", json.dumps(resources), "--include-dashboard", "true",
            "--dashboard-host", "127.0.0.1", "--dashboard-port", str(self.dashboard_port),
            "--ray-client-server-port", str(free_port())])
        self.wait_nodes(1)

    def add_worker(self, ip: str, num_cpus: float, num_gpus: float,
                   resources: dict[str, float]) -> None:
        self._start(ip, ["--address", self.address, "--num-cpus", str(int(num_cpus)),
                         "--num-gpus", str(int(num_gpus)), "--resources", json.dumps(resources)])

    def request(self, method: str, path: str, body: object = None) -> dict:
        """A call to the head's dashboard (Serve's REST API, the state API)."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"{self.dashboard_url}{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            raw = r.read()
        return json.loads(raw) if raw.strip() else {}

    def nodes(self) -> list[dict]:
        """Alive nodes from the dashboard's state API (no driver needed)."""
        body = self.request("GET", "/api/v0/nodes?limit=100&detail=true")
        return [n for n in body["data"]["result"]["result"] if n["state"] == "ALIVE"]

    def wait_nodes(self, n: int, timeout_s: float = 90) -> list[dict]:
        deadline = time.monotonic() + timeout_s
        last: Exception | None = None
        while time.monotonic() < deadline:
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"a ray start exited ({p.args}); logs in {self.root}")
            try:
                alive = self.nodes()
                if len(alive) >= n:
                    return alive
            except Exception as e:  # dashboard still starting
                last = e
            time.sleep(1)
        raise TimeoutError(f"{n} Ray nodes not alive after {timeout_s}s ({last}); {self.root}")

    def stop(self) -> None:
        """Kill every process this cluster started (process groups, then stragglers)."""
        import psutil

        tree: list[psutil.Process] = []
        for p in self.procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                tree += [psutil.Process(p.pid), *psutil.Process(p.pid).children(recursive=True)]
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
        for proc in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        psutil.wait_procs(tree, timeout=10)
        for p in self.procs:
            p.wait(timeout=10)
