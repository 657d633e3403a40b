"""The distributed service on one local Ray cluster: real Serve, real sockets, real Redis.

Clients run in a separate process (tests/service_client.py) through the SDK.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from service_client import stream_with_fault

from specserve.api import GenerationRequest

HERE = Path(__file__).parent
MAX_NEW = 24


# the session-scoped `service` fixture (a local Ray cluster + app) is in conftest.py


def _clients(address: str, jobs: list[dict], app: str = "specserve") -> list[dict]:
    out = subprocess.run(
        [sys.executable, str(HERE / "service_client.py"), address, app, json.dumps(jobs)],
        capture_output=True, text=True, timeout=600, check=True,
        env={**os.environ, "PYTHONPATH": str(HERE.parent)},
    )
    return [json.loads(line) for line in out.stdout.splitlines()]


@pytest.fixture(scope="module")
def greedy_refs(generator, heldout):
    prompts = heldout[:16]
    refs = []
    for p in prompts:
        _, ids, _ = generator.generate(GenerationRequest(prompt=p, max_tokens=MAX_NEW,
                                                         spec="off"))
        refs.append(ids)
    return prompts, refs


def _target_stats(app: str = "specserve") -> dict:
    from ray import serve

    return serve.get_deployment_handle("Target", app).stats.remote().result()


@pytest.mark.parametrize(("spec", "k"), [("draft", 4), ("draft", 2), ("ngram", 3),
                                         ("off", 0)])
def test_greedy_through_service_equals_target_only(service, greedy_refs, spec, k):
    prompts, refs = greedy_refs
    jobs = [{"prompt": p, "max_tokens": MAX_NEW, "spec": spec, "k": k} for p in prompts]
    results = _clients(service.grpc_address, jobs)
    assert len(results) == 16
    for res, ref in zip(results, refs, strict=True):
        assert "error" not in res, res
        assert res["token_ids"] == ref
        assert res["stats"]["spec"] == spec
        assert res["stats"]["output_tokens"] == len(ref)
    if spec == "draft":
        assert sum(r["stats"]["accepted_tokens"] for r in results) > 0


def test_auto_is_the_default_and_exact_under_concurrency(service, greedy_refs):
    """spec=auto (no spec given): 16 concurrent greedy requests equal spec-off, and each
    request's stats explain its plans."""
    prompts, refs = greedy_refs
    results = _clients(service.grpc_address,
                       [{"prompt": p, "max_tokens": MAX_NEW} for p in prompts])
    assert [r["token_ids"] for r in results] == refs
    for st in (r["stats"] for r in results):
        assert st["spec"] == "auto"
        assert sum(st["k_histogram"].values()) == st["rounds"]
        assert sum(st["proposer_mix"].values()) == st["rounds"]
        assert set(st["decision_reasons"]) <= {"goodput", "low_acceptance", "explore", "saturated",
                                               "no_lookup_match", "budget", "climb"}
    # the router's cost model started from the replicas' start-up profiles (3 x 3 verify
    # grid, the drafter at 1 and 8 rows)
    model = service.router_stats()["auto_cost_model"]
    assert model["profiled"] == 9 + 2 and model["draft_step_ms_a_row"] is not None, model
    assert isinstance(model["measured_round_ms"], dict)  # plans' own times at small batches
    assert model["arriving"] == 0  # every request's first round was told (a burst's end)


def test_target_batches_concurrent_rounds(service, greedy_refs):
    before = _target_stats()
    prompts, refs = greedy_refs
    results = _clients(service.grpc_address, [
        {"prompt": p, "max_tokens": MAX_NEW, "spec": "draft", "k": 4} for p in prompts])
    after = _target_stats()
    assert [r["token_ids"] for r in results] == refs
    assert after["max_batch"] > 1
    assert after["rows"] - before["rows"] > after["batches"] - before["batches"]


def test_long_prompts_are_prefilled_in_chunks_and_outputs_are_unchanged(service, generator,
                                                                        heldout):
    """Prompts longer than target.prefill_chunk (64) arrive while short requests decode
    (sent once every short stream has its first tokens): they are fed a chunk a step
    beside them (the Target counts the chunks) and every output is spec-off's."""
    from service_client import run

    long = ["\n".join(heldout[i: i + 6]) for i in range(0, 18, 6)]
    assert all(len(generator.pair.tokenizer(p).input_ids) > 3 * 64 for p in long)
    short = heldout[:6]

    def ref(p: str, n: int) -> list[int]:
        return generator.generate(GenerationRequest(prompt=p, max_tokens=n, spec="off"))[1]

    refs_short, refs_long = [ref(p, 200) for p in short], [ref(p, MAX_NEW) for p in long]
    before = _target_stats()
    late: list[dict] = []
    decoding = stream_with_fault(
        service.grpc_address, [{"prompt": p, "max_tokens": 200, "spec": "off"} for p in short],
        lambda: late.extend(run(service.grpc_address, [
            {"prompt": p, "max_tokens": MAX_NEW, "spec": spec, "k": 3}
            for p, spec in zip(long, ["draft", "ngram", "off"], strict=True)], "specserve")),
        after_tokens=4)
    assert [r["token_ids"] for r in late] == refs_long
    assert [r["token_ids"] for r in decoding] == refs_short
    assert _target_stats()["prefill_chunks"] - before["prefill_chunks"] >= 3


