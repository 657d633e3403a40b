"""The router: one request's lifecycle around the one round (``specserve.rounds``).

Admission, validation, journal resume, replica leases (session affinity), then
``speculate`` over per-request transports whose ``send`` is one message on the leased
replica's shared bidi stream (``mux.py``); every round's committed tokens are journaled,
then streamed. Observers (tracing, metrics, the timing window) are attached per request.
The Serve deployment (``deployments/``) is a thin shell around it.

Failures: a drafter that fails turns speculation off for the request (its stats say why);
a target stream that breaks is re-leased with backoff (Serve picks a live replica) and the
new replica rebuilds the session's cache from the committed tokens (full resend); a target
that stays away gives ``Unavailable``.

Exactly once: the journal (``journal.py``) is a cache bound to the request's content digest;
the effective seed is fixed at the start (the request's, or derived from caller, id and
digest), so a resume that finds the journal missing or short regenerates the same tokens.
A retried stream says what the caller holds (``ResumePoint``); only the rest is sent, after
checking the regenerated prefix against the caller's digest. A cancel or a passed deadline
stops the request within the round in flight (``abort`` / ``deadline`` in the metrics) and
frees its admission slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from router.journal import Entry, Journal
from router.leases import Lease
from router.mux import StreamBroken
from router.priors import PriorStore
from specserve import tracing
from specserve.api import GenerationRequest, TokenLogprob, prepare_prompt
from specserve.contract import (
    CallInfo,
    ProposeOutcome,
    SessionProposer,
    SessionVerifier,
    VerifyOutcome,
)
from specserve.core.stats import AcceptanceStats
from specserve.engine.detok import IncrementalDetokenizer
from specserve.engine.generator import new_state
from specserve.errors import (
    Cancelled,
    DataLoss,
    DeadlineExceeded,
    Overloaded,
    ProposerFailed,
    RequestError,
    Unavailable,
)
from specserve.observers import MetricsObserver, RoundLog, RoundTiming, TracingObserver
from specserve.policy import CostModel, GoodputPolicy, policy_for
from specserve.resume import CALLER_ANONYMOUS, ResumePoint, derive_seed, request_digest
from specserve.resume import tokens_digest as held_digest
from specserve.rounds import Observer, Observers, RequestState, run_ahead, speculate
from specserve.service import wire

if TYPE_CHECKING:
    from opentelemetry.context import Context

    from specserve.service.metrics import RouterMetrics

log = logging.getLogger(__name__)
# Rounds a request's loop may run ahead of its journal writes and stream (a bounded queue:
# a slow client still stops its generation).
_RUN_AHEAD = 4


class LeasePool(Protocol):
    async def acquire(self, session_id: str) -> Lease: ...

    async def profile(self) -> Any: ...  # a replica's start-up cost profile, or None


@dataclass
class RouterChunk:
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stats: dict | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token id, when asked


@dataclass
class RouterConfig:
    max_context: int
    eos_token_id: int | None
    vocab_size: int
    call_timeout_s: float = 30.0
    target_retries: int = 8  # reconnect attempts, backing off 0.25 s .. 4 s (~20 s in all)
    drafter_lease_s: float = 2.0  # longest wait for a drafter lease (a pool at 0 replicas)
    max_concurrent: int = 256  # per router replica; beyond -> RESOURCE_EXHAUSTED
    round_log: str | None = None  # a file to append one JSON line per round to (diagnosis)


@dataclass
class Call:
    """Who asks, what they already hold, until when (from the ingress's metadata)."""

    caller: str = CALLER_ANONYMOUS
    resume: ResumePoint = field(default_factory=ResumePoint)
    deadline: float | None = None  # time.monotonic() after which the request stops


class Delivery:
    """Cuts what the caller already holds (a resume point) from the chunks, and checks the
    regenerated prefix against the digest of the tokens the caller holds."""

    def __init__(self, point: ResumePoint):
        self.point = point
        self.tokens = 0
        self.chars = 0
        self._held: list[int] = []

    def cut(self, chunk: RouterChunk) -> RouterChunk | None:
        t0, c0, p = self.tokens, self.chars, self.point
        self.tokens += len(chunk.token_ids)
        self.chars += len(chunk.text)
        if t0 < p.tokens:
            self._held.extend(chunk.token_ids[: p.tokens - t0])
            if self.tokens >= p.tokens and held_digest(self._held) != p.digest:
                raise DataLoss("the tokens regenerated for this request differ from the ones "
                               "the caller holds (another model revision?); not resumable")
        if chunk.finish_reason is not None and self.tokens < p.tokens:
            raise RequestError(f"specserve-resume: the caller holds {p.tokens} tokens, the "
                               f"request produced {self.tokens}")
        cut_t, cut_c = max(0, p.tokens - t0), max(0, p.chars - c0)
        if cut_t == 0 and cut_c == 0:
            return chunk
        lps = getattr(chunk, "logprobs", None)
        if lps is not None:
            chunk.logprobs = lps[cut_t:]
        chunk.text, chunk.token_ids = chunk.text[cut_c:], chunk.token_ids[cut_t:]
        if not chunk.token_ids and not chunk.text and chunk.finish_reason is None:
            return None
        return chunk


def remote_send(lease: Lease, timeout_s: float, component: str) -> Callable[[Any], Awaitable]:
    """The gRPC transport of a per-request proposer / verifier: one message each way on the
    leased replica's stream. A replica's error reply raises: ``ProposerFailed`` (drafter),
    ``StreamBroken`` for a target going away (``unavailable: ...``), else RuntimeError."""
    encode, decode = ((wire.propose_item_to_proto, wire.propose_outcome_from_proto)
                      if component == "drafter" else
                      (wire.verify_item_to_proto, wire.verify_outcome_from_proto))

    async def send(item: Any) -> ProposeOutcome | VerifyOutcome:
        reply = await lease.mux.call(encode(item), timeout_s)
        if reply.error:
            if component == "drafter":
                raise ProposerFailed(reply.error)
            if reply.error.startswith("unavailable:"):  # the replica is going away
                raise StreamBroken(reply.error)
            if reply.error.startswith("overloaded:"):  # its bounded queue is full
                raise Overloaded(f"target {reply.error}")
            raise RuntimeError(reply.error)
        return decode(reply)

    return send


class RemoteVerifier(SessionVerifier):
    """The target over the data path; a broken stream or a timeout leases a replica again
    (backoff 0.25 s doubling to 4 s) and resends every committed token."""

    def __init__(self, router: Router, session_id: str, lease: Lease):
        self.router, self.session_id, self.lease = router, session_id, lease
        super().__init__(remote_send(lease, router.cfg.call_timeout_s, "target"))

    async def verify(self, state: RequestState, proposal: ProposeOutcome,
                     traceparent: str) -> VerifyOutcome:
        retries = self.router.cfg.target_retries
        last: BaseException | None = None
        for attempt in range(retries + 1):
            try:
                verdict = await super().verify(state, proposal, traceparent)
                self.router.target_load[self.lease.mux.address] = (
                    verdict.batch_size, verdict.queue_rows, time.monotonic())
                return verdict
            except (StreamBroken, TimeoutError) as e:
                last = e
                log.warning("target call failed (%s); picking a replica again", e)
                self.router.target_reconnects += 1
                if attempt == retries:
                    break
                await asyncio.sleep(min(4.0, 0.25 * 2**attempt))
                self.window.start = 0  # whoever answers next may hold nothing
                try:
                    self.lease.close()
                    _move(self, await self.router.targets.acquire(self.session_id), "target")
                except Exception as e2:  # no replica to lease
                    last = e2
        raise Unavailable(f"target unavailable after {retries} retries: {last}")


class RemoteProposer(SessionProposer):
    """The drafter over the data path. A stream that breaks (its replica was removed by a
    scale-down or died) is handed over once: a new lease, and the new replica rebuilds the
    session's cache from the committed tokens. A second failure, or an error the drafter
    answered, turns speculation off for the request (``ProposerFailed``).

    Draft-ahead: while the request is alone at the target (its last forward had one row and
    nothing queued), a block the drafter pushed (one per guessed outcome) for exactly this
    round's committed tokens and k (``wire.prepared_matches``) is the proposal at once, with
    no drafter hop on the round's path; the same call as without it still goes out
    alongside (the drafter answers it from that block and drafts ahead again), and the next
    round waits for its reply first, so the drafter's record and this window stay in step.
    Among other rows it is not used (the call is made, and answered from the block): a row
    that skipped the drafter hop would reach the target ahead of its cohort and split the
    step (measured at concurrency 16: draft K=2 0.97x spec-off with it, 1.05x without
    draft-ahead)."""

    def __init__(self, router: Router, session_id: str, lease: Lease):
        self.router, self.session_id, self.lease = router, session_id, lease
        self.handed_over = False
        self._alongside: asyncio.Task | None = None  # the call made beside a pushed block
        super().__init__(remote_send(lease, router.cfg.call_timeout_s, "drafter"))

    async def propose(self, state: RequestState, k: int, traceparent: str,
                      mode: str | None = None) -> ProposeOutcome:
        if self._alongside is not None:  # normally answered long ago (then: no yield)
            if not self._alongside.done():
                await asyncio.wait({self._alongside})
            self._alongside = None
        held = self.lease.mux.pushed.pop(self.session_id, ())
        pushed = next((b for b in held if wire.prepared_matches(b, state.committed, k)), None)
        if pushed is not None and (mode or state.spec) == "draft" and state.target_rows <= 1:
            self._alongside = asyncio.get_running_loop().create_task(
                self._call(state, k, traceparent, mode))
            self._alongside.add_done_callback(_retrieved)  # a failure shows at the next call
            out = wire.propose_outcome_from_proto(pushed)
            out.call = CallInfo(replica=pushed.replica, first=False)  # no call, no hop
            out.pushed = True
            return out
        return await self._call(state, k, traceparent, mode)

    async def _call(self, state: RequestState, k: int, traceparent: str,
                    mode: str | None) -> ProposeOutcome:
        try:
            return await super().propose(state, k, traceparent, mode)
        except ProposerFailed as e:
            lost = isinstance(e.__cause__, (ConnectionError, TimeoutError))
            if self.handed_over or not lost:
                raise
            self.handed_over = True
            log.warning("drafter stream lost (%s); leasing a drafter again", e)
            self.lease.close()
            try:
                _move(self, await self.router.lease_drafter(self.session_id), "drafter")
            except Exception as e2:
                raise ProposerFailed(f"{e}; no drafter to hand over to: {e2}") from e2
            self.router.drafter_handovers += 1
            return await super().propose(state, k, traceparent, mode)


def _retrieved(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: not logged as never retrieved


def _move(call: RemoteVerifier | RemoteProposer, lease: Lease, component: str) -> None:
    """Hand a request's verifier or proposer over to a newly leased replica: its calls go
    there, and the next one resends every committed token (the new replica holds none)."""
    call.lease = lease
    call.send = remote_send(lease, call.router.cfg.call_timeout_s, component)
    call.window.start = 0


def _give_back(task: asyncio.Task) -> None:
    """A lease granted after its request stopped waiting: release it at once."""
    if not task.cancelled() and task.exception() is None:
        task.result().close()


def _check_deadline(call: Call, state: RequestState | None) -> None:
    """Between rounds: a passed deadline stops the request (at most one more round ran)."""
    if call.deadline is not None and time.monotonic() >= call.deadline:
        done = f" after {len(state.output)} tokens" if state is not None else ""
        raise DeadlineExceeded(f"the caller's deadline passed{done}")


def _past_deadline(e: BaseException, call: Call) -> bool:
    """Our own deadline check, or a cancel from the caller's side at its deadline (the
    client's gRPC deadline and ours expire together; whichever lands first stops it)."""
    if isinstance(e, DeadlineExceeded):
        return True
    return (isinstance(e, asyncio.CancelledError) and call.deadline is not None
            and time.monotonic() >= call.deadline - 0.1)


class Router:
    def __init__(self, tokenizer: Any, config: RouterConfig, drafters: LeasePool | None,
                 targets: LeasePool, journal: Journal | None = None,
                 revisions: tuple[str, str] = ("", ""), metrics: RouterMetrics | None = None,
                 priors: PriorStore | None = None):
        self.tok = tokenizer
        self.cfg = config
        self.drafters = drafters
        self.targets = targets
        self.journal = journal or Journal(None)
        self.revisions = revisions
        self.metrics = metrics  # Prometheus (Serve deployment only); None: none
        self.active = 0
        self.target_reconnects = 0  # leases renewed after a target stream broke
        self.drafter_handovers = 0  # drafter leases renewed after a drafter stream broke
        # per target replica (address): its last reply's batch rows and queued rows, when
        self.target_load: dict[str, tuple[int, int, float]] = {}
        self._drafter_starting: asyncio.Task | None = None  # a lease still waiting
        self.timing = RoundTiming()  # bounded window of recent rounds (router_stats)
        self.totals = AcceptanceStats()
        self.cost = CostModel()  # spec=auto: verify / draft / overhead times of its rounds
        self.priors = priors or PriorStore(None)  # spec=auto: the fleet's acceptance
        self._calibration: asyncio.Task | None = None  # replicas' profiles -> cost model
        self.round_log = RoundLog(config.round_log, self.cost) if config.round_log else None

    async def generate(self, req: GenerationRequest, request_id: str | None = None,
                       parent: Context | None = None,
                       call: Call | None = None) -> AsyncIterator[RouterChunk]:
        """Stream the request's chunks. ``parent``: the caller's trace context (the client's
        ``traceparent``); the request's ``generate`` span is its child. ``call``: the
        caller's identity, resume point and deadline."""
        if self.active >= self.cfg.max_concurrent:
            raise Overloaded(f"router at capacity ({self.cfg.max_concurrent} requests)")
        call = call or Call()
        self.active += 1
        self.cost.admitted(self.active)
        started = False  # its first round done (the cost model's ``arriving``)
        try:
            delivery = Delivery(call.resume)
            async with contextlib.aclosing(self._generate(  # closed here, not by the GC
                    req, request_id or uuid.uuid4().hex, parent, call)) as chunks:
                async for chunk in chunks:
                    if not started:
                        started = True
                        self.cost.started()
                    out = delivery.cut(chunk)
                    if out is not None:
                        yield out
        finally:
            if not started:
                self.cost.started()
            self.active -= 1
            self.cost.admitted(self.active)

    def count_error(self, err: BaseException) -> None:
        """A failed request, by status code (every ingress calls this once per failure)."""
        if self.metrics is not None:
            from specserve.grpc_api import status_of

            self.metrics.error(status_of(err)[0].name)

    def _observer(self, req: GenerationRequest, parent: Context | None) -> Observer:
        observers: list[Observer] = [self.timing]
        if tracing.tracer() is not None:  # tracing off: no span code runs at all
            observers.append(TracingObserver(parent, {
                "specserve.spec_requested": req.spec.value,
                "specserve.temperature": req.temperature}))
        if self.metrics is not None:
            observers.append(MetricsObserver(self.metrics))
        if self.round_log is not None:
            observers.append(self.round_log)
        return Observers(*observers)

    def _state(self, req: GenerationRequest, request_id: str,
               call: Call) -> tuple[RequestState, str]:
        """The request's state with its effective seed fixed, and its content digest."""
        prompt = prepare_prompt(req, self.tok, self.cfg.vocab_size, self.cfg.max_context)
        digest = request_digest(req.model_dump(mode="json"))
        if req.seed is None:  # reproducible without the journal
            req = req.model_copy(update={"seed": derive_seed(call.caller, request_id, digest)})
        return new_state(req, prompt, self.cfg.max_context, self.cfg.eos_token_id,
                         self.revisions, request_id), digest

    async def _generate(self, req: GenerationRequest, request_id: str,
                        parent: Context | None, call: Call) -> AsyncIterator[RouterChunk]:
        _check_deadline(call, None)
        state, digest = self._state(req, request_id, call)
        observer = self._observer(req, parent)
        detok = IncrementalDetokenizer(self.tok, req.stop)
        leases: dict[str, Lease] = {}
        verifier: RemoteVerifier | None = None
        proposer: SessionProposer | None = None
        policy = None
        error: BaseException | None = None
        try:
            entry = await self.journal.open(call.caller, request_id, digest,
                                            state.sampling.seed or 0)
            resumed = self._resume(state, detok, entry)
            if resumed is not None:
                yield resumed
            if state.finish is not None:
                return
            proposer = await self._proposer(state, leases)
            verifier = await self._verifier(state)
            priors = None
            if state.spec == "auto":
                self._calibrate()
                priors = await self.priors.read(self.revisions, req.workload)
            policy = policy_for(state, self.cost, self.drafters is not None, priors)
            rounds = speculate(state, proposer, verifier, policy, observer, detok)
            # the next round runs while this one is journaled and streamed; on any exit the
            # rounds stop (and their calls end) before the leases are released below
            async with contextlib.aclosing(run_ahead(rounds, _RUN_AHEAD)) as outcomes:
                async for o in outcomes:
                    await self.journal.append(entry, list(o.tokens), o.finish)  # then stream
                    if entry is not None and entry.cancelled:
                        raise Cancelled("cancelled by the caller")
                    if o.finish is None:
                        yield RouterChunk(o.text, list(o.tokens), logprobs=o.logprobs)
                        _check_deadline(call, state)
                    else:
                        yield RouterChunk(o.text, list(o.tokens), o.finish,
                                          state.stats.to_dict(), o.logprobs)
        except BaseException as e:
            error = e
            if state.finish is None:  # counted as such in the metrics, not as "length"
                state.finish_with("deadline" if _past_deadline(e, call) else "abort")
            raise
        finally:
            if verifier is not None:
                leases["target"] = verifier.lease  # the last one leased
            if isinstance(proposer, RemoteProposer):
                leases["drafter"] = proposer.lease
            if isinstance(policy, GoodputPolicy):
                self.priors.add(self.revisions, policy.counts, req.workload)
            self._release(state, leases, observer, error)

    def _calibrate(self) -> None:
        """Once per router, at its first spec=auto request, in the background: the
        replicas' start-up profiles (verify time over a rows x drafts grid, draft time per
        token) seed the cost model. Until then, or if a pool does not answer within 5 s,
        the defaults (learned online)."""
        if self._calibration is None:
            self._calibration = asyncio.get_running_loop().create_task(self._profiles())

    async def _profiles(self) -> None:
        got: list[Any] = [None, None]
        for i, pool in enumerate((self.targets, self.drafters)):
            if pool is not None:
                try:
                    got[i] = await asyncio.wait_for(pool.profile(), 5.0)
                except Exception as e:  # an optimisation: it never fails a request
                    log.info("no cost profile from the %s pool: %r", ("target", "drafter")[i], e)
        self.cost.seed(got[0] or [], got[1])

    def _resume(self, state: RequestState, detok: IncrementalDetokenizer,
                entry: Entry | None) -> RouterChunk | None:
        """Tokens a previous attempt of this request committed (its journal entry). A
        finish reason counts only as journaled with the last tokens (one atomic write); a
        missing or short entry just means the rest is regenerated."""
        if entry is None or not entry.tokens:
            return None
        state.commit(entry.tokens)
        text = detok.push(entry.tokens)
        finish = "stop" if detok.stopped else entry.finish
        if finish is None and state.remaining <= 0:
            finish = "length"
        state.stats.ttft_s = time.perf_counter() - state.t0
        if finish is None:
            return RouterChunk(text, list(entry.tokens))
        state.finish_with(finish)
        return RouterChunk(text + detok.flush(), list(entry.tokens), finish,
                           state.stats.to_dict())

    async def _proposer(self, state: RequestState,
                        leases: dict[str, Lease]) -> SessionProposer | None:
        if state.spec == "off":
            return None
        if self.drafters is None:
            state.disable_speculation("no drafter deployment")
            return None
        try:
            lease = await self.lease_drafter(state.session_id)
        except Exception as e:
            state.disable_speculation(f"drafter unavailable: {e}")
            return None
        leases["drafter"] = lease
        return RemoteProposer(self, state.session_id, lease)

    async def lease_drafter(self, session_id: str) -> Lease:
        """A drafter lease within ``drafter_lease_s``. A pool at 0 replicas (scaled to zero)
        answers late: the request goes on without speculation, and the lease, still
        queued, keeps asking Serve for a replica (its cold start); once granted it is
        given back. Meanwhile other requests do not wait for it."""
        assert self.drafters is not None
        if self._drafter_starting is not None and not self._drafter_starting.done():
            raise Unavailable("the drafter pool is starting a replica")
        task = asyncio.get_running_loop().create_task(self.drafters.acquire(session_id))
        try:
            done, _ = await asyncio.wait({task}, timeout=self.cfg.drafter_lease_s)
        except asyncio.CancelledError:
            task.add_done_callback(_give_back)
            task.cancel()
            raise
        if done:
            return task.result()
        self._drafter_starting = task
        task.add_done_callback(_give_back)
        raise Unavailable(f"no drafter replica within {self.cfg.drafter_lease_s:g} s")

    async def _verifier(self, state: RequestState) -> RemoteVerifier:
        try:
            lease = await self.targets.acquire(state.session_id)
        except Exception as e:
            raise Unavailable(f"no target replica: {e}") from e
        return RemoteVerifier(self, state.session_id, lease)

    def _release(self, state: RequestState, leases: dict[str, Lease], observer: Observer,
                 error: BaseException | None) -> None:
        """Free the session's caches at its replicas, close its leases, record the end."""
        for component, lease in leases.items():
            lease.mux.send_nowait(wire.release_message(component, state.session_id,
                                                       state.request_id))
            lease.close()
        self.totals.merge(state.stats.acceptance)
        try:
            observer.request_end(state, error)
        except Exception:  # observability must never fail a request
            log.exception("recording the request's metrics / span failed")
