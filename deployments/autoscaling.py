"""What each pool scales on: Ray Serve custom autoscaling policies for Drafter and Target.

Serve's own signal counts a replica's ongoing requests. For the Router that is the right
one (requests in flight), so it keeps Serve's default policy. For the two model pools it is
not enough:

- **Target** (large GPUs; its batched forward is the expensive resource): *open sessions*
  (each a row of the batch, ``target_ongoing_requests`` per replica) and *busy*, the
  fraction of wall time the replica's engine computes (``target_busy`` per replica). A
  replica whose batch is full and whose forward never rests needs help even when the
  session count is under target (long prompts, big k).
- **Drafter** (cheap GPUs): *drafting sessions*, the open sessions that got a draft-model
  proposal in the last few seconds, not the ones merely leased. When the goodput
  controller turns speculation down under load (k = 0, or prompt lookup, which costs the
  drafter nothing), drafting demand falls and the pool shrinks, to ``min_replicas`` (0 is
  allowed: the router then serves without a drafter until one is back), and *busy* as for
  the target.

Each replica reports its numbers through Serve's ``record_autoscaling_stats`` hook
(``deployments/app.py``); Serve averages them over ``look_back_period_s`` and calls the
policy below with the per-replica values. The policy returns the replicas wanted; Serve
applies ``min_replicas``/``max_replicas``, ``upscale_delay_s`` and ``downscale_delay_s``.

This module is cloudpickled into Serve's controller: it imports nothing but the standard
library at module level.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

SESSIONS = "sessions"  # target: sessions held (leased, cache or not)
DRAFTING = "drafting"  # drafter: sessions drafted for in the last 5 s (service/load.py)
BUSY = "busy"  # both: fraction of wall time in engine compute since the last report


def pool_size(demand: float, per_replica: float, busy: float, target_busy: float) -> int:
    """Replicas for ``demand`` units at ``per_replica`` each, and for ``busy`` replica-
    seconds of compute per second at ``target_busy`` each: whichever needs more. 0 when
    there is neither (Serve's ``min_replicas`` is the floor)."""
    if per_replica <= 0 or target_busy <= 0:
        raise ValueError("per_replica and target_busy must be > 0")
    # a hair of tolerance: 16 sessions at 8 per replica is 2 replicas, not 3
    by_demand = math.ceil(max(0.0, demand) / per_replica - 1e-9)
    by_busy = math.ceil(max(0.0, busy) / target_busy - 1e-9)
    return max(by_demand, by_busy, 0)


def _total(metrics: Mapping[str, Mapping[Any, float]] | None, name: str) -> float | None:
    values = (metrics or {}).get(name)
    if not values:
        return None
    return float(sum(values.values()))


class PoolPolicy:
    """The Serve policy of one model pool: ``signal`` (``sessions`` or ``drafting``) per
    replica at the deployment's ``target_ongoing_requests``, and ``busy`` at
    ``target_busy``. Until a replica has reported, the current target stands."""

    def __init__(self, signal: str = SESSIONS, target_busy: float = 0.8):
        if signal not in (SESSIONS, DRAFTING):
            raise ValueError(f"signal: {signal!r} (sessions or drafting)")
        self.signal, self.target_busy = signal, target_busy

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        metrics = ctx.aggregated_metrics
        demand, busy = _total(metrics, self.signal), _total(metrics, BUSY)
        if demand is None and busy is None:
            # no report yet (replicas starting) or none running: keep the target; a
            # request queued for a pool at 0 starts one through Serve's cold-start path
            return ctx.target_num_replicas, {}
        per_replica = float(ctx.config.target_ongoing_requests or 1.0)
        want = pool_size(demand or 0.0, per_replica, busy or 0.0, self.target_busy)
        return want, {"demand": demand or 0.0, "busy": busy or 0.0, "want": want}
