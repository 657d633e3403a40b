"""OpenTelemetry traces of rounds and cache repair, and the Prometheus metrics.

* in process (no Ray): the router's round loop against real drafter / target gRPC servers,
  spans captured by an in-memory exporter: the tree, parent ids and attribute values;
  a forced cache miss as a ``cache_repair`` span;
* on the local Ray cluster: a second app whose replicas export OTLP/gRPC to a receiver on
  127.0.0.1 (built from the opentelemetry-proto service stubs), and Ray's Prometheus
  endpoint scraped after a known workload.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter, defaultdict
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from specserve import tracing
from specserve.api import GenerationRequest

PROMPT = "def read_config(path):\n"
MAX_NEW = 24
HERE = Path(__file__).parent


def _clients(address: str, jobs: list[dict], app: str) -> list[dict]:
    """Requests through the SDK in a separate process (as tests/test_service.py does)."""
    out = subprocess.run(
        [sys.executable, str(HERE / "service_client.py"), address, app, json.dumps(jobs)],
        capture_output=True, text=True, timeout=600, check=True,
        env={**os.environ, "PYTHONPATH": str(HERE.parent)},
    )
    return [json.loads(line) for line in out.stdout.splitlines()]


# ----------------------------------------------------------------- in process, in memory
@pytest.fixture
def spans():
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    assert tracing.setup_tracing("specserve-test", exporter=exporter)
    yield exporter
    tracing.use_provider(None)


def _run(pair, req: GenerationRequest, request_id: str, *, drop_caches_after: int | None = None,
         client_span: bool = False):
    """One request through the in-process service; returns (chunks, client span or None)."""
    from router.inprocess import start_inprocess

    async def go():
        svc = await start_inprocess(pair)
        parent = client = None
        tr = tracing.tracer()
        if client_span and tr is not None:
            from opentelemetry import trace

            client = tr.start_span("client")
            parent = trace.set_span_in_context(client)
        try:
            chunks = []
            async for ch in svc.router.generate(req, request_id, parent):
                chunks.append(ch)
                if len(chunks) == drop_caches_after:  # between rounds: lose both caches
                    for engine in (svc.target, svc.drafter):
                        for sid in list(engine._sessions):
                            engine.release(sid)
            return chunks, client
        finally:
            if client is not None:
                client.end()
            await svc.close()

    return asyncio.run(go())


def _by_name(finished) -> dict[str, list]:
    out: dict[str, list] = defaultdict(list)
    for s in finished:
        out[s.name].append(s)
    return out


def _children(finished, parent) -> list:
    return [s for s in finished
            if s.parent is not None and s.parent.span_id == parent.context.span_id]


def test_one_request_span_tree(builtin_pair, spans):
    req = GenerationRequest(prompt=PROMPT, max_tokens=MAX_NEW, spec="draft", k=4)
    chunks, client = _run(builtin_pair, req, "trace-me-1", client_span=True)
    st = chunks[-1].stats
    finished = spans.get_finished_spans()
    named = _by_name(finished)

    # one trace, rooted at the caller's span
    assert {s.context.trace_id for s in finished} == {client.get_span_context().trace_id}
    (gen,) = named["generate"]
    assert gen.parent.span_id == client.get_span_context().span_id
    a = gen.attributes
    assert a["specserve.request_id"] == "trace-me-1"
    assert a["specserve.spec"] == "draft" and a["specserve.k"] == 4
    assert a["specserve.target_revision"] == builtin_pair.target_revision
    assert a["specserve.drafter_revision"] == builtin_pair.drafter_revision
    assert a["specserve.finish_reason"] == chunks[-1].finish_reason == "length"
    assert a["specserve.output_tokens"] == st["output_tokens"] == MAX_NEW
    assert a["specserve.prompt_tokens"] == st["prompt_tokens"]
    for key in ("rounds", "drafts", "draft_tokens", "accepted_tokens", "bonus_tokens"):
        assert a[f"specserve.{key}"] == st[key], key

    # rounds: children of generate, attribute sums = the request's stats
    rounds = sorted(named["round"], key=lambda s: s.attributes["specserve.round"])
    assert {s.name for s in _children(finished, gen)} == {"round"}
    assert len(rounds) == st["rounds"] > 1
    ra = [r.attributes for r in rounds]
    assert [x["specserve.round"] for x in ra] == list(range(len(rounds)))
    assert sum(x["specserve.accepted"] for x in ra) == st["accepted_tokens"] > 0
    assert sum(x["specserve.drafted"] for x in ra) == st["draft_tokens"]
    assert sum(x["specserve.extra_token"] == "bonus" for x in ra) == st["bonus_tokens"]
    assert ra[-1]["specserve.committed_len"] == st["prompt_tokens"] + st["output_tokens"]
    assert all(x["specserve.batch_size"] == 1 for x in ra)
    assert a["specserve.target_replica"] == "target-0"
    assert a["specserve.drafter_replica"] == "drafter-0"

    lens = [st["prompt_tokens"]] + [x["specserve.committed_len"] for x in ra]
    propose_ids, verify_ids = set(), set()
    for i, r in enumerate(rounds):
        kids = _by_name(_children(finished, r))
        drafted = r.attributes["specserve.drafted"]
        assert len(kids["verify"]) == 1 and len(kids["propose"]) == (1 if drafted else 0)
        verify_ids.add(kids["verify"][0].context.span_id)
        assert "specserve.cache_miss" not in kids["verify"][0].attributes
        # round i sends the tokens committed by round i - 1 (round 0: the prompt)
        assert kids["verify"][0].attributes["specserve.tokens_sent"] == (
            lens[0] if i == 0 else lens[i] - lens[i - 1])
        (row,) = _children(finished, kids["verify"][0])  # the target's span of this call
        assert row.name == "target.verify_row"
        assert row.attributes["specserve.accepted"] == r.attributes["specserve.accepted"]
        assert row.attributes["specserve.drafted"] == drafted
        if drafted:
            propose_ids.add(kids["propose"][0].context.span_id)
            (dspan,) = _children(finished, kids["propose"][0])
            assert dspan.name == "drafter.propose"
            assert dspan.attributes["specserve.drafted"] == drafted
        # no cache was lost: no cache_repair span; the previous round's rejected drafts
        # are rolled back (round attributes)
        assert not kids["cache_repair"]
        a = r.attributes
        if i:
            prev = rounds[i - 1].attributes
            assert a["specserve.target_rolled_back"] == (prev["specserve.drafted"]
                                                         - prev["specserve.accepted"])
            if drafted and prev["specserve.drafted"]:  # the drafter cached k - 1 drafts
                assert a["specserve.drafter_rolled_back"] == prev["specserve.drafted"] - 1 - min(
                    prev["specserve.accepted"], prev["specserve.drafted"] - 1)
        else:  # the first call of a session is its prefill
            assert a["specserve.target_rolled_back"] == a["specserve.drafter_rolled_back"] == 0

    # the replicas' spans are children of the router's call spans (via traceparent)
    assert {s.parent.span_id for s in named["drafter.propose"]} == propose_ids
    assert {s.parent.span_id for s in named["target.verify_row"]} == verify_ids
    assert all(s.attributes["specserve.cache"] == "hit" for s in named["target.verify_row"])
    # every batch forward is linked to the rows it served
    rows = {s.context.span_id for s in named["target.verify_row"]}
    assert len(named["target.batch_forward"]) == len(rounds)
    for fwd in named["target.batch_forward"]:
        linked = {lk.context.span_id for lk in fwd.links}
        assert linked <= rows and len(linked) == fwd.attributes["specserve.batch_size"] == 1
        assert fwd.parent.span_id in linked


def test_forced_cache_miss_is_a_cache_repair_span(builtin_pair, generator, spans):
    req = GenerationRequest(prompt=PROMPT, max_tokens=MAX_NEW, spec="draft", k=3)
    _, ref, _ = generator.generate(GenerationRequest(prompt=PROMPT, max_tokens=MAX_NEW,
                                                     spec="off"))
    chunks, _ = _run(builtin_pair, req, "miss-me-1", drop_caches_after=2)
    assert [t for c in chunks for t in c.token_ids] == ref  # repaired, output unchanged
    finished = spans.get_finished_spans()
    named = _by_name(finished)
    rounds = sorted(named["round"], key=lambda s: s.attributes["specserve.round"])
    lost_at = rounds[2]  # the round after the caches were dropped
    repairs = {s.attributes["specserve.component"]: s for s in _children(finished, lost_at)
               if s.name == "cache_repair"}
    assert set(repairs) == {"drafter", "target"}
    committed = rounds[1].attributes["specserve.committed_len"]
    for rep in repairs.values():
        a = rep.attributes
        assert a["specserve.cache"] == "miss"
        assert a["specserve.cached_before"] == 0 and a["specserve.kept"] == 0
        assert a["specserve.fed"] == committed  # every committed token fed again
        assert a["specserve.reprefilled"] == committed - 2 > 0
        assert rep.end_time > rep.start_time  # spans the miss answer -> full resend
    (verify,) = [s for s in _children(finished, lost_at) if s.name == "verify"]
    assert verify.attributes["specserve.cache_miss"] is True
    misses = [s for s in named["target.verify_row"] if s.attributes["specserve.cache"] == "miss"]
    assert len(misses) == 1 and misses[0].parent.span_id == verify.context.span_id
    (gen,) = named["generate"]
    assert gen.attributes["specserve.cache_misses"] == 2
    # no other round repaired a cache
    assert len(named["cache_repair"]) == 2


def test_round_path_splits_each_call_into_hops_and_replica_time(builtin_pair):
    """Every drafted round's calls are split by the replicas' stamps; time a row spends in
    the target server before its step (here an injected 200 ms hold) is the server's, not a
    hop's; the parts never exceed the call as the router timed it."""
    from router.inprocess import start_inprocess
    from router.stats import router_stats

    hold_s = 0.2

    async def go():
        svc = await start_inprocess(builtin_pair)
        serve = svc.target_servicer._serve

        async def held(batch):  # the fault: every step starts 200 ms after its rows are in
            await asyncio.sleep(hold_s)
            await serve(batch)

        svc.target_servicer._serve = held
        try:
            await svc.generate(GenerationRequest(prompt=PROMPT, max_tokens=MAX_NEW,
                                                 spec="draft", k=3), "path-1")
            return router_stats(svc.router), svc.router.timing.snapshot()
        finally:
            await svc.close()

    stats, t = asyncio.run(go())
    path = stats["round_path"]
    rounds = stats["round"]["n"]
    assert rounds > 1 and path["target_server"]["n"] == rounds
    assert 0 < path["drafter_send"]["n"] == path["drafter_return"]["n"] <= rounds
    assert path["between_rounds"]["n"] == rounds - 1
    assert path["target_server"]["p50_ms"] >= hold_s * 1000
    for i in range(rounds):
        for c, call in (("drafter", "propose_s"), ("target", "verify_s")):
            parts = [t[f"{c}_{h}_s"][i] for h in ("send", "server", "return")]
            if c == "drafter" and t["drafter_compute_s"][i] == 0.0:
                continue
            assert min(parts) >= 0, (c, parts)
            assert sum(parts) + t[f"{c}_compute_s"][i] <= t[call][i] + 1e-3, (c, parts)
            assert parts[0] + parts[2] < hold_s  # the hold is not a hop's


