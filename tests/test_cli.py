"""The specserve CLI in a subprocess: stdout carries only text, bad input exits 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specserve.cli", *args], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_generate_streams_text_only_to_stdout():
    out = _cli("generate", "def add(a, b):", "--max-tokens", "12", "--spec", "draft", "--k", "3")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() and "[specserve]" not in out.stdout
    summary = out.stderr.strip().splitlines()[-1]
    assert summary.startswith("[specserve] 12 tokens") and "tokens/round" in summary
    assert "acceptance" in summary and "tok/s" in summary


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["generate", "x", "--top-p", "0"], "top_p"),
        (["generate", "x", "--temperature", "-1"], "temperature"),
        (["generate", "x", "--k", "99"], "k:"),
        (["generate", "", "--max-tokens", "3"], "prompt"),
        (["generate", "x", "--spec", "nope"], "invalid choice"),
        (["generate", "x", "--max-tokens", "5000"], "max_tokens"),
        (["generate", "x", "--drafter", "/nonexistent"], "no config.json"),
        (["serve", "--port", "70000"], "--port"),
        (["bench", "--ks", "a,b"], "--ks"),
        (["bench", "--suite", "--classes", "code-short,nope"], "--classes: unknown ['nope']"),
        (["bench", "--suite", "--concurrency", "coarse"], "--concurrency"),
        (["bench", "--draft-ahead"], "--draft-ahead: only with --service or --suite"),
        (["bench", "--suite", "--draft-ahead", "--server", "127.0.0.1:1"],
         "a running one, --server"),
        (["bench", "--round-log", "/tmp/r.jsonl"], "--round-log: only with --service or --suite"),
        (["bench", "--suite", "--round-log", "/nonexistent-dir/r.jsonl"],
         "--round-log: no directory '/nonexistent-dir'"),
        (["serve", "--tls-cert", "/nonexistent.pem"], "tls_cert and tls_key"),
        (["serve", "--tls-cert", "/nonexistent.pem", "--tls-key", "/x.pem"], "--tls-cert"),
        (["serve", "--api-keys-file", "/nonexistent-keys"], "--api-keys-file"),
        (["serve", "--require-api-key"], "--require-api-key"),
    ],
)
def test_bad_input_exits_2_with_a_reason(args, needle):
    out = _cli(*args)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert needle in out.stderr
    assert out.stdout == ""


def test_a_config_whose_kv_wait_outlasts_the_call_timeout_is_refused(tmp_path):
    cfg = tmp_path / "app.json"
    cfg.write_text('{"target": {"admit_wait_s": 40}}')
    out = _cli("serve", "--config", str(cfg))
    assert out.returncode == 2 and out.stdout == ""
    assert "target.admit_wait_s (40.0) must be below router.call_timeout_s" in out.stderr


@pytest.mark.service
@pytest.mark.slow
def test_demo_stdout_is_only_the_generated_text(generator):
    """`specserve demo ... > out.txt` leaves exactly the generated text in out.txt: Ray's
    own lines (its log forwarding, shutdown messages) go to stderr."""
    from specserve.api import GenerationRequest

    prompt = "def fibonacci(n):"
    text, _, _ = generator.generate(GenerationRequest(prompt=prompt, max_tokens=24, k=4))
    out = subprocess.run(
        ["scripts/isolated", sys.executable, "-m", "specserve.cli", "demo", prompt,
         "--max-tokens", "24"], capture_output=True, text=True, timeout=600, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout == text + "\n", (out.stdout, out.stderr[-2000:])
    assert "[specserve] 24 tokens" in out.stderr
