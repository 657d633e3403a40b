"""Autoscaling end to end (issue 12): a short load ramp through the SDK on a Ray cluster
whose real autoscaler adds and removes (fake) nodes, ``bench/ramp.py`` run as a
subprocess in its own PID and network namespaces (its whole cluster ends with it; the
suite's shared cluster is never touched).

Asserts on what Serve and Ray reported, never on timing: both pools went above one RUNNING
replica and back to one, their nodes appeared and went away, and every request succeeded
with the spec-off greedy output. The ramp itself waits on those events (generous bounds).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
POOLS = {"Drafter": "drafter_node", "Target": "target_node"}


@pytest.mark.slow
@pytest.mark.service
def test_pools_and_nodes_follow_a_load_ramp(tmp_path):
    out = tmp_path / "ramp"
    cmd = [sys.executable, str(ROOT / "bench" / "ramp.py"), "--out", str(out),
           "--peak", "8", "--per-replica", "4", "--max-replicas", "2", "--minutes", "0.5",
           "--wait-max-s", "150", "--prompts", "8", "--max-tokens", "24",
           "--downscale-delay-s", "5", "--idle-s", "5"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert (out / "summary.json").exists(), proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    timeline = json.loads((out / "timeline.json").read_text())
    first, last = timeline["samples"][0], timeline["samples"][-1]

    assert summary["failed"] == 0 and summary["mismatches"] == 0, summary
    assert summary["requests"] > 0 and proc.returncode == 0
    for pool, node_type in POOLS.items():
        replicas, nodes = summary["pools"][pool], summary["nodes"][node_type]
        assert replicas["initial"] == 1 and replicas["peak"] >= 2, (pool, replicas)
        assert nodes["initial"] == 1 and nodes["peak"] >= 2, (node_type, nodes)
        assert first["replicas"][pool] == 1 and last["replicas"][pool] == 1, pool
        assert first["nodes"][node_type] == 1 and last["nodes"][node_type] == 1, node_type
        assert replicas["down_at_s"] is not None and nodes["down_at_s"] is not None
    # queue depths sampled through the ramp (the router's view of the target replicas)
    assert all("queues" in s for s in timeline["samples"])
    assert max(s["queues"]["target_batch_rows"] for s in timeline["samples"]) >= 2
    phases = {p["name"]: p for p in timeline["phases"]}
    assert phases["peak"]["event_met"] and phases["drop"]["event_met"], phases
    assert (out / "ramp.png").stat().st_size > 0
