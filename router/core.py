"""The router's round loop for one request: propose -> verify -> commit -> stream.

Pure asyncio + gRPC; the Serve deployment (``deployments/``) is a thin shell around it. Each
request is pinned to one drafter and one target replica (session affinity): the replica is
picked once (by Serve's load balancing, through ``resolve``), then every round goes over
that replica's shared bidi stream. If a replica fails, the request picks another one and
the new replica rebuilds the session's cache from the committed tokens (cache miss).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from router.journal import Journal
from router.leases import Lease
from router.mux import StreamBroken
from specserve.api import MAX_K, GenerationRequest, SpecMode
from specserve.core import rng
from specserve.core.commit import decide_commit, truncate_at_stop
from specserve.core.sampling import SamplingParams
from specserve.core.stats import AcceptanceStats
from specserve.engine.detok import IncrementalDetokenizer
from specserve.proto_gen.specserve.v1 import internal_pb2 as pb
from specserve.service.wire import sampling_to_proto

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
                 revisions: tuple[str, str] = ("", "")):
        self.tok = tokenizer
        self.cfg = config
        self.drafters = drafters
        self.targets = targets
        self.journal = journal or Journal(None)
        self.revisions = revisions
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
    async def generate(self, req: GenerationRequest, request_id: str | None = None
                       ) -> AsyncIterator[RouterChunk]:
        if self.active >= self.cfg.max_concurrent:
            raise Overloaded(f"router at capacity ({self.cfg.max_concurrent} requests)")
        self.active += 1
        try:
            async for chunk in self._generate(req, request_id or uuid.uuid4().hex):
                yield chunk
        finally:
            self.active -= 1

    async def _generate(self, req: GenerationRequest, request_id: str
                        ) -> AsyncIterator[RouterChunk]:
        t0 = time.perf_counter()
        prompt = self.prepare(req)
        seed = req.seed if req.seed is not None else rng.random_seed()
        sampling = SamplingParams(req.temperature, req.top_k, req.top_p, seed)
        sp = sampling_to_proto(sampling)
        session = uuid.uuid4().hex
        detok = IncrementalDetokenizer(self.tok, req.stop)
        stats = AcceptanceStats()
        spec = req.spec if req.k > 0 else SpecMode.OFF
        disabled_reason = ""
        committed = list(prompt)
        out_tokens: list[int] = []
        ttft = 0.0
        propose_s = verify_s = round_s = d_compute_s = t_compute_s = 0.0

        # Resume from the journal (client retry with the same request id).
        journaled, done = await self.journal.load(request_id)
        finish: str | None = None
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
                yield RouterChunk(text, list(journaled))

        drafter: Lease | None = None
        if spec != SpecMode.OFF and self.drafters is not None and finish is None:
            try:
                drafter = await self.drafters.acquire(session)
            except Exception as e:
                spec, disabled_reason = SpecMode.OFF, f"drafter unavailable: {e}"
        elif spec != SpecMode.OFF and self.drafters is None:
            spec, disabled_reason = SpecMode.OFF, "no drafter deployment"
        leases = _Leases()
        if finish is None:
            try:
                leases.target = await self.targets.acquire(session)
            except Exception as e:
                raise TargetUnavailable(f"no target replica: {e}") from e
        d_start = t_start = 0  # committed tokens the drafter / target surely hold

        try:
            while finish is None:
                tr = time.perf_counter()
                remaining = req.max_tokens - len(out_tokens)
                k = min(req.k, remaining - 1, self.cfg.max_context - len(committed) - 1)
                drafts: list[int] = []
                q_bytes = b""
                d_compute = 0.0
                if spec != SpecMode.OFF and k > 0 and drafter is not None:
                    try:
                        reply = await self._propose(drafter.mux, request_id, session,
                                                    committed, d_start, k, spec.value, sp)
                        drafts, q_bytes = list(reply.draft_tokens), reply.draft_probs
                        d_compute = reply.compute_us / 1e6
                    except (StreamBroken, TimeoutError, RuntimeError) as e:
                        log.warning("drafter failed, continuing without speculation: %s", e)
                        spec, disabled_reason = SpecMode.OFF, f"drafter failed: {e}"
                        drafter.close()
                        drafter = None
                tv = time.perf_counter()
                reply = await self._verify(leases, session, request_id, committed, t_start,
                                           drafts, q_bytes, sp)
                te = time.perf_counter()
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
                self.timing.propose_s.append(tv - tr)
                self.timing.verify_s.append(te - tv)
                self.timing.round_s.append(time.perf_counter() - tr)
                self.timing.drafter_compute_s.append(d_compute)
                self.timing.target_compute_s.append(reply.compute_us / 1e6)
                round_s += self.timing.round_s[-1]
                d_compute_s += d_compute
                t_compute_s += reply.compute_us / 1e6
                if ttft == 0.0:
                    ttft = time.perf_counter() - t0
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
        finally:
            self.totals.merge(stats)
            release = dict(session_id=session, request_id=request_id, release=True)
            if drafter is not None:
                drafter.mux.send_nowait(pb.ProposeRequest(**release))
                drafter.close()
            if leases.target is not None:
                leases.target.mux.send_nowait(pb.VerifyRequest(**release))
                leases.target.close()

    def _stats(self, stats, prompt, out_tokens, ttft, t0, spec, k, reason, seed,
               propose_s, verify_s) -> dict:
        return {
            **stats.to_dict(), "prompt_tokens": len(prompt), "output_tokens": len(out_tokens),
            "ttft_s": ttft, "total_s": time.perf_counter() - t0, "spec": spec.value,
            "k": k if spec != SpecMode.OFF else 0, "speculation_disabled_reason": reason,
            "target_revision": self.revisions[0], "drafter_revision": self.revisions[1],
            "seed": seed, "propose_s": propose_s, "verify_s": verify_s,
        }

    async def _propose(self, mux, request_id, session, committed, start, k, mode, sp):
        for attempt in range(2):
            msg = pb.ProposeRequest(
                request_id=request_id, session_id=session, committed_len=len(committed),
                tokens_start=start, tokens=committed[start:], k=k, mode=mode, sampling=sp)
            reply = await mux.call(msg, self.cfg.call_timeout_s)
            if reply.error:
                raise RuntimeError(reply.error)
            if not reply.cache_miss:
                return reply
            start = 0  # the replica lacks the session: send every committed token
            if attempt:
                raise RuntimeError("drafter reported a cache miss after a full resend")
        raise AssertionError("unreachable")

    async def _verify(self, leases: _Leases, session, request_id, committed, start, drafts,
                      q_bytes, sp):
        last_error: Exception | None = None
        for attempt in range(self.cfg.target_retries + 1):
            try:
                msg = pb.VerifyRequest(
                    request_id=request_id, session_id=session, committed_len=len(committed),
                    tokens_start=start, tokens=committed[start:], draft_tokens=drafts,
                    draft_probs=q_bytes, sampling=sp)
                reply = await leases.target.mux.call(msg, self.cfg.call_timeout_s)
                if reply.error:
                    raise RuntimeError(reply.error)
                if reply.cache_miss:
                    start = 0
                    msg.tokens_start = 0
                    msg.ClearField("tokens")
                    msg.tokens.extend(committed)
                    reply = await leases.target.mux.call(msg, self.cfg.call_timeout_s)
                    if reply.error or reply.cache_miss:
                        raise RuntimeError(reply.error or "cache miss after a full resend")
                return reply
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