def test_the_round_log_has_every_round_of_every_request(builtin_pair, tmp_path):
    """``router.round_log``: one JSON line per round, whose counts add up to each request's
    final stats, and which the bench's estimates read."""
    from router.inprocess import start_inprocess
    from specserve.bench.analysis import round_time_estimates
    from specserve.observers import RoundLog

    path = tmp_path / "rounds.jsonl"
    reqs = {"log-draft": GenerationRequest(prompt=PROMPT, max_tokens=MAX_NEW, spec="draft", k=4),
            "log-auto": GenerationRequest(prompt="class Stack:\n", max_tokens=16)}

    async def go() -> dict[str, dict]:
        svc = await start_inprocess(builtin_pair)
        svc.router.round_log = RoundLog(str(path), svc.router.cost)
        try:
            async def one(rid: str) -> dict:
                return [ch async for ch in svc.router.generate(reqs[rid], rid)][-1].stats
            return dict(zip(reqs, await asyncio.gather(*map(one, reqs)), strict=True))
        finally:
            svc.router.round_log.close()
            await svc.close()

    stats = asyncio.run(go())
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    for rid, st in stats.items():
        mine = [r for r in lines if r["request"] == rid]
        assert [r["round_no"] for r in mine] == list(range(st["rounds"]))
        assert sum(r["tokens"] for r in mine) == st["output_tokens"]
        assert sum(r["drafted"] for r in mine) == st["draft_tokens"]
        assert sum(r["accepted"] for r in mine) == st["accepted_tokens"]
        assert all(r["rows"] >= 1 and r["round_s"] > 0 for r in mine)
        assert mine[0]["batch_fed"] >= st["prompt_tokens"]  # the prefill is in the first step
        assert mine[0]["gap_s"] == 0 and all(r["gap_s"] > 0 for r in mine[1:])
        assert all(0 <= r["verify_compute_s"] <= r["verify_s"] for r in mine)
        assert all(r["propose_compute_s"] >= 0 for r in mine)
    # the two arrived together into a quiet router: a burst until both had a round
    assert lines[0]["burst"] and not lines[-1]["burst"]
    # what a plan was chosen on: auto's from its cost model, none for a fixed mode
    auto = [r for r in lines if r["request"] == "log-auto"]
    assert auto and all(r["expected"] >= 1 and r["predicted_s"] > 0 for r in auto
                        if r["reason"] not in ("budget", "off", "no_lookup_match",
                                               "drafter_unavailable"))
    assert all(r["expected"] == 0 and r["predicted_s"] == 0
               for r in lines if r["request"] == "log-draft")
    assert {r["spec"] for r in lines} == {"draft", "auto"}
    for d in (r["decision"] for r in lines if "decision" in r):  # a batch's, if it had one
        assert d["plan"] in d["scores"] and {how for _, how, *_ in d["scores"].values()} <= {
            "m", "c", "p"}
    assert next(r["k"] for r in lines if r["request"] == "log-draft") == 4
    est = round_time_estimates(lines)
    assert est["rounds"] == len(lines) and 0 < est["decoding_share"] < 1
    assert est["all_rounds_mean_ms"] > 0 and est["decoding_median_ms"] > 0


