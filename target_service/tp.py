"""Tensor-parallel target: one Serve replica = one tensor-parallel group of ``tp_size`` ranks.

The replica process is rank 0. It starts ranks 1..N-1 as Ray actors (``TPWorker``) in the
bundles of the replica's placement group (``placement_group_bundles``, ``STRICT_PACK``,
declared by ``build_app``), and every rank joins one ``torch.distributed`` group (gloo on
CPU, nccl on GPU) and loads the target with transformers' own tensor-parallel plan
(``from_pretrained(..., distributed_config=DistributedConfig(tp_plan="auto"))``: attention
and MLP projections split column/row-wise, the LM head gathered, so every rank ends a
forward with the full logits).

Lockstep: rank 0 wraps its ``TargetEngine`` in ``TPTargetEngine`` (same interface). Every
operation is first broadcast to the other ranks (``broadcast_object_list``), then all ranks
run the same ``TargetEngine`` method; the model's collectives inside the forward keep them
in step. A session's state on every rank is its token list (a function of the verify items
only) and its KV shard (its heads), so caches are repaired identically on every rank, and
eviction (by bytes, per rank) makes the same decisions everywhere. Releases are queued and
shipped with the next operation so that all ranks apply them at the same point.

An idle group exchanges a heartbeat every ``heartbeat_s`` so that a dead rank is noticed
without traffic. Any failed collective (a rank died, or hung past the group's timeout) marks
the group broken: pending and later verifies fail with ``TPUnavailable`` (the server replies
``unavailable: ...``, which the router treats like a broken stream: it leases again and
resends the tokens), and the deployment's ``check_health`` fails so Serve replaces the
replica (its worker actors die with it: Ray actors are fate-shared with their owner).
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import torch

from specserve.engine.target import Admission, TargetEngine, VerifyItem, VerifyOutcome
from specserve.ports import free_port

log = logging.getLogger(__name__)

# one broadcast op: (kind, releases, payload); kind in {"verify", "ping", "stop"}
_Op = tuple[str, list[str], Any]


class TPUnavailable(RuntimeError):
    """The tensor-parallel group failed; this replica must be replaced."""


# ------------------------------------------------------------------ validation
def validate_tp(config: Any, tp_size: int, name: str) -> None:
    """Raise a clear ``ValueError`` unless the model's heads divide by ``tp_size``."""
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    if heads % tp_size or kv_heads % tp_size:
        raise ValueError(
            f"tp_size={tp_size} does not divide the heads of target {name!r} "
            f"(num_attention_heads={heads}, num_key_value_heads={kv_heads}); tensor "
            f"parallelism splits heads across ranks, pick a tp_size that divides both")


def check_model_tp(model: str, tp_size: int) -> None:
    """Read the target's config (no weights) and validate ``tp_size`` against it."""
    if tp_size == 1:
        return
    from transformers import AutoConfig

    from specserve.models.load import resolve_model

    validate_tp(AutoConfig.from_pretrained(resolve_model(model)), tp_size, model)


# ------------------------------------------------------------------ one rank
def _local_device_index(rank: int) -> int:
    # Ray gives each GPU actor its own CUDA_VISIBLE_DEVICES: then the rank's GPU is index 0
    if torch.cuda.is_available() and torch.cuda.device_count() == 1:
        return 0
    return rank


def init_rank(rank: int, world: int, host: str, port: int, backend: str,
              timeout_s: float) -> None:
    """Join the group (the env variables are what transformers' tp_plan reads)."""
    import torch.distributed as dist

    local = _local_device_index(rank)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": host,
                       "MASTER_PORT": str(port)})
    if backend == "nccl":
        torch.cuda.set_device(local)
    dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=timeout_s))


