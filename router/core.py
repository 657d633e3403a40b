"""The router's round loop for one request: propose -> verify -> commit -> stream.

Pure asyncio + gRPC; the Serve deployment (``deployments/``) is a thin shell around it. Each
request is pinned to one drafter and one target replica (session affinity): the replica is
picked once (by Serve's load balancing, through ``resolve``), then every round goes over
that replica's shared bidi stream. If a replica fails, the request picks another one and
the new replica rebuilds the session's cache from the committed tokens (cache miss).

Observability (``docs/observability.md``): a ``generate`` span per request with a ``round``
child per round, and under it ``propose``, ``verify`` and ``cache_repair`` spans; the round's
span context travels to the replicas in the messages' ``traceparent``. Prometheus metrics
through ``metrics`` (``specserve.service.metrics.RouterMetrics``) when given.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from router.journal import Journal
from router.leases import Lease
from router.mux import StreamBroken
from specserve import tracing
from specserve.api import MAX_K, GenerationRequest, SpecMode
from specserve.core import rng
from specserve.core.commit import decide_commit, truncate_at_stop
from specserve.core.sampling import SamplingParams
from specserve.core.stats import AcceptanceStats
from specserve.engine.detok import IncrementalDetokenizer
from specserve.proto_gen.specserve.v1 import internal_pb2 as pb
from specserve.service.wire import sampling_to_proto

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span

    from specserve.service.metrics import RouterMetrics

log = logging.getLogger(__name__)


class LeasePool(Protocol):
    async def acquire(self, session_id: str) -> Lease: ...


class RequestInvalid(ValueError):
    """Maps to INVALID_ARGUMENT; the message names the field."""


class RequestOutOfRange(ValueError):
    """Maps to OUT_OF_RANGE (prompt + max_tokens over the context)."""


class TargetUnavailable(ConnectionError):
    """Maps to UNAVAILABLE after retries."""


class Overloaded(RuntimeError):
    """Maps to RESOURCE_EXHAUSTED."""


@dataclass
class _Leases:
    target: Lease | None = None


@dataclass
class RouterChunk:
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stats: dict | None = None


def _window() -> deque:
    return deque(maxlen=50_000)


@dataclass
class RoundTiming:
    """Recent rounds (bounded). *_compute_s are the replicas' own compute times."""

    propose_s: deque = field(default_factory=_window)
    verify_s: deque = field(default_factory=_window)
    round_s: deque = field(default_factory=_window)
    drafter_compute_s: deque = field(default_factory=_window)
    target_compute_s: deque = field(default_factory=_window)


@dataclass
class RouterConfig:
    max_context: int
    eos_token_id: int | None
    vocab_size: int
    call_timeout_s: float = 30.0
    target_retries: int = 8  # reconnect attempts, backing off 0.25 s .. 4 s (~20 s in all)
    max_concurrent: int = 256  # per router replica; beyond -> RESOURCE_EXHAUSTED


