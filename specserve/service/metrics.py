"""Prometheus metrics of the service through Ray's metrics API (``ray.serve.metrics``: the
``ray.util.metrics`` types plus the ``application``, ``deployment`` and ``replica`` labels).

Named like vLLM's where they overlap (``vllm:spec_decode_num_drafts`` ->
``specserve_spec_decode_num_drafts``, ``vllm:time_to_first_token_seconds`` ->
``specserve_time_to_first_token_seconds``, ``vllm:request_success{finished_reason}`` ->
``specserve_request_success{finished_reason}``, ...). Ray exports every application metric
with a ``ray_`` prefix and counters with a ``_total`` suffix, so the scraped names are e.g.
``ray_specserve_spec_decode_num_drafts_total`` (see ``docs/observability.md``).

Only the Serve deployments create these (they need a Ray worker); the engines, the
in-process router and the benchmarks run without metrics (``metrics=None``).
"""

from __future__ import annotations

from typing import Any

from specserve.api import MAX_K

LATENCY_BUCKETS = [0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2,
                   0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0]
REQUEST_BUCKETS = [0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0,
                   320.0]
TOKENS_PER_S_BUCKETS = [1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0,
                        5000.0]
# Ray exports a histogram's _sum from bucket midpoints (not the observed values). Integer
# observations get bounds at n + 0.5, so bucket (n - 0.5, n + 0.5] has midpoint n: the _sum
# is exact (batch sizes up to 8; beyond, use specserve_target_rows).
ACCEPTANCE_LENGTH_BUCKETS = [n + 0.5 for n in range(MAX_K + 2)]
BATCH_BUCKETS = [n + 0.5 for n in range(9)] + [12.5, 16.5, 24.5, 32.5, 48.5, 64.5, 96.5,
                                                128.5, 256.5, 512.5]

ROUND_PARTS = ("propose", "verify", "drafter_compute", "target_compute", "overhead")
COMPONENTS = ("drafter", "target")


