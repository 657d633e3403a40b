"""Tensor-parallel target (target_service/tp.py): TP=2 on CPU (gloo), sharded by transformers'
own tp_plan, against TP=1 and target-only greedy decoding."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import free_port
from service_client import stream_with_fault
from test_service import MAX_NEW, _clients

from specserve.api import GenerationRequest

HERE = Path(__file__).parent
ENV = {**os.environ, "PYTHONPATH": str(HERE.parent), "OMP_NUM_THREADS": "1"}
TP_APP = "specserve-tp2"
# TP=2 logits differ from TP=1 only by float32 summation order (row-parallel partial sums
# all-reduced): measured max |diff| ~5e-6 on logits of magnitude ~10
LOGITS_ATOL = 1e-4


def test_tp2_verify_logits_match_tp1(tmp_path):
    """Two real ranks (separate processes, gloo): one prefill+verify and one cached verify
    step give TP=1's logits within LOGITS_ATOL, the same outcomes, and identical engine
    state on both ranks (sessions, bytes, evictions)."""
    from tp_logits import record, verify_calls

    from specserve.engine.target import TargetEngine
    from specserve.models.load import load_model, resolve_model

    port = free_port()
    out = tmp_path / "rank"
    procs = [subprocess.Popen([sys.executable, str(HERE / "tp_logits.py"), str(r), "2",
                               str(port), str(out)], env=ENV) for r in range(2)]
    try:
        assert [p.wait(timeout=240) for p in procs] == [0, 0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    ref = TargetEngine(load_model(resolve_model("builtin-target")))
    seen = record(ref)
    ref_out = [[vars(o) for o in ref.verify(items)] for items in verify_calls()]
    ranks = [torch.load(f"{out}.{r}.pt", weights_only=False) for r in range(2)]
    for res in ranks:
        assert len(res["logits"]) == len(seen) == 2
        for got, want in zip(res["logits"], seen, strict=True):
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, atol=LOGITS_ATOL, rtol=0)
            assert torch.equal(got.argmax(-1), want.argmax(-1))
        assert res["outcomes"] == ref_out
    assert ranks[0]["stats"] == ranks[1]["stats"]  # lockstep: same sessions, bytes, decisions
    assert ranks[0]["stats"]["bytes"] < ref.stats()["bytes"]  # each rank holds half the heads


def test_bad_tp_size_is_a_clear_error(tmp_path):
    from pydantic import ValidationError

    from deployments.app import build_app
    from deployments.config import AppConfig

    with pytest.raises(ValueError, match=r"tp_size=3 does not divide the heads.*"
                                         r"num_attention_heads=4, num_key_value_heads=4"):
        build_app({"target": {"tp_size": 3}})
    with pytest.raises(ValidationError):
        AppConfig.model_validate({"target": {"tp_size": 0}})
    # the CLI: exit 2 with the message, before Ray starts (its temp dir stays empty)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    res = subprocess.run([sys.executable, "-m", "specserve.cli", "serve", "--tp", "3",
                          "--port", str(free_port())], capture_output=True, text=True,
                         timeout=120, env={**ENV, "TMPDIR": str(tmp)})
    assert res.returncode == 2, res.stderr
    assert "--tp: tp_size=3 does not divide the heads of target 'builtin-target'" in res.stderr
    assert "num_attention_heads=4" in res.stderr
    ray_dirs = [p for p in tmp.iterdir() if p.name.startswith(("specserve-ray-", "ray"))]
    assert not ray_dirs  # no Ray session was created


@pytest.fixture(scope="module")
def tp_app(service):
    from ray import serve

    from deployments.app import build_app

    serve.run(build_app({"redis_url": service.redis_url,
                         "router": {"scaling": {"num_cpus": 0.1}},
                         "drafter": {"scaling": {"num_cpus": 0.1}},
                         "target": {"tp_size": 2, "tp_heartbeat_s": 1.0, "tp_timeout_s": 20.0,
                                    "scaling": {"num_cpus": 0.25}}}),
              name=TP_APP, route_prefix=f"/{TP_APP}")
    yield TP_APP
    serve.delete(TP_APP)


def _target(app: str):
    from ray import serve

    return serve.get_deployment_handle("Target", app)


def test_tp2_service_greedy_equals_tp1_and_target_only(service, tp_app, generator, heldout):
    import ray

    prompts = heldout[:8]
    refs = [generator.generate(GenerationRequest(prompt=p, max_tokens=MAX_NEW, spec="off"))[1]
            for p in prompts]
    jobs = [{"prompt": p, "max_tokens": MAX_NEW, "spec": spec, "k": 4}
            for p, spec in zip(prompts, ["draft", "ngram", "draft", "off"] * 2, strict=True)]
    tp2 = _clients(service.grpc_address, jobs, app=tp_app)
    tp1 = _clients(service.grpc_address, jobs)
    assert [r.get("token_ids") for r in tp2] == refs, tp2
    assert [r.get("token_ids") for r in tp1] == refs
    stats = _target(tp_app).stats.remote().result()
    assert stats["tp_size"] == 2 and stats["max_batch"] > 1 and not stats["tp_broken"]
    # rank 1 is in lockstep: same sessions, same bytes, same forward count as rank 0
    (worker,) = _target(tp_app).tp_workers.remote().result()
    wstats = ray.get(worker.stats.remote(), timeout=30)
    keys = ["forward_batches", "rows_verified", "evictions", "misses", "max_batch_size_seen"]
    assert {k: wstats[k] for k in keys} == {k: stats[k] for k in keys}


def test_killing_a_rank_mid_generation_keeps_outputs(service, tp_app, generator, heldout):
    """SIGKILL rank 1's actor process mid-request: rank 0's collectives fail, the replica
    turns unhealthy, Serve replaces the whole group, the router re-leases and resends the
    tokens: every request completes with target-only greedy's tokens."""
    import ray
    from ray import serve

    n_new = 160
    prompts = heldout[8:12]
    refs = [generator.generate(GenerationRequest(prompt=p, max_tokens=n_new, spec="off"))[1]
            for p in prompts]
    target = _target(tp_app)
    pid0 = target.pid.remote().result()
    (worker,) = target.tp_workers.remote().result()
    pid1 = ray.get(worker.pid.remote(), timeout=30)
    results = stream_with_fault(service.grpc_address, [
        {"prompt": p, "max_tokens": n_new, "spec": "draft", "k": 2} for p in prompts],
        lambda: os.kill(pid1, 9), 16, app=tp_app)
    assert [r.get("token_ids") for r in results] == refs, results
    assert target.pid.remote().result() != pid0  # the group was replaced as a whole
    router = serve.get_deployment_handle("Router", tp_app).stats.remote().result()
    assert router["target_reconnects"] >= 1
    (new_worker,) = target.tp_workers.remote().result()
    assert ray.get(new_worker.pid.remote(), timeout=30) != pid1
