"""Ray Serve wiring: Router (gRPC ingress), Drafter and Target deployments.

Thin shells. The data path (every round) runs over each drafter/target replica's own
``grpc.aio`` bidi stream; Serve is in charge of placement, scaling, health and replica
choice. A request *leases* a drafter and a target replica with a streaming Serve call
(``session``) that yields the replica's data-path address and stays open until the request
ends, so Serve's per-replica ongoing-request count is the number of open sessions: its
power-of-two-choices routing balances sessions and its autoscaler scales by them.

``build_app(config_dict)`` validates the dict (``AppConfig``) and is the ``import_path``
target of `specserve serve`, a Serve config file and the Helm chart's RayService.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid

from ray import serve

from deployments.config import AppConfig

log = logging.getLogger("specserve")


def _replica_id(kind: str) -> str:
    try:
        return f"{kind}-{serve.get_replica_context().replica_id.unique_id}"
    except Exception:
        return f"{kind}-{uuid.uuid4().hex[:8]}"


def _setup_observability(component: str, cfg: AppConfig, replica: str) -> None:
    from specserve.tracing import setup_tracing

    setup_tracing(f"specserve-{component}", endpoint=cfg.otlp_endpoint, replica=replica)


def _node_host(cfg: AppConfig) -> str:
    """The address this replica's data-path server binds and advertises: ``bind_host``, or
    the address of the Ray node it runs on (never all interfaces)."""
    if cfg.bind_host:
        return cfg.bind_host
    import ray

    return ray.util.get_node_ip_address()


def _set_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)


async def _hold(engine, session_id: str, address: str):
    """Yield the data-path address, then keep the Serve call open until cancelled."""
    try:
        yield address
        await asyncio.Event().wait()
    finally:
        engine.release(session_id)


@serve.deployment(name="Target")
class TargetDeployment:
    async def __init__(self, config: dict):
        from specserve.engine.quiet import quiet_libraries
        from specserve.models.load import load_model, resolve_model
        from specserve.service.metrics import TargetBatchMetrics
        from target_service.engine import BatchedTarget
        from target_service.server import start_target_server

        quiet_libraries()
        cfg = AppConfig.model_validate(config)
        _set_threads(cfg.torch_threads)
        self.replica = _replica_id("target")
        _setup_observability("target", cfg, self.replica)
        self.tp = None
        if cfg.tp_size > 1:  # this process is rank 0 of a tensor-parallel group
            from target_service.tp import start_tp_target

            sc = cfg.target_scaling
            self.tp = await start_tp_target(
                resolve_model(cfg.target), cfg.tp_size, _node_host(cfg),
                cfg.target_cache_bytes,
                threads=cfg.torch_threads, timeout_s=cfg.tp_timeout_s, num_cpus=sc.num_cpus,
                num_gpus=sc.num_gpus, resources=sc.resources, heartbeat_s=cfg.tp_heartbeat_s)
            self.engine = self.tp
        else:
            model = load_model(resolve_model(cfg.target))
            self.engine = BatchedTarget(model, cache_budget_bytes=cfg.target_cache_bytes)
        self.server, port, self.servicer = await start_target_server(
            self.engine, _node_host(cfg), 0, self.replica, max_batch=cfg.max_batch,
            batch_wait_s=cfg.batch_wait_ms / 1000, prometheus=TargetBatchMetrics())
        self.address = f"{_node_host(cfg)}:{port}"
        log.info("target replica %s serving verify on %s", self.replica, self.address)

    async def session(self, session_id: str):
        async for address in _hold(self.engine, session_id, self.address):
            yield address

    def stats(self) -> dict:
        m = self.servicer.metrics
        return {"replica": self.replica, "batches": m.batches, "rows": m.rows,
                "max_batch": m.max_batch, **self.engine.stats()}

    def pid(self) -> int:
        return os.getpid()

    def check_health(self) -> None:
        if self.tp is not None:
            self.tp.check()  # a failed tensor-parallel group: Serve replaces this replica

    def tp_workers(self) -> list:
        """Ranks 1.. as Ray actor handles (tests, diagnostics); [] without TP."""
        return list(self.tp.workers) if self.tp is not None else []

    def __del__(self) -> None:
        if getattr(self, "tp", None) is not None:
            self.tp.close()


@serve.deployment(name="Drafter")
class DrafterDeployment:
    async def __init__(self, config: dict):
        from drafter_service.engine import DraftEngine
        from drafter_service.server import start_drafter_server
        from specserve.engine.lean import LeanLlama
        from specserve.engine.quiet import quiet_libraries
        from specserve.models.load import load_model, resolve_model

        quiet_libraries()
        cfg = AppConfig.model_validate(config)
        _set_threads(cfg.torch_threads)
        self.replica = _replica_id("drafter")
        _setup_observability("drafter", cfg, self.replica)
        lean = LeanLlama(load_model(resolve_model(cfg.drafter))) if cfg.drafter else None
        self.engine = DraftEngine(lean, cache_budget_bytes=cfg.drafter_cache_bytes)
        self.server, port, self.servicer = await start_drafter_server(
            self.engine, _node_host(cfg), 0, self.replica)
        self.address = f"{_node_host(cfg)}:{port}"

    async def session(self, session_id: str):
        async for address in _hold(self.engine, session_id, self.address):
            yield address

    def stats(self) -> dict:
        return {"replica": self.replica, "proposals": self.servicer.proposals,
                **self.engine.stats()}

    def pid(self) -> int:
        return os.getpid()


@serve.deployment(name="Router")
class RouterDeployment:
    """The client-facing gRPC ingress (``specserve.v1.SpecServe``)."""

    async def __init__(self, config: dict, drafter, target):
        from transformers import AutoTokenizer

        from router.core import RouterConfig, RouterCore
        from router.journal import Journal
        from router.leases import ServeLeasePool
        from specserve.engine.quiet import quiet_libraries
        from specserve.models.load import check_tokenizers, resolve_model
        from specserve.models.revision import model_revision
        from specserve.service.metrics import RouterMetrics

        quiet_libraries()
        cfg = AppConfig.model_validate(config)
        _setup_observability("router", cfg, _replica_id("router"))
        tpath = resolve_model(cfg.target)
        tok = AutoTokenizer.from_pretrained(tpath)
        drev = ""
        if cfg.drafter:
            dpath = resolve_model(cfg.drafter)
            check_tokenizers(tok, AutoTokenizer.from_pretrained(dpath), cfg.target, cfg.drafter)
            drev = model_revision(dpath)
        from transformers import AutoConfig

        mcfg = AutoConfig.from_pretrained(tpath)
        self.core = RouterCore(
            tok,
            RouterConfig(max_context=mcfg.max_position_embeddings,
                         eos_token_id=tok.eos_token_id, vocab_size=mcfg.vocab_size,
                         call_timeout_s=cfg.call_timeout_s, target_retries=cfg.target_retries,
                         max_concurrent=cfg.max_concurrent),
            drafters=ServeLeasePool(drafter, "drafter") if cfg.drafter else None,
            targets=ServeLeasePool(target, "target"),
            journal=Journal(cfg.redis_url),
            revisions=(model_revision(tpath), drev),
            metrics=RouterMetrics(),
        )

    async def Generate(self, request, grpc_context=None):
        from deployments.grpc_ingress import generate_stream

        async for chunk in generate_stream(self.core, request, grpc_context):
            yield chunk

    async def GenerateUnary(self, request, grpc_context=None):
        from deployments.grpc_ingress import generate_unary

        return await generate_unary(self.core, request, grpc_context)

    async def Check(self, request, grpc_context=None):
        from grpc_health.v1 import health_pb2

        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)

    def stats(self) -> dict:
        from router.stats import router_stats

        return router_stats(self.core)

    def reset_stats(self) -> None:
        from router.stats import reset_timing

        reset_timing(self.core)

    def pid(self) -> int:
        return os.getpid()


def build_app(config: dict | None = None):
    """Validate ``config`` and bind the three deployments (a Serve ``import_path``)."""
    cfg = AppConfig.model_validate(config or {})
    if cfg.tp_size > 1:  # fail before anything is deployed
        from target_service.tp import check_model_tp

        check_model_tp(cfg.target, cfg.tp_size)
    raw = cfg.model_dump()
    target = TargetDeployment.options(
        **cfg.target_scaling.deployment_options(cfg.tp_size)).bind(raw)
    drafter = DrafterDeployment.options(**cfg.drafter_scaling.deployment_options()).bind(raw)
    return RouterDeployment.options(**cfg.router.deployment_options()).bind(raw, drafter, target)
