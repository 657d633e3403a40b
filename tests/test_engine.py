"""The single-process engine on the committed built-in pair."""

from __future__ import annotations

import pytest
import torch

from specserve.api import GenerationRequest
from specserve.engine.generator import RequestError
from specserve.engine.lean import LeanLlama

MAX_NEW = 24


@pytest.fixture(scope="module")
def references(builtin_pair, generator, heldout):
    """Target-only greedy decoding by Hugging Face ``generate`` (the reference)."""
    refs = []
    eos = builtin_pair.tokenizer.eos_token_id
    for prompt in heldout:
        ids = generator.encode(GenerationRequest(prompt=prompt))
        out = builtin_pair.target.generate(
            torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=eos)
        ref = out[0, len(ids):].tolist()
        if eos in ref:
            ref = ref[: ref.index(eos) + 1]
        refs.append((ids, ref))
    return refs


@pytest.mark.parametrize("spec", ["draft", "ngram"])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_equals_target_only(generator, references, spec, k):
    assert len(references) >= 20
    for ids, ref in references:
        _, out, stats = generator.generate(
            GenerationRequest(prompt_ids=ids, max_tokens=MAX_NEW, spec=spec, k=k))
        assert out == ref
        assert stats.acceptance.rounds <= len(out)


def test_spec_off_equals_target_only(generator, references):
    for ids, ref in references[:5]:
        _, out, _ = generator.generate(GenerationRequest(prompt_ids=ids, max_tokens=MAX_NEW,
                                                         spec="off"))
        assert out == ref


def test_draft_mode_actually_speculates(generator, references):
    ids, _ = references[0]
    _, _, stats = generator.generate(GenerationRequest(prompt_ids=ids, max_tokens=MAX_NEW,
                                                       spec="draft", k=4))
    a = stats.acceptance
    assert a.drafts > 0 and a.draft_tokens > 0
    assert a.tokens_per_round > 1.0  # the built-in drafter agrees with its target


def test_seeded_sampling_is_reproducible(generator):
    req = GenerationRequest(prompt="def parse(self, text):\n", max_tokens=32, temperature=0.9,
                            top_k=50, top_p=0.95, seed=42, k=4)
    _, a, _ = generator.generate(req)
    _, b, _ = generator.generate(req)
    _, c, _ = generator.generate(req.model_copy(update={"seed": 43}))
    assert a == b
    assert a != c


def test_stop_string_and_eos(generator):
    text, _, stats = generator.generate(GenerationRequest(
        prompt="import os\nimport sys\n", max_tokens=40, stop=["\n"], spec="off"))
    assert "\n" not in text
    assert stats.finish_reason == "stop"
    _, out, stats = generator.generate(GenerationRequest(prompt="x = 1\n", max_tokens=5))
    assert len(out) == 5 and stats.finish_reason == "length"


def test_stream_yields_incremental_text(generator):
    chunks = list(generator.stream(GenerationRequest(prompt="class Foo:\n", max_tokens=20)))
    assert len(chunks) > 1
    assert chunks[-1].finish_reason and chunks[-1].stats is not None
    assert all(c.stats is None for c in chunks[:-1])
    assert sum(len(c.token_ids) for c in chunks) == chunks[-1].stats.output_tokens


def test_lean_drafter_matches_hf_forward(builtin_pair):
    lean = LeanLlama(builtin_pair.drafter)
    cache = lean.new_cache()
    ids = torch.tensor(builtin_pair.tokenizer("def f(a, b):\n    return a + b\n")["input_ids"])
    parts = [lean.forward(cache, ids[:7]), lean.forward(cache, ids[7:8]),
             lean.forward(cache, ids[8:])]
    ref = builtin_pair.drafter(ids[None]).logits[0]
    assert torch.allclose(torch.cat(parts), ref, atol=1e-4)
    cache.crop(5)  # repair: recompute the tail after a crop
    again = lean.forward(cache, ids[5:])
    assert torch.allclose(again, ref[5:], atol=1e-4)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": "x", "temperature": -0.1}, "temperature"),
        ({"prompt": "x", "top_p": 0.0}, "top_p"),
        ({"prompt": "x", "top_p": 1.5}, "top_p"),
        ({"prompt": "x", "k": -1}, "k"),
        ({"prompt": "x", "k": 17}, "k"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "spec": "medusa"}, "spec"),
    ],
)
def test_bad_request_fields_are_named(kwargs, field):
    from pydantic import ValidationError

    from specserve.api import describe_validation_error

    with pytest.raises(ValidationError) as e:
        GenerationRequest(**kwargs)
    assert describe_validation_error(e.value).startswith(field)


def test_prompt_longer_than_context(generator, builtin_pair):
    ctx = builtin_pair.max_context
    with pytest.raises(RequestError, match=r"prompt: .* shorten the prompt"):
        generator.generate(GenerationRequest(prompt_ids=[5] * ctx, max_tokens=1))
    with pytest.raises(RequestError, match=r"max_tokens: .* lower max_tokens to at most 10"):
        generator.generate(GenerationRequest(prompt_ids=[5] * (ctx - 10), max_tokens=11))
    with pytest.raises(RequestError, match="outside the vocabulary"):
        generator.generate(GenerationRequest(prompt_ids=[10**6], max_tokens=1))


def test_incremental_detokenizer_equals_full_decode(builtin_pair):
    """Window decoding streams exactly the full decode, for any split into rounds,
    multi-byte characters cut mid-token included."""
    import random

    from specserve.engine.detok import IncrementalDetokenizer

    tok = builtin_pair.tokenizer
    text = 'def ünïcode(x):\n    """Émoji 🎉 — “quotes” 日本語"""\n    return x  # ok\n' * 3
    ids = tok(text)["input_ids"] + [tok.eos_token_id]
    for seed in range(50):
        rnd = random.Random(seed)
        detok, out, i = IncrementalDetokenizer(tok), "", 0
        while i < len(ids):
            n = rnd.randint(1, 4)
            out += detok.push(ids[i : i + n])
            i += n
        assert out + detok.flush() == tok.decode(ids, skip_special_tokens=True)
