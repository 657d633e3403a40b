"""Per-router round timing summary: propose / verify / orchestration overhead."""

from __future__ import annotations

import numpy as np

from router.core import RouterCore


def _pct(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50_ms": 0.0, "p99_ms": 0.0, "n": 0}
    arr = np.asarray(values) * 1000
    return {"p50_ms": round(float(np.percentile(arr, 50)), 3),
            "p99_ms": round(float(np.percentile(arr, 99)), 3), "n": int(arr.size)}


def router_stats(core: RouterCore) -> dict:
    t = core.timing
    rounds = np.asarray(t.round_s)
    local = rounds - np.asarray(t.propose_s) - np.asarray(t.verify_s)
    orchestration = rounds - np.asarray(t.drafter_compute_s) - np.asarray(t.target_compute_s)
    return {
        "round": _pct(list(t.round_s)), "propose": _pct(list(t.propose_s)),
        "verify": _pct(list(t.verify_s)),
        "drafter_compute": _pct(list(t.drafter_compute_s)),
        "target_compute": _pct(list(t.target_compute_s)),
        # round wall time minus drafter and target compute: hops, batching wait, router work
        "orchestration_overhead": _pct(orchestration.tolist()),
        "router_local": _pct(local.tolist()), "active": core.active,
        "target_reconnects": core.target_reconnects,
        "journal_degraded": core.journal.degraded, **core.totals.to_dict(),
    }


def reset_timing(core: RouterCore) -> None:
    for name in ("round_s", "propose_s", "verify_s", "drafter_compute_s", "target_compute_s"):
        getattr(core.timing, name).clear()
