"""The model builder, loading through Auto* classes, and pair validation."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from specserve.models.load import IncompatiblePairError, load_pair
from specserve.models.revision import model_revision


def test_tiny_build_is_a_real_hf_pair(tiny_pair_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    manifest = json.loads((tiny_pair_dir / "manifest.json").read_text())
    for name in ("target", "drafter"):
        model = AutoModelForCausalLM.from_pretrained(tiny_pair_dir / name)
        tok = AutoTokenizer.from_pretrained(tiny_pair_dir / name)
        ids = tok("def main():\n    pass\n", return_tensors="pt")["input_ids"]
        assert model(ids).logits.shape[-1] == len(tok)
        assert manifest[name]["parameters"] == sum(p.numel() for p in model.parameters())
        assert manifest[name]["revision"] == model_revision(tiny_pair_dir / name)
        assert tok.decode(ids[0]) == "def main():\n    pass\n"  # byte-level BPE round-trips
    assert manifest["corpus"]["hash"] and manifest["corpus"]["heldout_files"] > 0
    assert manifest["target"]["parameters"] > manifest["drafter"]["parameters"]


def test_build_is_deterministic(tiny_pair_dir, tmp_path):
    from specserve.models.build import PRESETS, build_pair

    again = build_pair(tmp_path, PRESETS["tiny"], "tiny")
    first = json.loads((tiny_pair_dir / "manifest.json").read_text())
    assert again["target"]["revision"] == first["target"]["revision"]
    assert again["drafter"]["revision"] == first["drafter"]["revision"]


def test_mismatched_tokenizers_are_refused(tiny_pair_dir):
    with pytest.raises(IncompatiblePairError) as e:
        load_pair("builtin-target", str(tiny_pair_dir / "drafter"))
    msg = str(e.value)
    assert "builtin-target" in msg and str(tiny_pair_dir / "drafter") in msg
    assert "different tokenizers" in msg


def test_builtin_manifest_matches_files():
    from specserve.models.load import BUILTIN

    manifest = json.loads((BUILTIN / "manifest.json").read_text())
    for name in ("target", "drafter"):
        assert manifest[name]["revision"] == model_revision(BUILTIN / name)
    assert manifest["drafter"]["greedy_agreement"] > 0.5


def test_cost_scaled_target_preserves_logits(builtin_pair):
    from specserve.models.widen import widen_llama

    wide = widen_llama(builtin_pair.target, layers=5, intermediate=1024)
    ids = torch.randint(0, builtin_pair.vocab_size, (1, 40), generator=torch.Generator()
                        .manual_seed(0))
    with torch.no_grad():
        diff = (wide(ids).logits - builtin_pair.target(ids).logits).abs().max().item()
    assert diff < 1e-4
    assert sum(p.numel() for p in wide.parameters()) > sum(
        p.numel() for p in builtin_pair.target.parameters())


def test_core_imports_no_service_frameworks():
    code = (
        "import sys, specserve.core, specserve.core.verify, specserve.core.sampling;"
        "bad=[m for m in ('ray','grpc','redis','opentelemetry') if m in sys.modules];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
