"""Every input the worker cannot serve gets a 400 (or 404/405) in the OpenAI error shape, and
the worker keeps serving afterwards."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.workers.server.conftest import MAX_MODEL_LEN, WorkerHandle

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": "tiny", "prompt": "hi", "max_tokens": 2}


def _with(base: dict, **changes: object) -> dict:
    return {**base, **changes}


BAD_BODIES = [
    # (endpoint, body, expected param, fragment of the message)
    ("completions", b'{"model": "tiny", "prompt": ', None, "not valid JSON"),
    ("completions", b"[]", None, "must be a JSON object"),
    ("completions", _with(COMPLETION, max_tokens="2"), "max_tokens", "valid integer"),
    ("completions", _with(COMPLETION, max_tokens=-1), "max_tokens", "greater than or equal to 0"),
    ("completions", _with(COMPLETION, temperature=2.5), "temperature", "less than or equal to 2"),
    ("completions", _with(COMPLETION, top_p=0), "top_p", "greater than 0"),
    ("completions", _with(COMPLETION, n=17), "n", "less than or equal to 16"),
    ("completions", _with(COMPLETION, n=3, best_of=2), "best_of", "must be at least n (3)"),
    ("completions", _with(COMPLETION, best_of=2, stream=True), "best_of", "cannot be streamed"),
    ("completions", _with(COMPLETION, logprobs=21), "logprobs", "less than or equal to 20"),
    ("chat/completions", _with(CHAT, logprobs=True, top_logprobs=-1), "top_logprobs",
     "greater than or equal to 0"),
    ("completions", _with(COMPLETION, prompt=["a"] * 65), "prompt", "at most 64 sequences"),
    ("completions", _with(COMPLETION, prompt=["a", ""]), "prompt", "the prompt is empty"),
    ("completions", _with(COMPLETION, prompt=""), "prompt", "the prompt is empty"),
    ("completions", _with(COMPLETION, prompt=[1, 10**6]), "prompt", "prompt token ids must be"),
    ("completions", _with(COMPLETION, model="gpt-4"), "model", "does not exist"),
    ("completions", _with(COMPLETION, prompt=[7] * MAX_MODEL_LEN), "prompt",
     f"maximum context length is {MAX_MODEL_LEN} tokens"),
    ("completions", _with(COMPLETION, prompt=[7] * (MAX_MODEL_LEN - 50), max_tokens=100),
     "max_tokens", f"({MAX_MODEL_LEN - 50} in the prompt, 100 for the completion)"),
    ("chat/completions", _with(CHAT, messages=[]), "messages", "at least 1 item"),
    ("chat/completions", _with(CHAT, messages="hi"), "messages", "valid array"),
    ("chat/completions", _with(CHAT, messages=[{"role": "function", "content": "x"}]),
     "messages[0].role", "Input should be"),
    ("chat/completions",
     _with(CHAT, messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
     "messages[0].content", "only 'text' is supported"),
    ("chat/completions", _with(CHAT, stream="true"), "stream", "valid boolean"),
    ("chat/completions", _with(CHAT, stream_options={"include_usage": True}), "stream_options",
     "only allowed when stream is true"),
    ("chat/completions", _with(CHAT, messages=[{"role": "user", "content": "x" * MAX_MODEL_LEN}]),
     "messages", f"maximum context length is {MAX_MODEL_LEN} tokens"),
    ("chat/completions", _with(CHAT, model=""), "model", "does not exist"),
    ("chat/completions", _with(CHAT, functions=[{"name": "f"}]),
     "functions", "functions is not supported"),
    ("chat/completions", _with(CHAT, response_format={"type": "json_schema", "json_schema": {
        "name": "bad", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}),
     "response_format.json_schema.schema", "cannot be compiled into a grammar"),
    ("chat/completions", _with(CHAT, tools=[{"type": "function", "function": {"name": "f"}}],
                               tool_choice={"type": "function", "function": {"name": "g"}}),
     "tool_choice", "names function 'g', which is not in tools"),
    ("chat/completions", _with(CHAT, presence_penalty=5), "presence_penalty",
     "less than or equal to 2"),
    ("completions", _with(COMPLETION, logit_bias={"5": 101}), "logit_bias",
     "less than or equal to 100"),
    ("completions", _with(COMPLETION, stop=[f"s{i}" for i in range(17)]), "stop",
     "at most 16 stop strings (got 17)"),
    ("completions", _with(COMPLETION, stop="x" * 257), "stop",
     "a stop string has at most 256 characters (got 257)"),
    ("chat/completions", _with(CHAT, stop=["y" * 200] * 6), "stop",
     "stop strings have at most 1024 characters in all (got 1200)"),
    # Non-finite numbers, in a known field or one the models ignore.
    ("completions", b'{"model": "tiny", "prompt": "hi", "temperature": NaN}', None,
     "NaN is not a JSON value"),
    ("completions", b'{"model": "tiny", "prompt": "seed", "x": [-Infinity]}', None,
     "-Infinity is not a JSON value"),
]  # fmt: skip


def test_null_optional_fields_are_omitted(worker: WorkerHandle) -> None:
    body = _with(COMPLETION, n=None, stream=None, echo=None, logprobs=None, stop=None)
    resp = httpx.post(f"{worker.api_url}/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 2
    body = _with(CHAT, n=None, stream=None, tool_choice="none", response_format={"type": "text"})
    resp = httpx.post(f"{worker.api_url}/chat/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text


@pytest.mark.parametrize(("endpoint", "body", "param", "fragment"), BAD_BODIES)
def test_bad_input_is_a_400_naming_the_field(
    worker: WorkerHandle, endpoint: str, body: dict | bytes, param: str | None, fragment: str
) -> None:
    url = f"{worker.api_url}/{endpoint}"
    if isinstance(body, bytes):
        resp = httpx.post(url, content=body, headers={"content-type": "application/json"},
                          timeout=30)  # fmt: skip
    else:
        resp = httpx.post(url, json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert fragment in error["message"]


def test_openai_client_raises_bad_request(worker: WorkerHandle) -> None:
    client = openai.OpenAI(base_url=worker.api_url, api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                       max_tokens=MAX_MODEL_LEN)  # fmt: skip
    assert info.value.status_code == 400
    assert info.value.body["param"] == "max_tokens"  # type: ignore[index]
    assert info.value.body["code"] == "context_length_exceeded"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="unknown-model", prompt="x", max_tokens=1)
    assert info.value.body["code"] == "model_not_found"  # type: ignore[index]


def test_unknown_route_and_wrong_method(worker: WorkerHandle) -> None:
    missing = httpx.post(f"{worker.api_url}/embeddings", json={}, timeout=10)
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "unknown_url"
    assert missing.json()["error"]["message"] == "no route POST /v1/embeddings"
    wrong = httpx.get(f"{worker.api_url}/completions", timeout=10)
    assert wrong.status_code == 405
    assert wrong.json()["error"]["type"] == "invalid_request_error"


def test_still_serving_and_nothing_leaked_after_bad_inputs(worker: WorkerHandle) -> None:
    before = worker.metrics()
    for endpoint, body, _, _ in BAD_BODIES[:5]:
        kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
        assert httpx.post(f"{worker.api_url}/{endpoint}", timeout=30, **kwargs).status_code == 400
    good = {**COMPLETION, "ignore_eos": True}
    ok = httpx.post(f"{worker.api_url}/completions", json=good, timeout=60)
    assert ok.status_code == 200
    assert ok.json()["usage"]["completion_tokens"] == 2
    after = worker.wait_idle()
    rejected = 'pdworker_requests_total{endpoint="completion",status="rejected"}'
    assert after[rejected] - before.get(rejected, 0) == 5
    assert after["pdworker_kv_blocks_used"] == 0
    assert after["pdworker_num_requests_in_flight"] == 0


def test_a_huge_model_name_is_quoted_clipped(worker: WorkerHandle) -> None:
    """A 100 KB model name (190 KB ones were seen) was echoed whole in the 400 and logged
    whole: now quoted clipped, with its length."""
    model = "m" * 100_000
    resp = httpx.post(f"{worker.api_url}/completions", json={**COMPLETION, "model": model},
                      timeout=30)  # fmt: skip
    assert resp.status_code == 400, resp.text[:300]
    message = resp.json()["error"]["message"]
    assert message.startswith(f"The model '{'m' * 64}... (100000 characters)' does not exist")
    assert len(message) < 300


def test_no_redirect_is_built_from_the_host_header(worker: WorkerHandle) -> None:
    """A trailing slash is a plain 404, not a redirect whose Location names the Host sent."""
    resp = httpx.get(f"{worker.base_url}/health/", headers={"Host": "evil.example"}, timeout=30)
    assert resp.status_code == 404, resp.headers
    assert "location" not in resp.headers


def test_a_405_names_the_allowed_methods(worker: WorkerHandle) -> None:
    for method, path, allow in (("TRACE", "/health", "GET"), ("GET", "/v1/completions", "POST")):
        resp = httpx.request(method, f"{worker.api_url.removesuffix('/v1')}{path}", timeout=30)
        assert resp.status_code == 405, resp.text
        assert resp.headers["Allow"] == allow
        assert resp.json()["error"]["type"] == "invalid_request_error"


def test_openapi_describes_the_openai_routes(worker: WorkerHandle) -> None:
    doc = httpx.get(f"{worker.api_url.removesuffix('/v1')}/openapi.json", timeout=30).json()
    operation = doc["paths"]["/v1/chat/completions"]["post"]
    schema = operation["requestBody"]["content"]["application/json"]["schema"]
    assert schema == {"$ref": "#/components/schemas/ChatCompletionRequest"}
    assert {"400", "404", "409", "413", "503"} <= set(operation["responses"])
