"""The OpenAI-compatible HTTP API against the running service, with real clients: the
official ``openai`` package and ``curl`` reading server-sent events. Outputs equal the gRPC
API's and spec-off's; bad fields get OpenAI-shaped errors naming the field."""

from __future__ import annotations

import json
import subprocess
import urllib.request

import pytest
from test_service import _clients

from specserve import openai_api as oa

MODEL = "builtin-target"
PROMPTS = ["def parse_args(argv):\n", "class LRUCache:\n    def __init__(self", "import os\n"]
MAX_NEW = 24


@pytest.fixture(scope="module")
def openai_client(service):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{service.http_address}/v1", api_key="unused",
                         max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def grpc_refs(service) -> dict[str, dict]:
    """The gRPC API's greedy outputs (draft and spec-off) with logprobs, per prompt."""
    jobs = [{"prompt": p, "max_tokens": MAX_NEW, "spec": spec, "logprobs": 3}
            for p in PROMPTS for spec in ("draft", "off")]
    out = _clients(service.grpc_address, jobs)
    refs = {}
    for i, p in enumerate(PROMPTS):
        draft, off = out[2 * i], out[2 * i + 1]
        assert draft["token_ids"] == off["token_ids"]  # spec-off equality, token for token
        refs[p] = draft
    return refs


def test_completions_equal_the_grpc_api(openai_client, grpc_refs):
    for p in PROMPTS:
        r = openai_client.completions.create(model=MODEL, prompt=p, max_tokens=MAX_NEW,
                                             temperature=0)
        assert r.choices[0].text == grpc_refs[p]["text"]
        assert r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == MAX_NEW
        assert r.usage.prompt_tokens == grpc_refs[p]["stats"]["prompt_tokens"]
        assert r.model_extra["specserve"]["spec"] == "auto"  # the default
        # streamed: the deltas add up to the same text
        deltas = list(openai_client.completions.create(
            model=MODEL, prompt=p, max_tokens=MAX_NEW, temperature=0, stream=True,
            extra_body={"spec": "ngram", "k": 3}))
        assert "".join(c.choices[0].text for c in deltas) == grpc_refs[p]["text"]
        assert deltas[-1].choices[0].finish_reason == "length"


def test_completion_logprobs_equal_the_grpc_api(openai_client, grpc_refs):
    p = PROMPTS[0]
    r = openai_client.completions.create(model=MODEL, prompt=p, max_tokens=MAX_NEW,
                                         temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    want = grpc_refs[p]["logprobs"]
    assert len(lp.token_logprobs) == MAX_NEW == len(want)
    for got, (_, logprob, _) in zip(lp.token_logprobs, want, strict=True):
        # the gRPC references ran batched with other rows: the last float32 bits may differ
        assert abs(got - logprob) <= 1e-5 + 1e-5 * abs(logprob)
    assert all(len(t) == 3 for t in lp.top_logprobs)
    assert "".join(lp.tokens) == r.choices[0].text


def test_chat_equals_the_grpc_api_on_the_templated_prompt(service, openai_client):
    messages = [{"role": "system", "content": "You write Python."},
                {"role": "user", "content": "A function that adds two numbers."}]
    prompt = oa.chat_prompt([oa.ChatMessage(**m) for m in messages],
                            _tokenizer())
    (ref,) = _clients(service.grpc_address, [{"prompt": prompt, "max_tokens": MAX_NEW,
                                              "spec": "off"}])
    r = openai_client.chat.completions.create(model=MODEL, messages=messages,
                                              max_tokens=MAX_NEW, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref["text"]
    stream = openai_client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=MAX_NEW, temperature=0, stream=True,
        logprobs=True, top_logprobs=2, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref["text"]
    assert chunks[-1].usage.completion_tokens == MAX_NEW and not chunks[-1].choices
    content = [e for c in chunks if c.choices and c.choices[0].logprobs
               for e in c.choices[0].logprobs.content]
    assert len(content) == MAX_NEW and all(len(e.top_logprobs) == 2 for e in content)


def _tokenizer():
    from transformers import AutoTokenizer

    from specserve.models.load import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(MODEL))


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "n": 2}, "n"),
    ({"prompt": "x", "echo": True}, "echo"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "frobnicate": 1}, "frobnicate"),
    ({"prompt": "x", "spec": "maybe"}, "spec"),
    ({"prompt": "x", "model": "gpt-4"}, "model"),
    ({"prompt": "x", "max_tokens": 100_000}, "max_tokens"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
])
def test_bad_fields_are_400_naming_the_field(service, body, param):
    status, err = _post(service.http_address + "/v1/completions", body)
    assert status == 400, err
    assert err["error"]["param"] == param and err["error"]["type"] == "invalid_request_error"
    assert param in err["error"]["message"]


