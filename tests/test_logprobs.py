"""Exact logprobs: the target's, computed from the verify logits, equal to a plain target
forward over the whole sequence (greedy and sampled; draft and ngram; k 1..8), in process
and over the router's gRPC data path."""

from __future__ import annotations

import asyncio

import pytest
import torch

from specserve.api import GenerationRequest
from specserve.core.logprobs import logprobs_from_logits
from specserve.core.sampling import SamplingParams, params_tensors, probs_from_logits

TOP = 5
MAX_NEW = 20
SETTINGS = [(0.0, 0, 1.0), (0.8, 50, 0.9)]  # (temperature, top_k, top_p)


def _reference(pair, prompt: list[int], out: list[int], s: SamplingParams) -> torch.Tensor:
    """Log-probabilities of each output position from one plain forward: [len(out), V]."""
    full = torch.tensor([prompt + out])
    with torch.inference_mode():
        logits = pair.target(input_ids=full).logits[0].float()
    pos = logits[len(prompt) - 1 : len(prompt) - 1 + len(out)]
    return logprobs_from_logits(pos, *params_tensors([s] * len(out)))


def _close(a: float, b: float) -> bool:
    """Equal to 1e-5 in float32 terms: |a - b| <= 1e-5 + 1e-5 |b| (torch.allclose's rule).
    The cached verify forward and the plain full forward differ in the last float32 bits of
    the logits (measured: at most 1.1e-5 absolute on a logprob of -3.2)."""
    return a == b or abs(a - b) <= 1e-5 + 1e-5 * abs(b)  # a == b: both -inf (outside top-p)


def _check(ref: torch.Tensor, out: list[int], lps: list) -> None:
    assert [lp.token for lp in lps] == out
    for j, lp in enumerate(lps):
        assert _close(lp.logprob, float(ref[j, out[j]])), (j, lp.logprob, float(ref[j, out[j]]))
        assert lp.logprob > float("-inf")  # the committed token is in the sampled support
        want = ref[j].topk(TOP).values.tolist()
        assert all(_close(v, w) for (_, v), w in zip(lp.top, want, strict=True)), j
        assert all(_close(v, float(ref[j, t])) for t, v in lp.top), j
        assert len({t for t, _ in lp.top}) == TOP
        assert all(t == out[j] or v <= lp.top[0][1] for t, v in lp.top)  # most likely first


@pytest.mark.parametrize("spec", ["draft", "ngram"])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize(("temperature", "top_k", "top_p"), SETTINGS)
def test_logprobs_equal_a_plain_forward(builtin_pair, generator, heldout, spec, k, temperature,
                                        top_k, top_p):
    ids = generator.encode(GenerationRequest(prompt=heldout[k]))
    req = GenerationRequest(prompt_ids=ids, max_tokens=MAX_NEW, spec=spec, k=k,
                            temperature=temperature, top_k=top_k, top_p=top_p, seed=7,
                            logprobs=TOP)
    lps, out = [], []
    for chunk in generator.stream(req):
        assert chunk.logprobs is not None and len(chunk.logprobs) == len(chunk.token_ids)
        lps += chunk.logprobs
        out += chunk.token_ids
    s = SamplingParams(temperature, top_k, top_p, 7)
    _check(_reference(builtin_pair, ids, out, s), out, lps)


def test_logprobs_match_the_sampled_distribution():
    """For temperature > 0 the logprobs are log of exactly the distribution sampled from."""
    torch.manual_seed(0)
    logits = torch.randn(6, 300) * 4
    temp = torch.tensor([0.5, 0.8, 1.0, 1.3, 0.7, 2.0])
    top_k = torch.tensor([0, 10, 0, 40, 3, 0])
    top_p = torch.tensor([1.0, 1.0, 0.7, 0.9, 1.0, 0.5])
    lp = logprobs_from_logits(logits, temp, top_k, top_p)
    p = probs_from_logits(logits, temp, top_k, top_p)
    assert torch.allclose(lp.exp(), p, atol=1e-7)
    assert torch.equal(torch.isinf(lp), p == 0)
    greedy = logprobs_from_logits(logits, torch.zeros(6), top_k, top_p)
    assert torch.allclose(greedy, torch.log_softmax(logits, -1))


def test_no_logprobs_unless_asked(generator):
    chunks = list(generator.stream(GenerationRequest(prompt="import os\n", max_tokens=8)))
    assert all(c.logprobs is None for c in chunks)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_through_the_grpc_data_path(builtin_pair, generator, temperature):
    """The router over real drafter / target gRPC servers: the same logprobs (float32 on the
    wire) as the plain forward."""
    from router.inprocess import start_inprocess

    prompt = "def read_config(path):\n"
    ids = generator.encode(GenerationRequest(prompt=prompt))
    req = GenerationRequest(prompt_ids=ids, max_tokens=MAX_NEW, k=4, temperature=temperature,
                            seed=11, logprobs=TOP)

    async def go():
        svc = await start_inprocess(builtin_pair)
        try:
            return await svc.generate(req, "lp-1")
        finally:
            await svc.close()

    chunks = asyncio.run(go())
    out = [t for c in chunks for t in c.token_ids]
    lps = [lp for c in chunks for lp in c.logprobs]
    _check(_reference(builtin_pair, ids, out, SamplingParams(temperature, 0, 1.0, 11)), out, lps)
