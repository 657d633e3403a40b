"""Autoscaling by traffic: each pool's signal and policy (unit), and the pools scaling up
and down under load on the real service, independently, with a replica removed while it
holds live sessions (service, slow).

The service test drives load through the SDK and waits on what Serve reports (RUNNING
replicas per deployment), never on timers; every output is compared with spec-off.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from deployments.autoscaling import BUSY, DRAFTING, SESSIONS, PoolPolicy, pool_size
from deployments.config import AppConfig, Scaling
from specserve.service.load import BusyMeter, RecentSessions


def test_pool_size_takes_whichever_signal_asks_for_more():
    assert pool_size(0, 8, 0.0, 0.8) == 0
    assert pool_size(16, 8, 0.1, 0.8) == 2  # exactly at target: no extra replica
    assert pool_size(17, 8, 0.1, 0.8) == 3
    assert pool_size(3, 8, 1.5, 0.8) == 2  # few sessions, but the engines never rest
    with pytest.raises(ValueError):
        pool_size(1, 0, 0, 0.8)


def _ctx(metrics, target=1, per_replica=4.0):
    return SimpleNamespace(aggregated_metrics=metrics, target_num_replicas=target,
                           config=SimpleNamespace(target_ongoing_requests=per_replica))


def test_pool_policy_sums_replicas_and_keeps_the_target_until_they_report():
    target = PoolPolicy(SESSIONS, target_busy=0.8)
    want, state = target(_ctx({SESSIONS: {"a": 6.0, "b": 5.0}, BUSY: {"a": 0.5, "b": 0.4}}))
    assert want == 3 and state["demand"] == 11.0
    assert target(_ctx({}, target=2))[0] == 2  # nothing reported: no change
    drafter = PoolPolicy(DRAFTING)
    # leased but not drafting (speculation turned down): the drafter pool may shrink to 0
    assert drafter(_ctx({DRAFTING: {"a": 0.0}, BUSY: {"a": 0.0}, SESSIONS: {"a": 9.0}}))[0] == 0
    with pytest.raises(ValueError):
        PoolPolicy("requests")


def test_meters():
    now = [0.0]
    spent = [0.0]
    busy = BusyMeter(lambda: spent[0], clock=lambda: now[0])
    now[0], spent[0] = 2.0, 1.5
    assert busy.read() == pytest.approx(0.75)
    now[0] = 3.0
    assert busy.read() == 0.0
    recent = RecentSessions(5.0, clock=lambda: now[0])
    recent.mark("a")
    now[0] = 6.0
    recent.mark("b")
    assert recent.count() == 2
    now[0] = 8.5
    assert recent.count() == 1
    recent.forget("b")  # released: no longer open
    assert recent.count() == 0


def test_scaling_becomes_serve_options_serve_accepts():
    from ray.serve.config import AutoscalingConfig

    from deployments.app import DrafterDeployment

    s = Scaling(min_replicas=0, max_replicas=3, drain_s=7, upscale_delay_s=1)
    opts = s.deployment_options(signal=DRAFTING)
    assert opts["graceful_shutdown_timeout_s"] == 7
    auto = AutoscalingConfig(**opts["autoscaling_config"])
    assert auto.policy.policy_function == "deployments.autoscaling:PoolPolicy"
    assert auto.policy.policy_kwargs == {"signal": DRAFTING, "target_busy": 0.8}
    DrafterDeployment.options(**opts)  # Serve validates every option
    fixed = Scaling(min_replicas=2, max_replicas=2).deployment_options(signal=SESSIONS)
    assert fixed["num_replicas"] == 2 and "autoscaling_config" not in fixed
    with pytest.raises(ValueError):
        AppConfig.model_validate({"target": {"scaling": {"target_busy": 1.5}}})


SCALE = "specserve-scale"
PROMPTS, TOKENS = 6, 40
# fast loop for a test: the signals are averaged over 2 s, decisions need 1 s / 2 s
FAST = {"upscale_delay_s": 1.0, "downscale_delay_s": 2.0, "look_back_period_s": 2.0,
        "metrics_interval_s": 0.5, "num_cpus": 0.1, "min_replicas": 1, "max_replicas": 2,
        "target_ongoing_requests": 3, "target_busy": 1.0, "drain_s": 0.0}


@pytest.fixture(scope="module")
def scale_app(service):
    from ray import serve

    from deployments.app import build_app

    serve.run(build_app({"redis_url": service.redis_url,
                         "router": {"scaling": {"num_cpus": 0.1}},
                         "drafter": {"scaling": {**FAST, "min_replicas": 0},
                                     "session_idle_s": 5.0},
                         "target": {"scaling": FAST, "session_idle_s": 5.0}}),
              name=SCALE, route_prefix=f"/{SCALE}")
    yield
    serve.delete(SCALE)


def _running() -> dict[str, int]:
    from ray import serve

    app = serve.status().applications[SCALE]
    return {name: d.replica_states.get("RUNNING", 0) for name, d in app.deployments.items()
            if name in ("Drafter", "Target")}


class Load:
    """``n`` closed-loop SDK callers until ``stop()``; every result is kept."""

    def __init__(self, address: str, prompts: list[str], n: int, spec: str):
        from specserve.client import Client

        self.client = Client(address, app_name=SCALE, timeout=300, retries=8, backoff=0.25)
        self.prompts, self.spec = prompts, spec
        self.results: list[tuple[int, dict]] = []
        self._stop = threading.Event()
        self.threads = [threading.Thread(target=self._loop, args=(i,)) for i in range(n)]
        for t in self.threads:
            t.start()

    def _loop(self, i: int) -> None:
        from specserve.client import SpecServeError

        j = i
        while not self._stop.is_set():
            p = j % len(self.prompts)
            j += 1
            try:
                r = self.client.generate(prompt=self.prompts[p], max_tokens=TOKENS,
                                         spec=self.spec, k=4)
                self.results.append((p, {"token_ids": r.token_ids}))
            except SpecServeError as e:
                self.results.append((p, {"error": f"{e.code.name}: {e.details}"}))

    def stop(self) -> list[tuple[int, dict]]:
        self._stop.set()
        for t in self.threads:
            t.join(timeout=300)
        self.client.close()
        return self.results


def _until(cond, what: str, timeout: float = 180.0, seen: list | None = None) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        counts = _running()
        if seen is not None:
            seen.append(counts)
        if cond(counts):
            return
        time.sleep(0.25)
    raise AssertionError(f"{what}: replicas {_running()} after {timeout:.0f} s")


def _router_hears_from(n: int, timeout: float = 60.0) -> None:
    """Wait until the router's stats list ``n`` target replicas with fresh replies (their
    batch rows and queued rows)."""
    from ray import serve

    router = serve.get_deployment_handle("Router", SCALE)
    t0, targets = time.monotonic(), {}
    while time.monotonic() - t0 < timeout:
        targets = router.stats.remote().result()["targets"]
        if len(targets) >= n:
            assert all(t["batch_rows"] >= 1 and t["queued_rows"] >= 0
                       for t in targets.values()), targets
            return
        time.sleep(0.25)
    raise AssertionError(f"the router heard from {len(targets)} target replicas: {targets}")


def _handovers(service) -> int:
    from ray import serve

    s = serve.get_deployment_handle("Router", SCALE).stats.remote().result()
    return s["target_reconnects"] + s["drafter_handovers"]


def _cycle(service, prompts: list[str]) -> tuple[list, int]:
    """Drafting load until both pools are at 2, then a light load (3 sessions: 1 replica
    each) until both are back at 1: the newest replicas go while they hold live sessions
    (drain_s 0) and their routers hand the sessions over."""
    load = Load(service.grpc_address, prompts, 8, "draft")
    _until(lambda c: c == {"Drafter": 2, "Target": 2}, "both up on drafting load")
    _router_hears_from(2)  # the new target replica takes sessions (its queue is reported)
    light = Load(service.grpc_address, prompts, 3, "draft")
    results = load.stop()
    before = _handovers(service)
    _until(lambda c: c == {"Drafter": 1, "Target": 1}, "both down under light load")
    results += light.stop()
    return results, _handovers(service) - before


@pytest.mark.slow
def test_pools_scale_up_and_down_independently_losing_nothing(service, scale_app, generator,
                                                              heldout):
    from specserve.api import GenerationRequest

    prompts = heldout[:PROMPTS]
    refs = [generator.generate(GenerationRequest(prompt=p, max_tokens=TOKENS, spec="off"))[1]
            for p in prompts]
    _until(lambda c: c == {"Drafter": 0, "Target": 1}, "start (drafter pool at its floor, 0)")
    seen: list[dict] = []
    # spec-off traffic is verify demand only: the target pool grows, no drafter starts
    load = Load(service.grpc_address, prompts, 8, "off")
    _until(lambda c: c["Target"] == 2, "target up on spec-off load", seen=seen)
    results = load.stop()
    assert max(c["Drafter"] for c in seen) == 0, seen
    # drafting traffic: the first requests find no drafter and run without speculation
    # (their lease starts one); then both pools grow, and shrink again under light load
    handed_over = 0
    for _ in range(3):  # where a replica went, it held live sessions (3 tries for that)
        more, handed_over = _cycle(service, prompts)
        results += more
        if handed_over:
            break
    # no drafting at all: the drafter pool goes back to 0
    _until(lambda c: c == {"Drafter": 0, "Target": 1}, "drafter pool back to 0 when idle")
    errors = [r["error"] for _, r in results if "error" in r]
    wrong = sum(r.get("token_ids") != refs[p] for p, r in results if "error" not in r)
    print(f"\nautoscaling: {len(results)} requests, {len(errors)} failed, {wrong} differ from "
          f"spec-off; sessions handed over at the last scale-down: {handed_over}")
    assert not errors, errors[:3]
    assert wrong == 0
    assert handed_over > 0  # a removed replica held live sessions, and nothing was lost
