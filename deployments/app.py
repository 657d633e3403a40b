"""Ray Serve wiring: Router (gRPC ingress), Drafter and Target deployments.

Thin shells. ``build_app(config_dict)`` validates the dict once (``AppConfig``) and is the
``import_path`` target of `specserve serve`, a Serve config file and the Helm chart's
RayService; the deployments receive the validated config and their engine factories
(injected, as Ray Serve LLM injects its engine class, so tests can substitute them).

The data path (every round) runs over each drafter/target replica's own ``grpc.aio`` bidi
stream; Serve is in charge of placement, scaling, health and replica choice. A request
*leases* a drafter and a target replica with a streaming Serve call (``session``) that
yields the replica's data-path address and stays open until the request ends, so Serve's
per-replica ongoing-request count is the number of open sessions: its power-of-two-choices
routing balances sessions. Drafter and Target report their own autoscaling signals
(``record_autoscaling_stats``; the policies are in ``deployments/autoscaling.py``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from ray import serve

from deployments.autoscaling import DRAFTING, SESSIONS
from deployments.config import AppConfig
from specserve.service.load import BusyMeter

log = logging.getLogger("specserve")

EngineFactory = Callable[[AppConfig, str], Awaitable[Any]]  # (config, host) -> engine


def _replica_id(kind: str) -> str:
    try:
        return f"{kind}-{serve.get_replica_context().replica_id.unique_id}"
    except Exception:
        return f"{kind}-{uuid.uuid4().hex[:8]}"


def _start_replica(component: str, cfg: AppConfig, threads: int | None = None) -> str:
    """Common replica setup: quiet libraries, torch threads, tracing; returns the id."""
    from specserve.engine.quiet import quiet_libraries
    from specserve.tracing import setup_tracing

    quiet_libraries()
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    replica = _replica_id(component)
    setup_tracing(f"specserve-{component}", endpoint=cfg.otlp_endpoint, replica=replica)
    return replica


async def _profiled(engine: Any, kind: str) -> Any:
    """The engine's start-up cost profile (``specserve.engine.profile``), off the event
    loop, before the replica serves; None if it fails (spec=auto then learns online)."""
    from specserve.engine.profile import profile_drafter, profile_target

    measure = profile_target if kind == "target" else profile_drafter
    try:
        return await asyncio.to_thread(measure, engine)
    except Exception:
        log.exception("%s cost profile failed; spec=auto starts from its defaults", kind)
        return None


def node_host(cfg: AppConfig) -> str:
    """The address this replica's data-path server binds and advertises: ``bind_host``, or
    the address of the Ray node it runs on (never all interfaces)."""
    if cfg.bind_host:
        return cfg.bind_host
    import ray

    return ray.util.get_node_ip_address()


async def make_target_engine(cfg: AppConfig, host: str) -> Any:
    """The default target engine: ``TargetEngine``, or rank 0 of a tensor-parallel group."""
    from specserve.models.load import load_model, resolve_model

    t = cfg.target
    if t.tp_size > 1:  # this process is rank 0 of a tensor-parallel group
        from target_service.tp import start_tp_target

        sc = t.scaling
        return await start_tp_target(
            resolve_model(cfg.models.target), t.tp_size, host, t.cache_bytes,
            threads=t.threads(), timeout_s=t.tp_timeout_s, num_cpus=sc.num_cpus,
            num_gpus=sc.num_gpus, resources=sc.resources, heartbeat_s=t.tp_heartbeat_s)
    from specserve.engine.target import TargetEngine

    return TargetEngine(load_model(resolve_model(cfg.models.target)), t.cache_bytes,
                        batch_invariant=t.batch_invariant)


async def make_drafter_engine(cfg: AppConfig, host: str) -> Any:
    from specserve.engine.drafter import DrafterEngine
    from specserve.engine.lean import LeanLlama
    from specserve.models.load import load_model, resolve_model

    m = cfg.models
    lean = LeanLlama(load_model(resolve_model(m.drafter))) if m.drafter else None
    return DrafterEngine(lean, cache_budget_bytes=cfg.drafter.cache_bytes,
                         draft_ahead=cfg.drafter.draft_ahead,
                         guesses=cfg.drafter.draft_ahead_guesses)


async def _hold(sessions, session_id: str, address: str):
    """Yield the data-path address, then keep the Serve call open while the session is held:
    until the router cancels it, or the data-path server released the session (its stream
    ended: the router died; or it went unused for ``session_idle_s``)."""
    sessions.touch(session_id)
    try:
        yield address
        while sessions.held(session_id):
            await asyncio.sleep(1.0)
    finally:
        sessions.release(session_id, "lease_end")


@serve.deployment(name="Target")
class TargetDeployment:
    async def __init__(self, cfg: AppConfig, engine_factory: EngineFactory = make_target_engine):
        from specserve.service.metrics import TargetBatchMetrics
        from target_service.server import start_target_server

        self.replica = _start_replica("target", cfg, cfg.target.threads())
        host = node_host(cfg)
        self.engine = await engine_factory(cfg, host)
        self.tp = self.engine if cfg.target.tp_size > 1 else None
        sec = cfg.security
        self.server, port, self.servicer = await start_target_server(
            self.engine, host, 0, self.replica, secret=sec.data_plane_secret,
            max_message_bytes=sec.max_internal_message_bytes, max_batch=cfg.target.max_batch,
            batch_wait_s=cfg.target.batch_wait_ms / 1000, prometheus=TargetBatchMetrics(),
            max_queue=cfg.target.max_queue, idle_s=cfg.target.session_idle_s,
            admit_wait_s=cfg.target.admit_wait_s, prefill_chunk=cfg.target.prefill_chunk,
            prefill_budget=cfg.target.prefill_budget)
        self.address = f"{host}:{port}"
        self.busy = BusyMeter(lambda: self.servicer.metrics.compute_s)
        self.cost_profile = await _profiled(self.engine, "target")
        log.info("target replica %s serving verify on %s", self.replica, self.address)

    async def session(self, session_id: str):
        async for address in _hold(self.servicer.sessions, session_id, self.address):
            yield address

    async def profile(self) -> list:
        """Verify seconds by (rows, batch tokens), measured at start (spec=auto's costs)."""
        return self.cost_profile or []

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics (``deployments/autoscaling.py``)."""
        return {"sessions": float(len(self.servicer.sessions)), "busy": self.busy.read(),
                "queued": float(self.servicer.queued)}

    async def ping(self) -> bool:
        """The router's health check: this replica answers (and its TP group is whole)."""
        self.check_health()
        return True

    async def stats(self) -> dict:  # on the event loop: no race with the batcher's state
        m, sch = self.servicer.metrics, self.servicer.scheduler
        return {"replica": self.replica, "batches": m.batches, "rows": m.rows,
                "max_batch": m.max_batch, "overloaded": self.servicer.overloaded,
                "compute_s": m.compute_s, "pid": os.getpid(),
                "turnaround_p90_ms": round(sch.turnaround_p90_s * 1e3, 3),
                "step_waits": sch.waits, "step_timeouts": sch.timeouts,
                "held_sessions": len(self.servicer.sessions),
                "kv_waiting": self.servicer.waiting, "kv_waited": self.servicer.kv["waited"],
                "kv_preempted": self.servicer.kv["preempted"],
                "prefill_chunks": self.servicer.chunks,
                "released": dict(self.servicer.sessions.released), **self.engine.stats()}

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
    async def __init__(self, cfg: AppConfig, engine_factory: EngineFactory = make_drafter_engine):
        from drafter_service.server import start_drafter_server

        self.replica = _start_replica("drafter", cfg, cfg.drafter.threads())
        host = node_host(cfg)
        self.engine = await engine_factory(cfg, host)
        sec = cfg.security
        self.server, port, self.servicer = await start_drafter_server(
            self.engine, host, 0, self.replica, secret=sec.data_plane_secret,
            max_message_bytes=sec.max_internal_message_bytes, idle_s=cfg.drafter.session_idle_s,
            max_batch=cfg.drafter.max_batch, batch_wait_s=cfg.drafter.batch_wait_ms / 1000)
        self.address = f"{host}:{port}"
        self.busy = BusyMeter(lambda: self.servicer.compute_s)
        self.cost_profile = await _profiled(self.engine, "drafter")

    async def session(self, session_id: str):
        async for address in _hold(self.servicer.sessions, session_id, self.address):
            yield address

    async def profile(self) -> list | None:
        """(rows, seconds per draft step), measured at start (spec=auto's costs)."""
        return self.cost_profile

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics (``deployments/autoscaling.py``)."""
        return {"drafting": float(self.servicer.drafting.count()), "busy": self.busy.read(),
                "sessions": float(len(self.servicer.sessions))}

    async def stats(self) -> dict:
        sv = self.servicer
        return {"replica": self.replica, "proposals": sv.proposals, "batches": sv.batches,
                "rows": sv.rows, "pid": os.getpid(), "compute_s": sv.compute_s,
                "ahead_s": sv.ahead_s, "pushed": sv.pushed,
                "held_sessions": len(self.servicer.sessions),
                "released": dict(self.servicer.sessions.released), **self.engine.stats()}

    def pid(self) -> int:
        return os.getpid()


def make_router(cfg: AppConfig, drafter_handle: Any, target_handle: Any) -> Any:
    """The router over Serve leases, the pair's tokenizer (checked against the drafter's)
    and the journal."""
    from transformers import AutoConfig, AutoTokenizer

    from router.journal import Journal
    from router.leases import ServeLeasePool
    from router.priors import PriorStore
    from router.router import Router, RouterConfig
    from specserve.models.load import check_tokenizers, resolve_model
    from specserve.models.revision import model_revision
    from specserve.service.metrics import RouterMetrics

    m, r, sec = cfg.models, cfg.router, cfg.security
    tpath = resolve_model(m.target)
    tok = AutoTokenizer.from_pretrained(tpath)
    drev = ""
    if m.drafter:
        dpath = resolve_model(m.drafter)
        check_tokenizers(tok, AutoTokenizer.from_pretrained(dpath), m.target, m.drafter)
        drev = model_revision(dpath)
    mcfg = AutoConfig.from_pretrained(tpath)
    metrics = RouterMetrics()
    return Router(
        tok,
        RouterConfig(max_context=mcfg.max_position_embeddings, eos_token_id=tok.eos_token_id,
                     vocab_size=mcfg.vocab_size, call_timeout_s=r.call_timeout_s,
                     target_retries=r.target_retries, max_concurrent=r.max_concurrent,
                     drafter_lease_s=r.drafter_lease_s, round_log=r.round_log),
        drafters=(ServeLeasePool(drafter_handle, "drafter", sec.data_plane_secret,
                                 sec.max_internal_message_bytes) if m.drafter else None),
        targets=ServeLeasePool(target_handle, "target", sec.data_plane_secret,
                               sec.max_internal_message_bytes),
        journal=Journal(cfg.journal_url(), ttl_s=r.journal_ttl_s),
        revisions=(model_revision(tpath), drev),
        metrics=metrics, priors=PriorStore(cfg.journal_url(), on_error=metrics.prior_error))


@serve.deployment(name="Router")
@serve.ingress()  # the HTTP app: __serve_build_asgi_app__ (after __init__)
class RouterDeployment:
    """The client-facing ingress: gRPC (``specserve.v1.SpecServe``) and the
    OpenAI-compatible HTTP API (``deployments/http_ingress.py``), one router behind both."""

    async def __init__(self, cfg: AppConfig, drafter, target):
        from deployments.grpc_ingress import Health, Ingress
        from specserve.auth import KeyStore

        _start_replica("router", cfg)
        self.router = make_router(cfg, drafter, target)
        sec = cfg.security
        keys = KeyStore(sec.api_keys_file, sec.api_keys_env)
        if sec.require_api_key and not keys.enabled:
            raise ValueError("security.require_api_key: no API key configured (api_keys_file "
                             f"or ${sec.api_keys_env})")
        self.ingress = Ingress(self.router, keys, sec.max_message_bytes,
                               cfg.router.max_prompt_bytes)
        self.health = Health(self.ingress, target)
        self.keys, self.model_name = keys, cfg.models.target

    def __serve_build_asgi_app__(self):
        from deployments.http_ingress import build_http_app
        from specserve.errors import ServiceError
        from specserve.resume import CALLER_ANONYMOUS

        async def authorize(request) -> str:  # the key's name, as on gRPC
            if not self.keys.enabled:
                return CALLER_ANONYMOUS
            return self.keys.caller(request.headers.items())  # raises Unauthenticated

        async def healthy() -> bool:
            try:
                return await self.health._target_ok()
            except ServiceError:
                return False

        return build_http_app(self.router, self.model_name, self.router.revisions,
                              authorize=authorize, healthy=healthy)

    async def Generate(self, request, grpc_context=None):
        from deployments.grpc_ingress import generate_stream

        async for chunk in generate_stream(self.ingress, request, grpc_context):
            yield chunk

    async def GenerateUnary(self, request, grpc_context=None):
        from deployments.grpc_ingress import generate_unary

        return await generate_unary(self.ingress, request, grpc_context)

    async def Check(self, request, grpc_context=None):
        return await self.health.check(request, grpc_context)

    async def stats(self) -> dict:  # on the event loop: rounds write the same buffers there
        from router.stats import router_stats

        return router_stats(self.router)

    def reset_stats(self) -> None:
        from router.stats import reset_timing

        reset_timing(self.router)

    def pid(self) -> int:
        return os.getpid()


def validate_app_config(config: dict | AppConfig | None) -> AppConfig:
    """The one validation of an application's config: the schema, then what needs the
    model's own config (``tp_size`` must divide the target's heads)."""
    cfg = config if isinstance(config, AppConfig) else AppConfig.model_validate(config or {})
    if cfg.target.tp_size > 1:
        from target_service.tp import check_model_tp

        check_model_tp(cfg.models.target, cfg.target.tp_size)
    return cfg


def build_app(config: dict | AppConfig | None = None):
    """Validate ``config`` and bind the three deployments (a Serve ``import_path``). The
    data plane's secret, unless configured, is drawn here: one per application deployment,
    shared by its replicas through their bound config."""
    cfg = validate_app_config(config)
    if cfg.security.data_plane_secret is None:
        import secrets

        cfg = cfg.model_copy(update={"security": cfg.security.model_copy(
            update={"data_plane_secret": secrets.token_urlsafe(32)})})
    target = TargetDeployment.options(**cfg.target.scaling.deployment_options(
        cfg.target.tp_size, signal=SESSIONS)).bind(cfg)
    drafter = DrafterDeployment.options(**cfg.drafter.scaling.deployment_options(
        signal=DRAFTING)).bind(cfg)
    return RouterDeployment.options(**cfg.router.scaling.deployment_options()).bind(
        cfg, drafter, target)