class RouterCore:
    def __init__(self, tokenizer, config: RouterConfig, drafters: LeasePool | None,
                 targets: LeasePool, journal: Journal | None = None,
                 revisions: tuple[str, str] = ("", ""), metrics: RouterMetrics | None = None):
        self.tok = tokenizer
        self.cfg = config
        self.drafters = drafters
        self.targets = targets
        self.journal = journal or Journal(None)
        self.revisions = revisions
        self.metrics = metrics  # Prometheus (Serve deployment only); None: none
        self.active = 0
        self.target_reconnects = 0  # leases renewed after a target stream broke
        self.timing = RoundTiming()  # bounded: see _record
        self.totals = AcceptanceStats()

    # ------------------------------------------------------------------ validation
    def prepare(self, req: GenerationRequest) -> list[int]:
        if req.prompt_ids is not None:
            bad = [t for t in req.prompt_ids if not 0 <= t < self.cfg.vocab_size]
            if bad:
                raise RequestInvalid(f"prompt_ids: token id {bad[0]} outside the vocabulary "
                                     f"[0, {self.cfg.vocab_size})")
            ids = list(req.prompt_ids)
        else:
            ids = self.tok(req.prompt, add_special_tokens=False)["input_ids"]
        ctx = self.cfg.max_context
        if len(ids) >= ctx:
            raise RequestOutOfRange(f"prompt: {len(ids)} tokens, but the context holds {ctx}")
        if len(ids) + req.max_tokens > ctx:
            raise RequestOutOfRange(
                f"max_tokens: prompt ({len(ids)} tokens) + max_tokens ({req.max_tokens}) "
                f"exceeds the context ({ctx}); lower max_tokens to at most {ctx - len(ids)}")
        if req.k > MAX_K:
            raise RequestInvalid(f"k: at most {MAX_K}")
        return ids

    # ------------------------------------------------------------------ the loop
    async def generate(self, req: GenerationRequest, request_id: str | None = None,
                       parent: Context | None = None) -> AsyncIterator[RouterChunk]:
        """Stream the request's chunks. ``parent``: the caller's trace context (the client's
        ``traceparent``); the request's ``generate`` span is its child."""
        if self.active >= self.cfg.max_concurrent:
            raise Overloaded(f"router at capacity ({self.cfg.max_concurrent} requests)")
        self.active += 1
        try:
            async for chunk in self._generate(req, request_id or uuid.uuid4().hex, parent):
                yield chunk
        finally:
            self.active -= 1

    async def _generate(self, req: GenerationRequest, request_id: str,
                        parent: Context | None = None) -> AsyncIterator[RouterChunk]:
        t0 = time.perf_counter()
        tracer = tracing.tracer()
        gspan: Span | None = None
        kinds = None
        if tracer is not None:  # tracing off: every span below is skipped by this check
            from opentelemetry.trace import SpanKind

            kinds = SpanKind
            gspan = tracer.start_span("generate", context=parent, kind=SpanKind.SERVER)
        gctx = tracing.parent_context(gspan) if gspan is not None else None
        rspan: Span | None = None  # the open round span (ended on failure too)
        session = uuid.uuid4().hex
        stats = AcceptanceStats()
        spec = req.spec if req.k > 0 else SpecMode.OFF
        disabled_reason = ""
        prompt: list[int] | None = None
        out_tokens: list[int] = []
        finish: str | None = None
        error: BaseException | None = None
        seed = 0
        ttft = 0.0
        repairs = {"drafter": _RepairTally(), "target": _RepairTally()}
        replicas = ["", ""]  # the drafter / target replica that served the last call
        drafter: Lease | None = None
        leases = _Leases()
        try:
            prompt = self.prepare(req)
            seed = req.seed if req.seed is not None else rng.random_seed()
            sampling = SamplingParams(req.temperature, req.top_k, req.top_p, seed)
            sp = sampling_to_proto(sampling)
            detok = IncrementalDetokenizer(self.tok, req.stop)
            committed = list(prompt)
            propose_s = verify_s = round_s = d_compute_s = t_compute_s = 0.0

            # Resume from the journal (client retry with the same request id).
            journaled, done = await self.journal.load(request_id)
            if journaled:
                journaled = journaled[: req.max_tokens]
                committed.extend(journaled)
                out_tokens.extend(journaled)
                finish = done
                text = detok.push(journaled)
                if detok.stopped:
                    finish = "stop"
                if finish is None and len(out_tokens) >= req.max_tokens:
                    finish = "length"
                if finish is None:
                    ttft = time.perf_counter() - t0
                    if self.metrics is not None:
                        self.metrics.first_token(spec.value, ttft)
                    yield RouterChunk(text, list(journaled))

            if spec != SpecMode.OFF and self.drafters is not None and finish is None:
                try:
                    drafter = await self.drafters.acquire(session)
                except Exception as e:
                    spec, disabled_reason = SpecMode.OFF, f"drafter unavailable: {e}"
            elif spec != SpecMode.OFF and self.drafters is None:
                spec, disabled_reason = SpecMode.OFF, "no drafter deployment"
            if finish is None:
                try:
                    leases.target = await self.targets.acquire(session)
                except Exception as e:
                    raise TargetUnavailable(f"no target replica: {e}") from e
            d_start = t_start = 0  # committed tokens the drafter / target surely hold
            d_first = t_first = True  # the next call is the session's first (a prefill)
            t_last = t0
            round_no = 0

            while finish is None:
                tr = time.perf_counter()
                rctx = None
                if gctx is not None:
                    rspan = tracer.start_span("round", context=gctx)
                    rctx = tracing.parent_context(rspan)
                remaining = req.max_tokens - len(out_tokens)
                k = min(req.k, remaining - 1, self.cfg.max_context - len(committed) - 1)
                drafts: list[int] = []
                q_bytes = b""
                d_compute = 0.0
                preply = None
                if spec != SpecMode.OFF and k > 0 and drafter is not None:
                    pspan = (tracer.start_span("propose", context=rctx, kind=kinds.CLIENT)
                             if rctx is not None else None)
                    p_start = len(committed) - d_start
                    p_ns = time.time_ns()
                    try:
                        preply, p_miss = await self._propose(
                            drafter.mux, request_id, session, committed, d_start, k,
                            spec.value, sp, tracing.traceparent_of(pspan))
                        drafts, q_bytes = list(preply.draft_tokens), preply.draft_probs
                        d_compute = preply.compute_us / 1e6
                        replicas[0] = preply.replica
                        d_rolled = self._repair("drafter", preply, p_miss, d_first, repairs,
                                                rctx, p_ns)
                        d_first = False
                        if pspan is not None and pspan.is_recording():
                            pspan.set_attribute("specserve.tokens_sent", p_start)
                            if p_miss is not None:
                                pspan.set_attribute("specserve.cache_miss", True)
                    except (StreamBroken, TimeoutError, RuntimeError) as e:
                        preply = None
                        log.warning("drafter failed, continuing without speculation: %s", e)
                        if pspan is not None:
                            _record_error(pspan, e)
                        spec, disabled_reason = SpecMode.OFF, f"drafter failed: {e}"
                        drafter.close()
                        drafter = None
                    finally:
                        if pspan is not None:
                            pspan.end()
                tv = time.perf_counter()
                v_ns = time.time_ns()
                vspan = (tracer.start_span("verify", context=rctx, kind=kinds.CLIENT)
                         if rctx is not None else None)
                try:
                    reply, v_miss = await self._verify(
                        leases, session, request_id, committed, t_start, drafts, q_bytes, sp,
                        tracing.traceparent_of(vspan))
                except BaseException as e:
                    if vspan is not None:
                        _record_error(vspan, e)
                        vspan.end()
                    raise
                te = time.perf_counter()
                replicas[1] = reply.replica
                t_rolled = self._repair("target", reply, v_miss, t_first, repairs, rctx, v_ns)
                t_first = False
                if vspan is not None:
                    if vspan.is_recording():
                        vspan.set_attribute("specserve.tokens_sent", len(committed) - t_start)
                        if v_miss is not None:
                            vspan.set_attribute("specserve.cache_miss", True)
                    vspan.end()
                propose_s += tv - tr
                verify_s += te - tv
                decision = decide_commit(len(committed), drafts, reply.num_accepted,
                                         reply.extra_token)
                stats.observe(len(drafts), decision.num_accepted, len(decision.tokens),
                              decision.bonus)
                new, finish = truncate_at_stop(decision.tokens, remaining, self.cfg.eos_token_id)
                d_start = t_start = len(committed)
                committed.extend(new)
                out_tokens.extend(new)
                await self.journal.append(request_id, list(new))
                text = detok.push(new)
                if detok.stopped:
                    finish = "stop"
                t_compute = reply.compute_us / 1e6
                now = time.perf_counter()
                self.timing.propose_s.append(tv - tr)
                self.timing.verify_s.append(te - tv)
                self.timing.round_s.append(now - tr)
                self.timing.drafter_compute_s.append(d_compute)
                self.timing.target_compute_s.append(t_compute)
                round_s += now - tr
                d_compute_s += d_compute
                t_compute_s += t_compute
                if self.metrics is not None:
                    self.metrics.round(spec.value, now - tr, tv - tr, te - tv, d_compute,
                                       t_compute, len(drafts), len(decision.tokens))
                    if ttft == 0.0:
                        self.metrics.first_token(spec.value, now - t0)
                    elif new:
                        self.metrics.inter_token(spec.value, (now - t_last) / len(new))
                t_last = now
                if ttft == 0.0:
                    ttft = now - t0
                if rspan is not None:
                    if rspan.is_recording():
                        # few attributes (each costs): replica ids and compute times are on
                        # the replicas' spans and the request's span
                        rspan.set_attributes({
                            "specserve.round": round_no, "specserve.k": k if drafts else 0,
                            "specserve.drafted": len(drafts),
                            "specserve.accepted": decision.num_accepted,
                            "specserve.extra_token": ("bonus" if drafts and decision.bonus
                                                      else "recovered" if drafts else "plain"),
                            "specserve.committed_len": len(committed),
                            "specserve.batch_size": reply.batch_size,
                            "specserve.drafter_rolled_back": (d_rolled if preply is not None
                                                              else 0),
                            "specserve.target_rolled_back": t_rolled})
                    rspan.end()
                    rspan = None
                round_no += 1
                if finish is None:
                    yield RouterChunk(text, list(new))
                else:
                    await self.journal.finish(request_id, finish)
                    st = self._stats(stats, prompt, out_tokens, ttft, t0, spec, req.k,
                                     disabled_reason, seed, propose_s, verify_s)
                    st.update(round_s=round_s, drafter_compute_s=d_compute_s,
                              target_compute_s=t_compute_s)
                    yield RouterChunk(text + detok.flush(), list(new), finish, st)
            if journaled and done is not None:  # the whole answer came from the journal
                yield RouterChunk(detok.text + detok.flush(), list(journaled), finish,
                                  self._stats(stats, prompt, out_tokens, ttft, t0, spec, req.k,
                                              disabled_reason, seed, 0.0, 0.0))
        except BaseException as e:
            error = e
            raise
        finally:
            self.totals.merge(stats)
            release = dict(session_id=session, request_id=request_id, release=True)
            if drafter is not None:
                drafter.mux.send_nowait(pb.ProposeRequest(**release))
                drafter.close()
            if leases.target is not None:
                leases.target.mux.send_nowait(pb.VerifyRequest(**release))
                leases.target.close()
            if rspan is not None:  # a round that failed
                _record_error(rspan, error)
                rspan.end()
            try:
                self._observe_end(gspan, req, request_id, session, prompt, out_tokens, stats,
                                  spec, finish, disabled_reason, seed, ttft, t0, repairs, error,
                                  replicas)
            except Exception:  # observability must never fail a request
                log.exception("recording the request's metrics / span failed")

    def _repair(self, component: str, reply, miss_ns: int | None, first: bool,
                repairs: dict[str, _RepairTally], rctx: Context | None,
                call_ns: int) -> int:
        """Account one reply's cache repair; returns the entries rolled back (the previous
        round's rejected drafts: routine, an attribute of the round span). A cache that had
        to be rebuilt or re-fed (a miss, a re-leased replica) is a ``cache_repair`` span,
        child of the round, from the miss answer to the reply of the full resend (or at the
        call's start, ``call_ns``, when the replica re-fed without a miss answer). The
        first call of a session is its prefill, not a repair."""
        rep = reply.repair
        miss = miss_ns is not None or (not first and rep.kept == 0 and rep.fed > 2)
        rolled_back = rep.cached_before - rep.kept
        reprefilled = max(0, rep.fed - 2) if (miss or not first) else 0
        if not (miss or rolled_back or reprefilled):
            return 0
        repairs[component].add(miss, rolled_back, reprefilled)
        tr = tracing.tracer()
        if rctx is None or tr is None or not (miss or reprefilled):
            return rolled_back
        end = time.time_ns() if miss_ns is not None else call_ns
        span = tr.start_span("cache_repair", context=rctx,
                             start_time=miss_ns if miss_ns is not None else call_ns)
        if not span.is_recording():
            return rolled_back
        span.set_attributes({
            "specserve.component": component, "specserve.cache": "miss" if miss else "hit",
            "specserve.rolled_back": rolled_back, "specserve.reprefilled": reprefilled,
            "specserve.cached_before": rep.cached_before, "specserve.kept": rep.kept,
            "specserve.fed": rep.fed, "specserve.replica": reply.replica})
        span.end(end_time=end)
        return rolled_back

    def _observe_end(self, gspan: Span | None, req: GenerationRequest, request_id: str,
                     session: str, prompt: list[int] | None, out_tokens: list[int],
                     stats: AcceptanceStats, spec: SpecMode, finish: str | None,
                     disabled_reason: str, seed: int, ttft: float, t0: float,
                     repairs: dict[str, _RepairTally], error: BaseException | None,
                     replicas: list[str]) -> None:
        total_s = time.perf_counter() - t0
        if self.metrics is not None and prompt is not None:
            self.metrics.request_end(spec.value, finish or "abort", stats, len(prompt),
                                     len(out_tokens), total_s)
            for component, t in repairs.items():
                self.metrics.cache(component, t.repairs, t.misses, t.rolled_back,
                                   t.reprefilled)
        if gspan is None:
            return
        if gspan.is_recording():
            gspan.set_attributes({
                "specserve.request_id": request_id, "specserve.session_id": session,
                "specserve.spec": spec.value, "specserve.spec_requested": req.spec.value,
                "specserve.k": req.k if spec != SpecMode.OFF else 0,
                "specserve.target_revision": self.revisions[0],
                "specserve.drafter_revision": self.revisions[1],
                "specserve.drafter_replica": replicas[0],
                "specserve.target_replica": replicas[1],
                "specserve.temperature": req.temperature, "specserve.seed": seed,
                "specserve.prompt_tokens": len(prompt or ()),
                "specserve.output_tokens": len(out_tokens),
                "gen_ai.usage.input_tokens": len(prompt or ()),
                "gen_ai.usage.output_tokens": len(out_tokens),
                "specserve.finish_reason": finish or "abort",
                "specserve.rounds": stats.rounds, "specserve.drafts": stats.drafts,
                "specserve.draft_tokens": stats.draft_tokens,
                "specserve.accepted_tokens": stats.accepted_tokens,
                "specserve.bonus_tokens": stats.bonus_tokens,
                "specserve.mean_acceptance_length": stats.mean_acceptance_length,
                "specserve.ttft_s": ttft,
                "specserve.speculation_disabled_reason": disabled_reason,
                "specserve.cache_repairs": sum(t.repairs for t in repairs.values()),
                "specserve.cache_misses": sum(t.misses for t in repairs.values()),
            })
        _record_error(gspan, error)
        gspan.end()

    def _stats(self, stats, prompt, out_tokens, ttft, t0, spec, k, reason, seed,
               propose_s, verify_s) -> dict:
        return {
            **stats.to_dict(), "prompt_tokens": len(prompt), "output_tokens": len(out_tokens),
            "ttft_s": ttft, "total_s": time.perf_counter() - t0, "spec": spec.value,
            "k": k if spec != SpecMode.OFF else 0, "speculation_disabled_reason": reason,
            "target_revision": self.revisions[0], "drafter_revision": self.revisions[1],
            "seed": seed, "propose_s": propose_s, "verify_s": verify_s,
        }

    async def _propose(self, mux, request_id, session, committed, start, k, mode, sp,
                       traceparent: str = "") -> tuple[pb.ProposeReply, int | None]:
        """The drafter's reply, and when (time_ns) a cache-miss answer arrived (None: none)."""
        miss_ns: int | None = None
        for attempt in range(2):
            msg = pb.ProposeRequest(
                request_id=request_id, session_id=session, committed_len=len(committed),
                tokens_start=start, tokens=committed[start:], k=k, mode=mode, sampling=sp,
                traceparent=traceparent)
            reply = await mux.call(msg, self.cfg.call_timeout_s)
            if reply.error:
                raise RuntimeError(reply.error)
            if not reply.cache_miss:
                return reply, miss_ns
            miss_ns = time.time_ns()
            start = 0  # the replica lacks the session: send every committed token
            if attempt:
                raise RuntimeError("drafter reported a cache miss after a full resend")
        raise AssertionError("unreachable")

    async def _verify(self, leases: _Leases, session, request_id, committed, start, drafts,
                      q_bytes, sp, traceparent: str = "") -> tuple[pb.VerifyReply, int | None]:
        """The target's reply, and when (time_ns) a cache-miss answer arrived (None: none)."""
        last_error: Exception | None = None
        miss_ns: int | None = None
        for attempt in range(self.cfg.target_retries + 1):
            try:
                msg = pb.VerifyRequest(
                    request_id=request_id, session_id=session, committed_len=len(committed),
                    tokens_start=start, tokens=committed[start:], draft_tokens=drafts,
                    draft_probs=q_bytes, sampling=sp, traceparent=traceparent)
                reply = await leases.target.mux.call(msg, self.cfg.call_timeout_s)
                if reply.error.startswith("unavailable:"):  # the replica is going away
                    raise StreamBroken(reply.error)
                if reply.error:
                    raise RuntimeError(reply.error)
                if reply.cache_miss:
                    miss_ns = time.time_ns()
                    start = 0
                    msg.tokens_start = 0
                    msg.ClearField("tokens")
                    msg.tokens.extend(committed)
                    reply = await leases.target.mux.call(msg, self.cfg.call_timeout_s)
                    if reply.error.startswith("unavailable:"):
                        raise StreamBroken(reply.error)
                    if reply.error or reply.cache_miss:
                        raise RuntimeError(reply.error or "cache miss after a full resend")
                return reply, miss_ns
            except (StreamBroken, TimeoutError) as e:
                last_error = e
                log.warning("target call failed (%s); picking a replica again", e)
                self.target_reconnects += 1
                if attempt == self.cfg.target_retries:
                    break
                await asyncio.sleep(min(4.0, 0.25 * 2**attempt))
                try:
                    leases.target.close()
                    leases.target = await self.targets.acquire(session)
                except Exception as e2:  # no replica to lease
                    last_error = e2
                start = 0
        raise TargetUnavailable(f"target unavailable after {self.cfg.target_retries} retries: "
                                f"{last_error}")


@dataclass
class _RepairTally:
    """One request's cache repairs (caches rebuilt or re-fed) and rolled-back entries at
    one component (added to the metrics at the request's end)."""

    repairs: int = 0
    misses: int = 0
    rolled_back: int = 0
    reprefilled: int = 0

    def add(self, miss: bool, rolled_back: int, reprefilled: int) -> None:
        self.repairs += int(miss or reprefilled > 0)
        self.misses += int(miss)
        self.rolled_back += rolled_back
        self.reprefilled += reprefilled


def _record_error(span: Span, error: BaseException | None) -> None:
    """Mark ``span`` failed by ``error`` (a cancellation is not an error: an attribute)."""
    if error is None or not span.is_recording():
        return
    if isinstance(error, Exception):
        from opentelemetry.trace import Status, StatusCode

        span.record_exception(error)
        span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
    else:  # GeneratorExit / CancelledError: the client went away
        span.set_attribute("specserve.cancelled", True)
