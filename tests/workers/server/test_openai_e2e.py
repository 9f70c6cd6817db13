"""A real mixed worker driven by the official openai client: chat and completions, streaming
and not, exact usage, stop strings, length limits, seeded sampling, request ids."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import openai
import pytest
from httpx_sse import connect_sse

from tests.sse import iter_sse_data
from tests.workers.server.conftest import BLOCK_SIZE, MAX_MODEL_LEN, NUM_KV_BLOCKS, WorkerHandle
from workers.engine.tokenizer import Tokenizer

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a color."},
]


@pytest.fixture(scope="module")
def client(worker: WorkerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=worker.api_url, api_key="unused", max_retries=0, timeout=120)


def chat_prompt_len(tokenizer: Tokenizer, messages: list[dict[str, str]]) -> int:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_health_and_models(worker: WorkerHandle, client: openai.OpenAI) -> None:
    health = httpx.get(f"{worker.base_url}/health", timeout=10)
    assert health.status_code == 200
    body = health.json()
    assert body["status"] == "ok"
    assert body["role"] == "mixed"
    assert body["model"] == "tiny"
    assert (body["block_size"], body["num_kv_blocks"]) == (BLOCK_SIZE, NUM_KV_BLOCKS)
    assert body["max_model_len"] == MAX_MODEL_LEN
    assert re.fullmatch(r"[0-9a-f]{8,}", body["fingerprint"]), body["fingerprint"]
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_chat_non_stream_usage_is_exact(client: openai.OpenAI, tiny_tokenizer: Tokenizer) -> None:
    resp = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=7, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert resp.object == "chat.completion"
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == chat_prompt_len(tiny_tokenizer, MESSAGES)
    assert resp.usage.completion_tokens == 7
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 7


def test_chat_stream_equals_non_stream(client: openai.OpenAI, tiny_tokenizer: Tokenizer) -> None:
    kwargs = {"model": "tiny", "messages": MESSAGES, "max_tokens": 12, "temperature": 0,
              "extra_body": {"ignore_eos": True}}  # fmt: skip
    whole = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == ["length"]
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == []
    assert usage_chunk.usage is not None
    assert usage_chunk.usage.prompt_tokens == chat_prompt_len(tiny_tokenizer, MESSAGES)
    assert usage_chunk.usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_stream_equals_non_stream(
    client: openai.OpenAI, tiny_tokenizer: Tokenizer
) -> None:
    prompt = "The quick brown fox"
    kwargs = {"model": "tiny", "prompt": prompt, "max_tokens": 10, "temperature": 0,
              "extra_body": {"ignore_eos": True}}  # fmt: skip
    whole = client.completions.create(**kwargs)
    assert whole.object == "text_completion"
    assert whole.usage is not None
    assert whole.usage.prompt_tokens == len(tiny_tokenizer.encode(prompt, add_special_tokens=True))
    assert whole.usage.completion_tokens == 10
    assert whole.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)


def test_completion_token_prompt_matches_text_prompt(
    client: openai.OpenAI, tiny_tokenizer: Tokenizer
) -> None:
    ids = tiny_tokenizer.encode("hello there", add_special_tokens=True)
    common = {"model": "tiny", "max_tokens": 6, "temperature": 0,
              "extra_body": {"ignore_eos": True}}  # fmt: skip
    by_ids = client.completions.create(prompt=ids, **common)
    by_text = client.completions.create(prompt="hello there", **common)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage is not None and by_ids.usage.prompt_tokens == len(ids)


def test_sse_wire_format_ends_with_done(worker: WorkerHandle) -> None:
    body = {
        "model": "tiny",
        "prompt": "abc",
        "max_tokens": 3,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with (
        httpx.Client(timeout=60) as http,
        connect_sse(http, "POST", f"{worker.api_url}/completions", json=body) as events,
    ):
        assert events.response.status_code == 200
        assert events.response.headers["content-type"].startswith("text/event-stream")
        data = [e.data for e in events.iter_sse()]
    assert data[-1] == "[DONE]"
    usage = json.loads(data[-2])
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 3
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + 3


def test_stop_string_cuts_the_text(client: openai.OpenAI) -> None:
    common = {"model": "tiny", "prompt": "Once upon a time", "temperature": 0,
              "extra_body": {"ignore_eos": True}}  # fmt: skip
    full = client.completions.create(max_tokens=24, **common).choices[0].text
    # A stop string taken from the middle of the greedy text: the answer ends right before it.
    candidates = [i for i in range(3, len(full) - 1) if full[i] not in "\ufffd"]
    assert candidates, f"greedy text too short to pick a stop string from: {full!r}"
    stop = full[candidates[0]]
    cut = full[: full.index(stop)]
    for stream in (False, True):
        if stream:
            chunks = list(
                client.completions.create(max_tokens=24, stop=[stop], stream=True, **common)
            )
            text = "".join(c.choices[0].text for c in chunks)
            finish = chunks[-1].choices[0].finish_reason
        else:
            resp = client.completions.create(max_tokens=24, stop=stop, **common)
            text, finish = resp.choices[0].text, resp.choices[0].finish_reason
        assert (text, finish) == (cut, "stop"), (stream, stop, full)


def test_seeded_sampling_is_reproducible(client: openai.OpenAI) -> None:
    def sample(seed: int, stream: bool) -> str:
        kwargs = {"model": "tiny", "messages": MESSAGES, "max_tokens": 16, "temperature": 1.0,
                  "seed": seed, "extra_body": {"ignore_eos": True}}  # fmt: skip
        if stream:
            chunks = client.chat.completions.create(**kwargs, stream=True)
            return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return client.chat.completions.create(**kwargs).choices[0].message.content or ""

    first = sample(1234, stream=False)
    assert sample(1234, stream=False) == first
    assert sample(1234, stream=True) == first
    assert sample(4321, stream=False) != first


def test_request_id_is_echoed_or_made(worker: WorkerHandle) -> None:
    body = {"model": "tiny", "prompt": "x", "max_tokens": 1}
    url = f"{worker.api_url}/completions"
    given = httpx.post(url, json=body, headers={"X-Request-Id": "client-id-7"}, timeout=60)
    assert given.status_code == 200
    assert given.headers["x-request-id"] == "client-id-7"
    assert given.json()["id"] == "cmpl-client-id-7"
    made = httpx.post(url, json=body, timeout=60)
    assert re.fullmatch(r"[0-9a-f]{32}", made.headers["x-request-id"])
    assert made.json()["id"] == f"cmpl-{made.headers['x-request-id']}"
    refused = httpx.post(url, json={"model": "nope", "prompt": "x"}, timeout=60,
                         headers={"X-Request-Id": "bad-one"})  # fmt: skip
    assert (refused.status_code, refused.headers["x-request-id"]) == (400, "bad-one")


async def test_concurrent_async_clients(worker: WorkerHandle, tiny_tokenizer: Tokenizer) -> None:
    async with openai.AsyncOpenAI(base_url=worker.api_url, api_key="unused", max_retries=0,
                                  timeout=120) as aclient:  # fmt: skip
        prompts = [f"prompt number {i}" for i in range(6)]
        results = await asyncio.gather(*(
            aclient.completions.create(model="tiny", prompt=p, max_tokens=5 + i, temperature=0,
                                       extra_body={"ignore_eos": True})
            for i, p in enumerate(prompts)
        ))  # fmt: skip
        alone = await aclient.completions.create(
            model="tiny",
            prompt=prompts[3],
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
    for i, (prompt, res) in enumerate(zip(prompts, results, strict=True)):
        assert res.usage is not None
        assert res.usage.completion_tokens == 5 + i
        assert res.usage.prompt_tokens == len(
            tiny_tokenizer.encode(prompt, add_special_tokens=True)
        )
    # Batched with five others or alone, greedy decoding gives the same text.
    assert results[3].choices[0].text == alone.choices[0].text
    assert worker.wait_idle()["pdworker_kv_blocks_used"] == 0


def test_max_completion_tokens_and_stop_token_ids(client: openai.OpenAI) -> None:
    common = {"model": "tiny", "messages": MESSAGES, "temperature": 0}
    resp = client.chat.completions.create(
        max_completion_tokens=5, extra_body={"ignore_eos": True}, **common
    )
    assert resp.usage is not None and resp.usage.completion_tokens == 5
    first_text = resp.choices[0].message.content or ""
    # Stopping on the id of the greedy first token ends the answer there: nothing shown.
    assert first_text[:1] not in ("", "\ufffd"), f"first token is not one byte: {first_text!r}"
    first_id = first_text.encode()[0]  # the tiny tokenizer's ids 0..255 are the bytes
    stopped = client.chat.completions.create(
        max_completion_tokens=5, extra_body={"ignore_eos": True, "stop_token_ids": [first_id]},
        **common,
    )  # fmt: skip
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == ""
    assert stopped.usage is not None and stopped.usage.completion_tokens == 1


def test_metrics_record_a_served_request(worker: WorkerHandle, client: openai.OpenAI) -> None:
    before = worker.wait_idle()
    resp = client.completions.create(model="tiny", prompt=[5, 6, 7, 8], max_tokens=6,
                                     temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    assert resp.usage is not None and resp.usage.completion_tokens == 6
    after = worker.wait_idle()

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert delta('pdworker_requests_total{endpoint="completion",status="success"}') == 1
    assert delta("pdworker_prompt_tokens_total") == 4
    assert delta("pdworker_generation_tokens_total") == 6
    assert delta("pdworker_time_to_first_token_seconds_count") == 1
    assert delta("pdworker_time_per_output_token_seconds_count") == 1
    assert delta("pdworker_e2e_request_latency_seconds_count") == 1
    assert after["pdworker_kv_blocks_total"] == NUM_KV_BLOCKS
    assert after["pdworker_engine_ready"] == 1


def test_duplicate_request_id_in_flight_is_refused(worker: WorkerHandle) -> None:
    url = f"{worker.api_url}/completions"
    headers = {"X-Request-Id": "same-id-twice"}
    long_body = {"model": "tiny", "prompt": "a", "max_tokens": 500, "ignore_eos": True,
                 "stream": True}  # fmt: skip
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", url, json=long_body, headers=headers) as held,
    ):
        assert held.status_code == 200
        events = iter_sse_data(held)  # kept: dropping it would close the stream
        assert json.loads(next(events))["choices"]  # admitted and generating
        twin = httpx.post(url, json={"model": "tiny", "prompt": "b", "max_tokens": 1},
                          headers=headers, timeout=30)  # fmt: skip
        assert twin.status_code == 409
        assert twin.json()["error"]["code"] == "duplicate_request_id"
    worker.wait_idle()
    again = httpx.post(url, json={"model": "tiny", "prompt": "b", "max_tokens": 1},
                       headers=headers, timeout=30)  # fmt: skip
    assert again.status_code == 200