def test_bad_requests_in_openai_shape(openai_client, service):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        openai_client.chat.completions.create(model=MODEL, messages=[], max_tokens=4)
    assert "messages" in str(e.value)
    status, err = _post(service.http_address + "/v1/completions", b"{not json")
    assert status == 400 and "JSON" in err["error"]["message"]
    status, err = _post(service.http_address + "/v1/completions",
                        {"prompt": "x" * (9 << 20)})
    assert status == 413


def test_models_and_health(service):
    with urllib.request.urlopen(service.http_address + "/v1/models", timeout=30) as r:
        data = json.loads(r.read())
    assert [m["id"] for m in data["data"]] == [MODEL]
    assert data["data"][0]["specserve"]["target_revision"]
    with urllib.request.urlopen(service.http_address + "/health", timeout=30) as r:
        assert r.status == 200


def test_curl_streams_server_sent_events(service, grpc_refs):
    body = json.dumps({"model": MODEL, "prompt": PROMPTS[1], "max_tokens": MAX_NEW,
                       "temperature": 0, "stream": True})
    out = subprocess.run(["curl", "-sS", "-N", "-H", "Content-Type: application/json",
                          "-d", body, service.http_address + "/v1/completions"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    events = [line.removeprefix("data: ") for line in out.split("\n\n") if line.strip()]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == grpc_refs[PROMPTS[1]]["text"]
    assert all(c["object"] == "text_completion" for c in chunks)


def _post(url: str, body: dict | bytes, headers: dict | None = None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json",
                                                          **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def keyed_app(service, tmp_path_factory):
    """An app that requires API keys (a keys file, as `security.api_keys_file`)."""
    from ray import serve

    from deployments.app import build_app

    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text("alice: alice-key-0123456789abcdef\n")
    serve.run(build_app({"redis_url": service.redis_url,
                         "security": {"api_keys_file": str(keys), "api_keys_env": None}}),
              name="specserve-keys", route_prefix="/keys")
    yield f"{service.http_address}/keys"
    serve.delete("specserve-keys")


def test_bearer_auth_applies_to_http(keyed_app):
    body = {"model": MODEL, "prompt": "def f(", "max_tokens": 4, "temperature": 0}
    for headers in ({}, {"Authorization": "Bearer wrong-key-0123456789"},
                    {"Authorization": "Basic alice-key-0123456789abcdef"}):
        status, err = _post(keyed_app + "/v1/completions", body, headers)
        assert status == 401, (headers, err)
        assert err["error"]["type"] == "invalid_request_error" and err["error"]["message"]
    status, ok = _post(keyed_app + "/v1/completions", body,
                       {"Authorization": "Bearer alice-key-0123456789abcdef"})
    assert status == 200 and ok["usage"]["completion_tokens"] == 4


@pytest.fixture(scope="module")
def small_app(service):
    """An app whose router admits 2 requests at a time."""
    from ray import serve

    from deployments.app import build_app

    serve.run(build_app({"redis_url": service.redis_url, "router": {"max_concurrent": 2}}),
              name="specserve-small", route_prefix="/small")
    yield f"{service.http_address}/small"
    serve.delete("specserve-small")


def test_overload_is_429_in_openai_shape(small_app, grpc_refs):
    from concurrent.futures import ThreadPoolExecutor

    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": MAX_NEW, "temperature": 0}
    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(lambda _: _post(small_app + "/v1/completions", body),
                                range(12)))
    statuses = sorted(status for status, _ in results)
    assert set(statuses) == {200, 429}, statuses
    for status, payload in results:
        if status == 429:
            assert "capacity" in payload["error"]["message"]
            assert payload["error"]["type"] == "invalid_request_error"
        else:  # the admitted ones are exact
            assert payload["choices"][0]["text"] == grpc_refs[PROMPTS[0]]["text"]