class RouterMetrics:
    """The router's request / round / speculation / cache-repair metrics (one per replica)."""

    def __init__(self) -> None:
        from ray.serve.metrics import Counter, Histogram

        spec = ("spec",)
        self.num_drafts = Counter(
            "specserve_spec_decode_num_drafts",
            "Speculative rounds that verified at least one draft token.", spec)
        self.num_draft_tokens = Counter(
            "specserve_spec_decode_num_draft_tokens", "Draft tokens proposed and verified.", spec)
        self.num_accepted_tokens = Counter(
            "specserve_spec_decode_num_accepted_tokens", "Draft tokens accepted.", spec)
        self.num_accepted_per_pos = Counter(
            "specserve_spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft (0 = first).", ("spec", "position"))
        self.acceptance_length = Histogram(
            "specserve_spec_decode_acceptance_length",
            "Tokens committed per drafting round (accepted + the recovered or bonus token).",
            ACCEPTANCE_LENGTH_BUCKETS, spec)
        self.generation_tokens = Counter(
            "specserve_generation_tokens", "Tokens generated (streamed to clients).", spec)
        self.prompt_tokens = Counter("specserve_prompt_tokens", "Prompt tokens prefilled.", spec)
        self.request_success = Counter(
            "specserve_request_success",
            "Requests ended, by finish reason (stop, length; abort = failed or cancelled).",
            ("finished_reason", "spec"))
        self.ttft = Histogram("specserve_time_to_first_token_seconds", "Time to first token.",
                              LATENCY_BUCKETS, spec)
        self.itl = Histogram(
            "specserve_inter_token_latency_seconds",
            "Time between streamed chunks divided by the tokens of the chunk (one observation "
            "per round after the first).", LATENCY_BUCKETS, spec)
        self.e2e = Histogram("specserve_e2e_request_latency_seconds", "Request latency.",
                             REQUEST_BUCKETS, spec)
        self.tokens_per_s = Histogram(
            "specserve_request_generation_tokens_per_second",
            "Output tokens / request latency, per request.", TOKENS_PER_S_BUCKETS, spec)
        self.round_latency = Histogram("specserve_round_latency_seconds",
                                       "Wall time of one speculative round.", LATENCY_BUCKETS,
                                       spec)
        self.round_part = Histogram(
            "specserve_round_part_seconds",
            "Parts of a round: propose and verify as the router sees them (hop + queue + "
            "compute), the replicas' own compute, and overhead = round - drafter compute - "
            "target compute (hops, batching wait, router work).",
            LATENCY_BUCKETS, ("part", "spec"))
        comp = ("component",)
        self.cache_repairs = Counter(
            "specserve_cache_repairs",
            "Calls whose session cache had to be rebuilt or re-fed (a miss: evicted, "
            "restarted or re-leased replica).", comp)
        self.cache_misses = Counter(
            "specserve_cache_misses",
            "Calls that found no usable session cache (evicted, restarted, re-leased).", comp)
        self.cache_rolled_back = Counter(
            "specserve_cache_rolled_back_tokens",
            "Cache entries rolled back (the previous round's rejected drafts).", comp)
        self.cache_reprefilled = Counter("specserve_cache_reprefilled_tokens",
                                         "Committed tokens fed again after a cache loss.", comp)
        self.request_errors = Counter(
            "specserve_request_errors",
            "Requests that failed, by gRPC status code name (INVALID_ARGUMENT, UNAVAILABLE, "
            "...; the HTTP API counts the same codes).", ("code",))
        self.decisions = Counter(
            "specserve_spec_decisions",
            "Rounds by the policy's decision: the reason (goodput, low_acceptance, explore, climb, "
            "saturated, no_lookup_match, drafter_unavailable, budget, sampled; fixed / off for "
            "explicit modes) and the proposer chosen (draft, ngram, none).", ("reason", "proposer"))
        self.drafted_ahead = Counter(
            "specserve_drafted_ahead_rounds",
            "Drafted rounds whose drafts the drafter had prepared ahead while the round before "
            "verified (drafter.draft_ahead hits; the hit rate is this over "
            "specserve_spec_decode_num_drafts), by the outcome of that round they were "
            "prepared for (after: all_accepted, rejection).", ("spec", "after"))
        self.prior_errors = Counter(
            "specserve_spec_prior_errors",
            "Reads or writes of the fleet's acceptance priors (Redis) that failed; spec=auto "
            "went on with local estimates.", ("op",))
        self._tags: dict[tuple[str, ...], dict[str, str]] = {}

    def _t(self, **kv: str) -> dict[str, str]:
        key = tuple(kv.values())
        tags = self._tags.get(key)
        if tags is None:
            tags = self._tags[key] = dict(kv)
        return tags

    def round(self, spec: str, round_s: float, propose_s: float, verify_s: float,
              drafter_compute_s: float, target_compute_s: float, drafted: int,
              committed: int) -> None:
        self.round_latency.observe(round_s, self._t(spec=spec))
        parts = (propose_s, verify_s, drafter_compute_s, target_compute_s,
                 max(0.0, round_s - drafter_compute_s - target_compute_s))
        for part, value in zip(ROUND_PARTS, parts, strict=True):
            self.round_part.observe(value, self._t(part=part, spec=spec))
        if drafted:
            self.acceptance_length.observe(committed, self._t(spec=spec))

    def decision(self, reason: str, proposer: str | None) -> None:
        self.decisions.inc(1, self._t(reason=reason, proposer=proposer or "none"))

    def drafted_ahead_round(self, spec: str, after: str) -> None:
        self.drafted_ahead.inc(1, self._t(spec=spec, after=after))

    def prior_error(self, op: str) -> None:
        self.prior_errors.inc(1, self._t(op=op))

    def error(self, code: str) -> None:
        self.request_errors.inc(1, self._t(code=code))

    def first_token(self, spec: str, ttft_s: float) -> None:
        self.ttft.observe(ttft_s, self._t(spec=spec))

    def inter_token(self, spec: str, seconds: float) -> None:
        self.itl.observe(seconds, self._t(spec=spec))

    def request_end(self, spec: str, finish: str, stats: Any, prompt_tokens: int,
                    output_tokens: int, total_s: float) -> None:
        """``stats``: the request's AcceptanceStats. Counters are added once per request."""
        t = self._t(spec=spec)
        for counter, value in ((self.num_drafts, stats.drafts),
                               (self.num_draft_tokens, stats.draft_tokens),
                               (self.num_accepted_tokens, stats.accepted_tokens),
                               (self.generation_tokens, output_tokens),
                               (self.prompt_tokens, prompt_tokens)):
            if value > 0:
                counter.inc(value, t)
        for pos, n in enumerate(stats.accepted_per_position):
            if n > 0:
                self.num_accepted_per_pos.inc(n, self._t(spec=spec, position=str(pos)))
        self.request_success.inc(1, self._t(finished_reason=finish, spec=spec))
        self.e2e.observe(total_s, t)
        if output_tokens and total_s > 0:
            self.tokens_per_s.observe(output_tokens / total_s, t)

    def cache(self, component: str, repairs: int, misses: int, rolled_back: int,
              reprefilled: int) -> None:
        t = self._t(component=component)
        for counter, value in ((self.cache_repairs, repairs), (self.cache_misses, misses),
                               (self.cache_rolled_back, rolled_back),
                               (self.cache_reprefilled, reprefilled)):
            if value > 0:
                counter.inc(value, t)


class TargetBatchMetrics:
    """The target replica's batching metrics."""

    def __init__(self) -> None:
        from ray.serve.metrics import Counter, Histogram

        self.batch_size = Histogram(
            "specserve_target_batch_size", "Rows (requests' rounds) per target forward.",
            BATCH_BUCKETS)
        self.rows = Counter("specserve_target_rows",
                            "Rows verified (mean batch size = rate of this / rate of "
                            "specserve_target_batch_size_count).")
        self.forward = Histogram(
            "specserve_target_forward_seconds",
            "One batched target forward + exact verification.", LATENCY_BUCKETS)

    def batch(self, rows: int, seconds: float) -> None:
        self.batch_size.observe(rows)
        self.rows.inc(rows)
        self.forward.observe(seconds)
