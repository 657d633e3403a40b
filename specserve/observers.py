"""Observers of the round (``specserve.rounds.Observer``): OpenTelemetry spans, Prometheus
metrics and the router's timing window. The round calls them; they never change it.

Span names, attributes and metric names are documented in ``docs/observability.md``:
``generate`` (one per request) -> ``round`` -> ``propose`` / ``verify`` (clients of the
replicas' spans, via the W3C ``traceparent`` they return) and ``cache_repair``.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from specserve import tracing
from specserve.contract import ProposeOutcome, VerifyOutcome
from specserve.rounds import Observer, RepairEvent, RequestState, RoundOutcome

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span

    from specserve.policy import CostModel
    from specserve.service.metrics import RouterMetrics

_CALL_SPANS = {"drafter": "propose", "target": "verify"}


def record_error(span: Span, error: BaseException | None) -> None:
    """Mark ``span`` failed by ``error`` (a cancellation is not an error: an attribute)."""
    if error is None or not span.is_recording():
        return
    if isinstance(error, Exception):
        from opentelemetry.trace import Status, StatusCode

        span.record_exception(error)
        span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
    else:  # GeneratorExit / CancelledError: the client went away
        span.set_attribute("specserve.cancelled", True)


class TracingObserver(Observer):
    """One request's spans. ``request_attrs``: what the request asked for (spec_requested,
    temperature), set on the ``generate`` span with the outcome at the end."""

    def __init__(self, parent: Context | None, request_attrs: dict[str, Any]):
        from opentelemetry.trace import SpanKind

        self._tracer = tracing.tracer()
        assert self._tracer is not None, "tracing is off: use no TracingObserver"
        self._client = SpanKind.CLIENT
        self.generate = self._tracer.start_span("generate", context=parent,
                                                kind=SpanKind.SERVER)
        self._gctx = tracing.parent_context(self.generate)
        self._round: Span | None = None
        self._rctx: Context | None = None
        self._calls: dict[str, Span] = {}
        self._attrs = request_attrs

    def round_start(self, state: RequestState, k: int) -> None:
        self._round = self._tracer.start_span("round", context=self._gctx)
        self._rctx = tracing.parent_context(self._round)

    def call_start(self, state: RequestState, component: str) -> str:
        span = self._tracer.start_span(_CALL_SPANS[component], context=self._rctx,
                                       kind=self._client)
        self._calls[component] = span
        return tracing.traceparent_of(span)

    def call_end(self, state: RequestState, component: str,
                 outcome: ProposeOutcome | VerifyOutcome | None,
                 error: BaseException | None) -> None:
        span = self._calls.pop(component, None)
        if span is None:
            return
        if error is not None:
            record_error(span, error)
        elif outcome is not None and span.is_recording():
            span.set_attribute("specserve.tokens_sent", outcome.call.tokens_sent)
            if outcome.call.miss_ns is not None:
                span.set_attribute("specserve.cache_miss", True)
        span.end()

    def _repair_span(self, e: RepairEvent) -> None:
        if not (e.miss or e.reprefilled):
            return
        span = self._tracer.start_span("cache_repair", context=self._rctx, start_time=e.start_ns)
        if span.is_recording():
            span.set_attributes({
                "specserve.component": e.component, "specserve.cache": "miss" if e.miss else "hit",
                "specserve.rolled_back": e.rolled_back, "specserve.reprefilled": e.reprefilled,
                "specserve.cached_before": e.cached_before, "specserve.kept": e.kept,
                "specserve.fed": e.fed, "specserve.replica": e.replica})
            span.end(end_time=e.end_ns)

    def round_end(self, state: RequestState, o: RoundOutcome) -> None:
        for e in o.repairs:
            self._repair_span(e)
        span, self._round = self._round, None
        if span is None:
            return
        if span.is_recording():  # few attributes (each costs)
            d_rep, t_rep = o.proposal.repair, o.verdict.repair
            span.set_attributes({
                "specserve.round": o.round_no, "specserve.k": o.k if o.drafted else 0,
                "specserve.drafted": o.drafted, "specserve.accepted": o.decision.num_accepted,
                "specserve.drafted_ahead": bool(o.proposal.ahead and o.drafted),
                "specserve.drafted_ahead_after": o.ahead_after,
                "specserve.extra_token": ("bonus" if o.drafted and o.decision.bonus
                                          else "recovered" if o.drafted else "plain"),
                "specserve.committed_len": len(state.committed),
                "specserve.batch_size": o.verdict.batch_size,
                "specserve.drafter_rolled_back": d_rep.rolled_back if d_rep else 0,
                "specserve.target_rolled_back": t_rep.rolled_back if t_rep else 0,
                "specserve.plan.proposer": o.plan.proposer or "none",
                "specserve.plan.k": o.plan.k, "specserve.plan.reason": o.plan.reason,
                "specserve.plan.expected_tokens": o.plan.expected,
                "specserve.plan.cost_s": o.plan.cost_s})
        span.end()

    def request_end(self, state: RequestState, error: BaseException | None) -> None:
        for span in [*self._calls.values(), self._round]:
            if span is not None:  # a round that failed
                record_error(span, error)
                span.end()
        g = self.generate
        if g.is_recording():
            st, acc = state.stats, state.stats.acceptance
            g.set_attributes({
                **self._attrs, "specserve.request_id": state.request_id,
                "specserve.session_id": state.session_id, "specserve.spec": state.spec,
                "specserve.k": state.k if state.spec != "off" else 0,
                "specserve.target_revision": st.target_revision,
                "specserve.drafter_revision": st.drafter_revision,
                "specserve.drafter_replica": state.replicas["drafter"],
                "specserve.target_replica": state.replicas["target"],
                "specserve.seed": st.seed, "specserve.prompt_tokens": st.prompt_tokens,
                "specserve.output_tokens": st.output_tokens,
                "gen_ai.usage.input_tokens": st.prompt_tokens,
                "gen_ai.usage.output_tokens": st.output_tokens,
                "specserve.finish_reason": state.finish or "abort",
                "specserve.rounds": acc.rounds, "specserve.drafts": acc.drafts,
                "specserve.draft_tokens": acc.draft_tokens,
                "specserve.accepted_tokens": acc.accepted_tokens,
                "specserve.bonus_tokens": acc.bonus_tokens,
                "specserve.mean_acceptance_length": acc.mean_acceptance_length,
                "specserve.ttft_s": st.ttft_s,
                "specserve.speculation_disabled_reason": st.speculation_disabled_reason,
                "specserve.cache_repairs": sum(t.repairs for t in state.repairs.values()),
                "specserve.cache_misses": sum(t.misses for t in state.repairs.values())})
        record_error(g, error)
        g.end()


class MetricsObserver(Observer):
    """One request's Prometheus observations into the replica's ``RouterMetrics``. A round's
    are recorded off the round path: read when it ends, handed to Ray's metrics two event-loop
    turns later (``_later``), when the next round's first call has gone out (a round's eight
    Ray metric calls otherwise delay the next round's start)."""

    def __init__(self, metrics: RouterMetrics):
        self.m = metrics
        self._first = True
        self._last = 0.0

    def round_end(self, state: RequestState, o: RoundOutcome) -> None:
        itl = None
        if not self._first and o.tokens:
            itl = (state.last_commit_t - self._last) / len(o.tokens)
        first = state.stats.ttft_s if self._first else None
        self._first, self._last = False, state.last_commit_t
        _later(self._record_round, state.spec, o, first, itl)

    def _record_round(self, spec: str, o: RoundOutcome, ttft_s: float | None,
                      itl_s: float | None) -> None:
        d_compute = o.proposal.call.compute_s if o.drafted else 0.0
        self.m.round(spec, o.round_s, o.propose_s, o.verify_s, d_compute,
                     o.verdict.call.compute_s, o.drafted, len(o.decision.tokens))
        self.m.decision(o.plan.reason, o.plan.proposer)
        if o.ahead_after:
            self.m.drafted_ahead_round(spec, o.ahead_after)
        if ttft_s is not None:
            self.m.first_token(spec, ttft_s)
        if itl_s is not None:
            self.m.inter_token(spec, itl_s)

    def request_end(self, state: RequestState, error: BaseException | None) -> None:
        st = state.stats
        self.m.request_end(state.spec, state.finish or "abort", st.acceptance, st.prompt_tokens,
                           st.output_tokens, st.total_s or (self._last - state.t0))
        for component, t in state.repairs.items():
            self.m.cache(component, t.repairs, t.misses, t.rolled_back, t.reprefilled)