def test_seeded_sampling_is_reproducible(service):
    job = {"prompt": "def read_config(path):\n", "max_tokens": 32, "temperature": 0.9,
           "top_p": 0.95, "seed": 1234, "spec": "draft", "k": 4}
    a, b, c = _clients(service.grpc_address, [job, job, {**job, "seed": 99}])
    assert a["token_ids"] == b["token_ids"]
    assert a["token_ids"] != c["token_ids"]
    assert a["stats"]["seed"] == 1234


def test_stream_and_stats_and_health(service):
    from specserve.client import Client, health_check

    assert health_check(service.grpc_address)
    with Client(service.grpc_address, timeout=120) as client:
        chunks = list(client.stream("class Stack:\n", max_tokens=20, k=4))
    assert len(chunks) > 1
    assert chunks[-1].finish_reason == "length" and chunks[-1].stats
    stats = chunks[-1].stats
    assert stats["output_tokens"] == sum(len(c.token_ids) for c in chunks) == 20
    assert stats["target_revision"] and stats["drafter_revision"]


@pytest.mark.parametrize(
    ("job", "code", "needle"),
    [
        ({"prompt": "", "max_tokens": 4}, "INVALID_ARGUMENT", "prompt"),
        ({"prompt": "x", "top_p": 1.5}, "INVALID_ARGUMENT", "top_p"),
        ({"prompt": "x", "temperature": -1.0}, "INVALID_ARGUMENT", "temperature"),
        ({"prompt": "x", "k": 17}, "INVALID_ARGUMENT", "k"),
        ({"prompt": "x " * 600, "max_tokens": 600}, "OUT_OF_RANGE", "max_tokens"),
        ({"prompt_ids": [10**6], "max_tokens": 4}, "INVALID_ARGUMENT", "prompt_ids"),
    ],
)
def test_bad_requests_get_status_codes(service, job, code, needle):
    (res,) = _clients(service.grpc_address, [job])
    assert res.get("error") == code, res
    assert needle in res["details"]


def test_journal_resumes_a_retried_request(service, greedy_refs):
    """A retry with the same request id continues from the journal: nothing regenerated,
    nothing lost or duplicated."""
    prompts, refs = greedy_refs
    job = {"prompt": prompts[0], "max_tokens": MAX_NEW, "k": 4, "request_id": "retry-me-1"}
    (first,) = _clients(service.grpc_address, [job])
    (again,) = _clients(service.grpc_address, [job])
    assert first["token_ids"] == again["token_ids"] == refs[0]
    assert again["stats"]["rounds"] == 0  # answered from the journal


def test_replica_restart_mid_request(service, generator, heldout):
    """Kill the target replica's process while requests run: Serve restarts it, the router
    reconnects, the new replica rebuilds caches from tokens, outputs are unchanged."""
    from ray import serve

    n_new = 160  # long enough that the kill lands mid-request
    prompts = heldout[:4]
    refs = [generator.generate(GenerationRequest(prompt=p, max_tokens=n_new, spec="off"))[1]
            for p in prompts]
    target = serve.get_deployment_handle("Target", "specserve")
    pid = target.pid.remote().result()
    before = serve.get_deployment_handle("Router", "specserve").stats.remote().result()
    assert before["target_reconnects"] == 0
    jobs = [{"prompt": p, "max_tokens": n_new, "spec": "draft", "k": 2} for p in prompts]
    # the kill fires once every request has received 16 tokens
    results = stream_with_fault(service.grpc_address, jobs, lambda: os.kill(pid, 9), 16)
    assert [r.get("token_ids") for r in results] == refs, results
    assert target.pid.remote().result() != pid
    router = serve.get_deployment_handle("Router", "specserve").stats.remote().result()
    assert router["target_reconnects"] >= len(jobs)  # every request moved mid-way
    assert _target_stats()["rows_verified"] > 0  # ... and continued on the new replica


# ------------------------------------------------------------ a second app: small limits
TINY = "specserve-tiny"


@pytest.fixture(scope="module")
def tiny_app(service):
    from ray import serve

    from deployments.app import build_app

    serve.run(build_app({"target": {"cache_bytes": 1 << 16},
                         "drafter": {"cache_bytes": 1 << 16},
                         "router": {"max_concurrent": 8}, "redis_url": service.redis_url}),
              name=TINY, route_prefix=f"/{TINY}")
    yield TINY
    serve.delete(TINY)


