"""Per-router round timing summary: propose / verify / orchestration overhead."""

from __future__ import annotations

import time

import numpy as np

from router.router import Router


def _pct(values: np.ndarray) -> dict[str, float]:
    values = values[np.isfinite(values)]  # NaN: not called / not stamped that round
    if not values.size:
        return {"p50_ms": 0.0, "p99_ms": 0.0, "n": 0}
    arr = values * 1000
    return {"p50_ms": round(float(np.percentile(arr, 50)), 3),
            "p99_ms": round(float(np.percentile(arr, 99)), 3), "n": int(arr.size)}


def router_stats(router: Router) -> dict:
    t = {k: np.asarray(v) for k, v in router.timing.snapshot().items()}
    local = t["round_s"] - t["propose_s"] - t["verify_s"]
    # round wall time minus drafter and target compute: hops, batching wait, router work
    orchestration = t["round_s"] - t["drafter_compute_s"] - t["target_compute_s"]
    return {
        "round": _pct(t["round_s"]), "propose": _pct(t["propose_s"]),
        "verify": _pct(t["verify_s"]), "drafter_compute": _pct(t["drafter_compute_s"]),
        "target_compute": _pct(t["target_compute_s"]),
        "orchestration_overhead": _pct(orchestration), "router_local": _pct(local),
        "round_path": round_path(t, local),
        "active": router.active, "target_reconnects": router.target_reconnects,
        "drafter_handovers": router.drafter_handovers, "targets": _target_load(router),
        "journal_degraded": router.journal.degraded,
        "journal_write_failures": router.journal.write_failures, **router.totals.to_dict(),
        "auto_cost_model": router.cost.snapshot(), "auto_prior_failures": router.priors.failures,
    }


def round_path(t: dict[str, np.ndarray], local: np.ndarray) -> dict[str, dict[str, float]]:
    """Where a round's orchestration overhead goes, per call: the hop to the replica, the
    replica's own time besides compute (its queue, the batching wait, decode / encode), the
    hop back; the router's own work in the round; and the gap between a request's rounds
    (not in the round's time, but in every token's latency). ``local``: round - calls."""
    path = {f"{c}_{h}": _pct(t[f"{c}_{h}_s"]) for c in ("drafter", "target")
            for h in ("send", "server", "return")}
    return {**path, "router_local": _pct(local), "between_rounds": _pct(t["gap_s"])}


def _target_load(router: Router, fresh_s: float = 5.0) -> dict[str, dict]:
    """Per target replica this router heard from in the last ``fresh_s``: the rows of its
    last forward and the rows queued behind it (what its replies reported)."""
    now = time.monotonic()
    return {addr: {"batch_rows": b, "queued_rows": q, "age_s": round(now - t, 3)}
            for addr, (b, q, t) in router.target_load.items() if now - t < fresh_s}


def reset_timing(router: Router) -> None:
    router.timing.clear()