def test_tracing_off_is_a_none_check():
    tracing.use_provider(None)
    assert tracing.tracer() is None
    assert tracing.traceparent_of(None) == ""
    assert tracing.context_from_traceparent("") is None
    assert tracing.context_from_traceparent("00-garbage") is None


def test_traceparent_round_trip(spans):
    from opentelemetry import trace

    span = tracing.tracer().start_span("x")
    tp = tracing.traceparent_of(span)
    sc = span.get_span_context()
    assert tp == f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{int(sc.trace_flags):02x}"
    ctx = tracing.context_from_metadata([("request_id", "r"), ("traceparent", tp)])
    remote = trace.get_current_span(ctx).get_span_context()
    assert (remote.trace_id, remote.span_id, remote.trace_flags, remote.is_remote) == (
        sc.trace_id, sc.span_id, sc.trace_flags, True)
    # with a tracestate: through the W3C propagator, same parent
    ctx = tracing.context_from_metadata([("traceparent", tp), ("tracestate", "k=v")])
    assert trace.get_current_span(ctx).get_span_context().span_id == sc.span_id
    assert tracing.context_from_traceparent(tp.upper()) is None  # W3C: lowercase hex only
    span.end()


def test_sdk_client_injects_the_current_span():
    from opentelemetry.sdk.trace import TracerProvider

    from specserve.client import _trace_metadata

    assert _trace_metadata() == ()  # no active span
    tr = TracerProvider().get_tracer("t")
    with tr.start_as_current_span("caller") as span:
        md = dict(_trace_metadata())
    sc = span.get_span_context()
    assert md["traceparent"] == f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{int(sc.trace_flags):02x}"