def test_forced_evictions_keep_outputs(service, tiny_app, greedy_refs):
    """A 64 KiB KV budget (less than one session) forces evictions and cache misses every
    round; the router resends tokens and outputs are unchanged."""
    from ray import serve

    prompts, refs = greedy_refs
    jobs = [{"prompt": p, "max_tokens": MAX_NEW, "spec": spec, "k": 3}
            for p, spec in zip(prompts[:8], ["draft", "ngram"] * 4, strict=True)]
    results = _clients(service.grpc_address, jobs, app=tiny_app)
    assert [r.get("token_ids") for r in results] == refs[:8], results
    stats = serve.get_deployment_handle("Target", tiny_app).stats.remote().result()
    assert stats["evictions"] > 0 and stats["misses"] > 0


def test_overload_is_resource_exhausted(service, tiny_app, generator, heldout):
    prompts = heldout[:16]
    jobs = [{"prompt": p, "max_tokens": 64, "spec": "draft", "k": 2} for p in prompts]
    results = _clients(service.grpc_address, jobs, app=tiny_app)
    codes = [r.get("error") for r in results]
    assert "RESOURCE_EXHAUSTED" in codes
    assert set(codes) <= {None, "RESOURCE_EXHAUSTED"}
    for prompt, res in zip(prompts, results, strict=True):
        if "error" not in res:  # the admitted ones are exact
            ref = generator.generate(GenerationRequest(prompt=prompt, max_tokens=64,
                                                       spec="off"))[1]
            assert res["token_ids"] == ref


def test_drafter_failure_turns_speculation_off(service, tiny_app, generator, heldout):
    from ray import serve

    n_new = 160
    prompts = heldout[4:8]
    refs = [generator.generate(GenerationRequest(prompt=p, max_tokens=n_new, spec="off"))[1]
            for p in prompts]
    drafter = serve.get_deployment_handle("Drafter", tiny_app)
    pid = drafter.pid.remote().result()
    results = stream_with_fault(service.grpc_address, [
        {"prompt": p, "max_tokens": n_new, "spec": "draft", "k": 3} for p in prompts],
        lambda: os.kill(pid, 9), 16, app=tiny_app)
    assert [r.get("token_ids") for r in results] == refs, results
    # the request streaming at the kill finds no drafter within the lease wait: speculation
    # off, with the reason. This app's target holds one session (a 64 KiB budget), so the
    # others wait for it there and may lease (or be handed over to) the drafter Serve starts
    # in place of the killed one: they keep drafting, with exact outputs all the same
    off = [r for r in results if r["stats"]["spec"] == "off"]
    assert off, results
    assert all(r["stats"]["speculation_disabled_reason"].startswith("drafter") for r in off)
    kept = [r for r in results if r["stats"]["spec"] != "off"]
    assert all(not r["stats"]["speculation_disabled_reason"] for r in kept)


def test_cli_generate_through_server(service, greedy_refs, builtin_pair):
    prompts, refs = greedy_refs
    out = subprocess.run(
        [sys.executable, "-m", "specserve.cli", "generate", prompts[1], "--server",
         service.grpc_address, "--max-tokens", str(MAX_NEW), "--k", "3"],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(HERE.parent)},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == builtin_pair.tokenizer.decode(refs[1], skip_special_tokens=True) + "\n"
    assert "[specserve]" in out.stderr
    assert "spec=auto" in out.stderr and f"{MAX_NEW} tokens" in out.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "specserve.cli", "generate", "x", "--server",
         service.grpc_address, "--top-p", "2"],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(HERE.parent)},
    )
    assert bad.returncode == 2 and "top_p" in bad.stderr


def test_bench_suite_tiny_end_to_end(service, tmp_path):
    """A seconds-long suite run through the real service produces every artifact."""
    from specserve.bench.analysis import validate_report
    from specserve.bench.suite import run_suite
    from specserve.bench.workloads import Prompt

    classes = {"code": [Prompt("def add(a, b):\n", 6, "code"), Prompt("class A:\n", 6, "code")],
               "prose": [Prompt("The module provides", 6, "prose")]}
    report = run_suite(service.grpc_address, "builtin-target", "builtin-drafter", [1, 2], [2],
                       tmp_path, classes=classes, requests_per_level=2, baseline_prompts=1,
                       repeats=2)
    assert validate_report(report) == []
    level = report["classes"]["code"]["levels"]["2"]
    assert all(len(row["aggregate_tokens_per_s_runs"]) == 2 for row in level.values())
    lines = (tmp_path / "outputs.jsonl").read_text().splitlines()
    assert {json.loads(x)["repeat"] for x in lines} == {0, 1}
    assert report["mismatches"]["total"] == 0
    assert set(report["classes"]) == {"code", "prose", "mixed"}
    assert set(report["verdicts"]) == {"code", "prose", "mixed"}
    for name in ("report.json", "outputs.jsonl", "summary.md", "speedup_vs_concurrency.png",
                 "acceptance_per_position.png", "latency_cdf.png", "tokens_per_s_vs_k.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert "hf_assisted" in report["classes"]["code"]["baselines"]
    assert "## code:" in (tmp_path / "summary.md").read_text()