def load_tp_model(path: str | Path, tp_size: int,
                  dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """This rank's shard of the target (transformers' own tensor-parallel plan)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    validate_tp(AutoConfig.from_pretrained(path), tp_size, str(path))
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, distributed_config=DistributedConfig(tp_plan="auto"))
    model.eval()
    return model


def setup_rank(rank: int, world: int, host: str, port: int, backend: str, timeout_s: float,
               path: str, cache_bytes: int, dtype: torch.dtype = torch.float32) -> TargetEngine:
    init_rank(rank, world, host, port, backend, timeout_s)
    return TargetEngine(load_tp_model(path, world, dtype), cache_budget_bytes=cache_bytes,
                         tp_size=world)


def _broadcast(op: _Op | None) -> _Op:
    import torch.distributed as dist

    box: list[Any] = [op]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _apply(engine: TargetEngine, op: _Op) -> list[VerifyOutcome] | None:
    kind, releases, payload = op
    for sid in releases:
        engine.release(sid)
    if kind == "verify":
        items, chunk, budget = payload
        return engine.verify(items, chunk, budget)
    return None


class TPWorker:
    """Rank r >= 1 (a Ray actor, ``ray.remote(TPWorker)``): waits for rank 0's operations
    and runs each on its own shard; exits its process when the group fails."""

    def __init__(self, rank: int, world: int, threads: int = 1):
        torch.set_num_threads(threads)
        from specserve.engine.quiet import quiet_libraries

        quiet_libraries()
        self.rank, self.world = rank, world
        self.engine: TargetEngine | None = None

    def setup(self, host: str, port: int, backend: str, timeout_s: float, path: str,
              cache_bytes: int) -> int:
        self.engine = setup_rank(self.rank, self.world, host, port, backend, timeout_s, path,
                                 cache_bytes)
        return os.getpid()

    def serve(self) -> None:
        """The lockstep loop (blocks until rank 0 says stop)."""
        assert self.engine is not None, "setup() first"
        while True:
            try:
                op = _broadcast(None)
            except Exception:
                log.exception("rank %d: group failed; exiting", self.rank)
                os._exit(1)
            if op[0] == "stop":
                self._close()
                return
            try:
                _apply(self.engine, op)
            except ValueError:
                pass  # a bad row: rank 0 raised the same error before any collective
            except Exception:
                log.exception("rank %d: operation failed; exiting", self.rank)
                os._exit(1)

    def _close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()

    def stats(self) -> dict[str, int]:
        return self.engine.stats() if self.engine is not None else {}

    def session_ids(self) -> list[str]:
        return list(self.engine._sessions) if self.engine is not None else []

    def pid(self) -> int:
        return os.getpid()


# ------------------------------------------------------------------ rank 0
class TPTargetEngine:
    """Rank 0's engine: ``TargetEngine``'s interface, every operation run on all ranks."""

    def __init__(self, engine: TargetEngine, workers: list[Any], heartbeat_s: float = 2.0):
        self.engine = engine
        self.workers = workers  # Ray actor handles of ranks 1..N-1 (kept alive here)
        self.tp_size = len(workers) + 1
        self.heartbeat_s = heartbeat_s
        self.broken: str | None = None
        self._lock = threading.Lock()  # one operation at a time (the broadcast order)
        self._rel_lock = threading.Lock()
        self._releases: list[str] = []
        self._last = time.monotonic()
        self._closed = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, daemon=True, name="tp-heartbeat")
        self._beat.start()

    # the TargetEngine interface
    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def max_context(self) -> int:
        return self.engine.max_context

    def validate(self, item: VerifyItem) -> None:
        self.engine.validate(item)  # rank 0's checks are every rank's (same model)

    def admission(self, items: list[VerifyItem], overdue: list[bool] | None = None) -> Admission:
        with self._rel_lock:  # every rank holds rank 0's sessions, less the pending releases
            return self.engine.admission(items, overdue, frozenset(self._releases))

    def verify(self, items: list[VerifyItem], prefill_chunk: int | None = None,
               prefill_budget: int | None = None) -> list[VerifyOutcome]:
        with self._lock:
            result = self._run(("verify", self._take_releases(),
                                (items, prefill_chunk, prefill_budget)))
        assert result is not None
        return result

    def release(self, session_id: str) -> bool:
        # applied by every rank (this one too) at the next operation; never blocks on a
        # forward (called from the server's event loop)
        with self._rel_lock:
            existed = self.engine.has_session(session_id) and session_id not in self._releases
            self._releases.append(session_id)
        return existed

    def has_session(self, session_id: str) -> bool:
        with self._rel_lock:
            return self.engine.has_session(session_id) and session_id not in self._releases

    def stats(self) -> dict[str, Any]:
        return {**self.engine.stats(), "tp_size": self.tp_size, "tp_broken": self.broken or ""}

    def check(self) -> None:
        """Raise unless the group is healthy (the deployment's ``check_health``)."""
        if self.broken is not None:
            raise TPUnavailable(f"unavailable: tensor-parallel group failed: {self.broken}")

    def close(self) -> None:
        """Stop the other ranks (best effort) and leave the group."""
        import torch.distributed as dist

        self._closed.set()
        if not self._lock.acquire(timeout=5.0):  # an operation hangs: the actors die with us
            return
        try:
            if self.broken is None:
                try:
                    _broadcast(("stop", [], None))
                except Exception as e:  # shutting down anyway
                    log.warning("tp stop: %s", e)
                self.broken = "closed"
            if dist.is_initialized():
                dist.destroy_process_group()
        finally:
            self._lock.release()

    # internals
    def _take_releases(self) -> list[str]:
        with self._rel_lock:
            out, self._releases = self._releases, []
        return out

    def _run(self, op: _Op) -> list[VerifyOutcome] | None:
        self.check()
        self._last = time.monotonic()
        try:
            _broadcast(op)
            return _apply(self.engine, op)
        except ValueError:
            raise  # a bad row: every rank raised it before any collective; the group is fine
        except Exception as e:
            self.broken = f"{type(e).__name__}: {e}"
            log.error("tensor-parallel group failed (%s); replica unhealthy", self.broken)
            raise TPUnavailable(f"unavailable: tensor-parallel group failed: {e}") from e
        finally:
            self._last = time.monotonic()

    def _heartbeat(self) -> None:
        while not self._closed.wait(self.heartbeat_s / 4):
            if self.broken is not None:
                return
            with self._lock:
                if self.broken is None and time.monotonic() - self._last >= self.heartbeat_s:
                    try:
                        self._run(("ping", self._take_releases(), None))
                    except TPUnavailable:
                        return


async def start_tp_target(path: str | Path, tp_size: int, host: str, cache_bytes: int,
                          threads: int = 1, timeout_s: float = 30.0, num_cpus: float = 0.25,
                          num_gpus: float = 0, resources: dict[str, float] | None = None,
                          heartbeat_s: float = 2.0) -> TPTargetEngine:
    """From inside a replica: start ranks 1..tp_size-1 in the replica's placement group,
    join the group as rank 0, load every shard; returns rank 0's lockstep engine."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    from transformers import AutoConfig

    validate_tp(AutoConfig.from_pretrained(path), tp_size, str(path))
    backend = "nccl" if num_gpus and torch.cuda.is_available() else "gloo"
    port = free_port(host)
    pg = ray.util.get_current_placement_group()
    worker_cls = ray.remote(TPWorker)
    workers = []
    for rank in range(1, tp_size):
        opts: dict[str, Any] = {"num_cpus": num_cpus, "max_concurrency": 4,
                                "max_restarts": 0}
        if num_gpus:
            opts["num_gpus"] = num_gpus
        if resources:
            opts["resources"] = dict(resources)
        if pg is not None and rank < pg.bundle_count:
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=rank)
        workers.append(worker_cls.options(**opts).remote(rank, tp_size, threads))
    try:
        ready = [w.setup.remote(host, port, backend, timeout_s, str(path), cache_bytes)
                 for w in workers]
        engine = await asyncio.to_thread(setup_rank, 0, tp_size, host, port, backend,
                                         timeout_s, str(path), cache_bytes)
        await asyncio.gather(*ready)
    except BaseException:
        for w in workers:
            ray.kill(w)
        raise
    for w in workers:
        w.serve.remote()
    log.info("tensor-parallel target: %d ranks (%s) on %s:%d", tp_size, backend, host, port)
    return TPTargetEngine(engine, workers, heartbeat_s=heartbeat_s)