# ----------------------------------------------------------------- Ray: OTLP and Prometheus
TRACED = "specserve-traced"
SERVICES = {"specserve-router", "specserve-drafter", "specserve-target"}


class _Receiver:
    """An OTLP/gRPC trace receiver (opentelemetry.proto.collector.trace.v1.TraceService)."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1 import (
            trace_service_pb2,
            trace_service_pb2_grpc,
        )

        self.requests: list = []
        self._lock = threading.Lock()
        receiver = self

        class Servicer(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):
                with receiver._lock:
                    receiver.requests.append(request)
                return trace_service_pb2.ExportTraceServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Servicer(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def spans(self) -> list[tuple[str, object]]:
        """(service.name, Span proto) of everything received."""
        out = []
        with self._lock:
            requests = list(self.requests)
        for req in requests:
            for rs in req.resource_spans:
                attrs = {kv.key: kv.value.string_value for kv in rs.resource.attributes}
                for ss in rs.scope_spans:
                    out.extend((attrs.get("service.name", ""), sp) for sp in ss.spans)
        return out


@pytest.fixture(scope="module")
def receiver():
    r = _Receiver()
    yield r
    r.server.stop(None)


@pytest.fixture(scope="module")
def traced_app(service, receiver):
    """A second app on the session's cluster whose replicas export traces to `receiver`."""
    from ray import serve

    from deployments.app import build_app

    serve.run(build_app({"otlp_endpoint": f"http://127.0.0.1:{receiver.port}",
                         "redis_url": service.redis_url}),
              name=TRACED, route_prefix=f"/{TRACED}")
    sent: list[dict] = []  # stats of every request sent to this app (for the metrics test)
    yield sent
    serve.delete(TRACED)