def _later(fn: Any, *args: Any) -> None:
    """``fn(*args)`` two turns of the running event loop from now (at once without one): a
    round that ends here starts the next one's call in this turn, the stream's writer task
    sends it in the next, then this runs."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        fn(*args)
        return
    loop.call_soon(loop.call_soon, fn, *args)


def _window() -> deque:
    return deque(maxlen=50_000)


_NAN = float("nan")
_HOPS = ("send_s", "server_s", "return_s")
TIMING_COLUMNS = (
    "propose_s", "verify_s", "round_s", "drafter_compute_s", "target_compute_s", "gap_s",
    *(f"{c}_{h}" for c in ("drafter", "target") for h in _HOPS))


@dataclass
class RoundTiming(Observer):
    """The router's recent rounds (bounded): the per-round split for ``router_stats``.
    *_compute_s are the replicas' own compute times; {drafter,target}_{send,server,return}_s
    the hop split of each call (``CallInfo.hops``; NaN where the component was not called or
    did not stamp its reply); gap_s the time between a request's rounds (the round's end to
    the next one's start: detokenization and the hand-off to the stream). Shared by every
    request."""

    cols: dict[str, deque] = field(
        default_factory=lambda: {n: _window() for n in TIMING_COLUMNS})

    def round_end(self, state: RequestState, o: RoundOutcome) -> None:
        c = self.cols
        c["propose_s"].append(o.propose_s)
        c["verify_s"].append(o.verify_s)
        c["round_s"].append(o.round_s)
        c["drafter_compute_s"].append(o.proposal.call.compute_s if o.drafted else 0.0)
        c["target_compute_s"].append(o.verdict.call.compute_s)
        c["gap_s"].append(o.gap_s if o.round_no else _NAN)
        for name, out in (("drafter", o.proposal if o.drafted else None), ("target", o.verdict)):
            hops = out.call.hops() if out is not None else None
            for h, v in zip(_HOPS, hops or (_NAN,) * 3, strict=True):
                c[f"{name}_{h}"].append(v)

    def snapshot(self) -> dict[str, list[float]]:
        """A consistent copy (rounds append from the event loop; readers may be elsewhere)."""
        names = TIMING_COLUMNS
        while True:
            try:
                snap = {n: list(self.cols[n]) for n in names}
            except RuntimeError:  # "deque mutated during iteration": read again
                continue
            n = min(len(v) for v in snap.values())
            return {k: v[len(v) - n:] for k, v in snap.items()}

    def clear(self) -> None:
        for d in self.cols.values():
            d.clear()


class RoundLog(Observer):
    """One JSON line per round, appended to ``path`` (``router.round_log``; off by default):
    what the cost model sees of a round and what it leaves out, for diagnosis offline
    (``bench/round_costs.py``). Several router processes may append to one file: a line
    is one ``write`` of an ``O_APPEND`` file. Fields: ``t`` (unix time at the round's end),
    ``router`` (pid), ``request``, ``spec`` (the mode in effect: off once speculation was
    disabled), ``proposer``, ``k``, ``reason``, ``drafted``, ``accepted``, ``tokens``
    (committed), ``round_no``, ``round_s``, ``propose_s``, ``verify_s``, ``gap_s``,
    ``rows`` / ``queued`` (the verify reply's batch and the target's queue),
    ``batch_tokens`` / ``batch_fed`` (positions the step verified / fed: more fed than
    verified is a prefill or a rebuild in the step), ``fed`` (``RoundOutcome.caught_up``),
    ``expected`` / ``predicted_s`` (the committed tokens and round time the plan was chosen
    on: spec=auto's cost model; 0 for a fixed mode), ``verify_compute_s`` /
    ``propose_compute_s`` (the replicas' own compute, which the cost model's fits learn
    from; 0 in process, where no replica reports it), ``burst`` (``CostModel.burst`` of
    the router's cost model at the round's end; false without one), and on the first line
    after a batch decided its plan (spec=auto), ``decision``: ``at`` (the cost model's round
    count), ``rows``, ``plan`` (kept or taken, ``draft:2`` / ``ngram:1`` / ``off``),
    ``overhead_ms`` (the rest of a round the model adds to every plan's time) and
    ``scores``, per plan [goodput in tokens/s, how its time was priced (``m`` measured at
    this load lately, ``c`` the model's times a ratio measured near it, ``p`` never measured
    near it: the model's, times a ratio of a plan with fewer drafts where there is one), the
    measured mean's relative standard error, the expected committed tokens a row, the round
    time in ms, the model's own time in ms]: the goodput is the rows' expected tokens over
    that time."""

    def __init__(self, path: str, cost: CostModel | None = None):
        self.path = path
        self.cost = cost
        if cost is not None:
            cost.explaining = True  # keep the batch's decisions for ``decision``
        try:
            self._file = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
        except OSError as e:
            raise ValueError(f"router.round_log: cannot append to {path!r} ({e.strerror}); "
                             "give a writable file on the router's node") from None
        self._pid = os.getpid()
        self._logged: dict | None = None  # the last decision written

    def round_end(self, state: RequestState, o: RoundOutcome) -> None:
        v = o.verdict
        self._file.write(json.dumps({
            "t": round(time.time(), 4), "router": self._pid, "request": state.request_id,
            "spec": state.spec, "proposer": o.plan.proposer, "k": o.plan.k,
            "reason": o.plan.reason, "drafted": o.drafted,
            "accepted": o.decision.num_accepted, "tokens": len(o.tokens),
            "round_no": o.round_no, "round_s": round(o.round_s, 6),
            "propose_s": round(o.propose_s, 6), "verify_s": round(o.verify_s, 6),
            "gap_s": round(o.gap_s, 6), "rows": v.batch_size, "queued": v.queue_rows,
            "batch_tokens": v.batch_tokens, "batch_fed": v.batch_fed, "fed": o.caught_up,
            "expected": round(o.plan.expected, 4), "predicted_s": round(o.plan.cost_s, 6),
            "verify_compute_s": round(v.call.compute_s, 6),
            "propose_compute_s": round(o.proposal.call.compute_s, 6),
            "burst": self.cost is not None and self.cost.burst(), **self._decision()}) + "\n")

    def _decision(self) -> dict:
        """The batch's decision (``CostModel.decision``) on the first line after it."""
        d = self.cost.decision if self.cost is not None else None
        if d is None or d is self._logged:
            return {}
        self._logged = d
        return {"decision": d}

    def close(self) -> None:
        self._file.close()