def _attrs(span) -> dict:
    out = {}
    for kv in span.attributes:
        v = kv.value
        out[kv.key] = getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None
    return out


def test_otlp_receiver_gets_one_trace_from_all_deployments(service, receiver, traced_app):
    from opentelemetry.sdk.trace import TracerProvider

    from specserve.client import Client

    tr = TracerProvider().get_tracer("test-client")  # the caller's own tracing
    with tr.start_as_current_span("caller") as caller, Client(
            service.grpc_address, timeout=300, app_name=TRACED) as client:
        result = client.generate(PROMPT, max_tokens=16, spec="draft", k=4)
    traced_app.append(result.stats)
    trace_id = caller.get_span_context().trace_id.to_bytes(16, "big")

    deadline = time.monotonic() + 60  # replicas export in batches (~5 s)
    while True:
        ours = [(svc, sp) for svc, sp in receiver.spans() if sp.trace_id == trace_id]
        if {svc for svc, _ in ours} >= SERVICES and len(
                [1 for _, sp in ours if sp.name == "generate"]):
            by_name: dict[str, list] = defaultdict(list)
            for svc, sp in ours:
                by_name[sp.name].append((svc, sp))
            # each replica exports in its own batches: wait for all of them
            if (len(by_name["round"]) >= result.stats["rounds"]
                    and len(by_name["target.verify_row"]) >= result.stats["rounds"]
                    and len(by_name["drafter.propose"]) >= result.stats["drafts"]):
                break
        assert time.monotonic() < deadline, Counter(svc for svc, _ in receiver.spans())
        time.sleep(0.5)

    (gsvc, gen), = by_name["generate"]
    assert gsvc == "specserve-router"
    assert gen.parent_span_id == caller.get_span_context().span_id.to_bytes(8, "big")
    ga = _attrs(gen)
    assert ga["specserve.accepted_tokens"] == result.stats["accepted_tokens"]
    assert ga["specserve.output_tokens"] == len(result.token_ids)
    rounds = [sp for _, sp in by_name["round"]]
    assert len(rounds) == result.stats["rounds"]
    assert all(sp.parent_span_id == gen.span_id for sp in rounds)
    assert sum(_attrs(sp)["specserve.accepted"] for sp in rounds) == result.stats[
        "accepted_tokens"]
    services = {name: {svc for svc, _ in spans_} for name, spans_ in by_name.items()}
    assert services["drafter.propose"] == {"specserve-drafter"}
    assert services["target.verify_row"] == {"specserve-target"}
    propose = {sp.span_id for _, sp in by_name["propose"]}
    verify = {sp.span_id for _, sp in by_name["verify"]}
    assert {sp.parent_span_id for _, sp in by_name["drafter.propose"]} <= propose
    assert {sp.parent_span_id for _, sp in by_name["target.verify_row"]} <= verify
    assert len(by_name["target.verify_row"]) >= len(rounds)


def _scrape(url: str, application: str) -> dict[tuple[str, frozenset], float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    out: dict[tuple[str, frozenset], float] = defaultdict(float)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("ray_specserve_") and s.labels.get("application") == application:
                keep = frozenset((k, v) for k, v in s.labels.items()
                                 if k in ("spec", "position", "finished_reason", "component",
                                          "part", "le"))
                out[(s.name, keep)] += s.value
    return out


def test_prometheus_counters_match_the_workload(service, traced_app):
    jobs = ([{"prompt": PROMPT, "max_tokens": 20, "spec": "draft", "k": 4}] * 3
            + [{"prompt": "class Stack:\n", "max_tokens": 20, "spec": "ngram", "k": 3}] * 2
            + [{"prompt": "import os\n", "max_tokens": 12, "spec": "off", "k": 0}])
    results = _clients(service.grpc_address, jobs, app=TRACED)
    assert all("error" not in r for r in results), results
    traced_app.extend(r["stats"] for r in results)

    expected: dict[tuple[str, frozenset], float] = defaultdict(float)
    c = "ray_specserve_"
    for st in traced_app:
        spec = frozenset({("spec", st["spec"])})
        for name, key in (("spec_decode_num_drafts_total", "drafts"),
                          ("spec_decode_num_draft_tokens_total", "draft_tokens"),
                          ("spec_decode_num_accepted_tokens_total", "accepted_tokens"),
                          ("generation_tokens_total", "output_tokens"),
                          ("prompt_tokens_total", "prompt_tokens")):
            if st[key]:
                expected[(c + name, spec)] += st[key]
        for pos, n in enumerate(st["accepted_per_position"]):
            if n:
                expected[(c + "spec_decode_num_accepted_tokens_per_pos_total",
                          spec | {("position", str(pos))})] += n
        expected[(c + "request_success_total",
                  spec | {("finished_reason", "length")})] += 1
        expected[(c + "time_to_first_token_seconds_count", spec)] += 1
        expected[(c + "round_latency_seconds_count", spec)] += st["rounds"]
        if st["drafts"]:
            expected[(c + "spec_decode_acceptance_length_count", spec)] += st["drafts"]
            expected[(c + "spec_decode_acceptance_length_sum", spec)] += (
                st["drafts"] + st["accepted_tokens"])
    rows = sum(st["rounds"] for st in traced_app)  # one verify row per round, no misses
    expected[(c + "target_rows_total", frozenset())] = rows
    expected[(c + "target_batch_size_sum", frozenset())] = rows  # exact: batches of <= 8

    deadline = time.monotonic() + 90  # Ray exports metrics periodically
    while True:
        got = _scrape(service.metrics_url, TRACED)
        diff = {k: (v, got.get(k)) for k, v in expected.items() if got.get(k) != v}
        if not diff:
            break
        assert time.monotonic() < deadline, diff
        time.sleep(2)
    # the mean acceptance length from the counters, as the documented PromQL computes it
    drafts = sum(v for (n, _), v in got.items() if n == c + "spec_decode_num_drafts_total")
    accepted = sum(v for (n, _), v in got.items()
                   if n == c + "spec_decode_num_accepted_tokens_total")
    want = sum(st["accepted_tokens"] for st in traced_app) / sum(
        st["drafts"] for st in traced_app)
    assert 1 + accepted / drafts == pytest.approx(1 + want)
    rolled = frozenset({("component", "target")})
    # every rejected draft but those of a request's last round is rolled back
    assert 0 < got[(c + "cache_rolled_back_tokens_total", rolled)] <= sum(
        st["draft_tokens"] - st["accepted_tokens"] for st in traced_app)
