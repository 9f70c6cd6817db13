"""n > 1 and best_of on a mixed worker: a prompt's sequences run as one engine request that
computes the prompt once and forks (workers.server.group_streams), with the tokens of the
separate seeded requests they replace; a client that leaves frees every sequence's blocks."""

from __future__ import annotations

import json

import httpx

from pdrouter.wire.choices import choice_seed
from tests.sse import iter_sse_data
from tests.workers.server.conftest import WorkerHandle

COMPUTED = 'pdworker_prompt_tokens_by_source_total{source="computed"}'
DEVICE = 'pdworker_prompt_tokens_by_source_total{source="device"}'
HOST = 'pdworker_prompt_tokens_by_source_total{source="host"}'
PROMPT = "pdworker_prompt_tokens_total"
GENERATED = "pdworker_generation_tokens_total"
SERVED = 'pdworker_requests_total{endpoint="completion",status="success"}'
COUNTED = (COMPUTED, DEVICE, HOST, PROMPT, GENERATED, SERVED)
PROMPT_IDS = [66 + (i * 5) % 23 for i in range(45)]  # 2 full blocks of 16 and 13 tokens
# The counting test's own prompt (the module's other tests leave PROMPT_IDS's blocks cached).
UNSEEN_PROMPT_IDS = [67 + (i * 7) % 23 for i in range(45)]


def _body(prompt: list[int] = PROMPT_IDS, **kwargs: object) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0.9,
            "ignore_eos": True, **kwargs}  # fmt: skip


def test_n_equals_separate_seeded_requests_and_computes_the_prompt_once(
    worker: WorkerHandle,
) -> None:
    before = worker.wait_idle()
    body = _body(UNSEEN_PROMPT_IDS, n=3, seed=11)
    resp = httpx.post(f"{worker.api_url}/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    answer = resp.json()
    after = worker.wait_idle()
    # The prompt computed once (none of it cached before: a prompt no other test sends) and
    # counted once: no device hit for the later sequences' share of it; the group is one
    # request of 45 prompt tokens and every sequence's 6 generated tokens (its usage).
    delta = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in COUNTED}
    assert delta == {COMPUTED: 45, DEVICE: 0, HOST: 0, PROMPT: 45, GENERATED: 18, SERVED: 1}
    assert after["pdworker_kv_blocks_used"] == 0
    assert answer["usage"]["prompt_tokens"] == 45 and answer["usage"]["completion_tokens"] == 18
    texts = [c["text"] for c in sorted(answer["choices"], key=lambda c: c["index"])]
    separate = [
        httpx.post(f"{worker.api_url}/completions",
                   json=_body(UNSEEN_PROMPT_IDS, seed=choice_seed(11, j)),
                   timeout=60).json()["choices"][0]["text"]
        for j in range(3)
    ]  # fmt: skip
    assert texts == separate and len(set(texts)) == 3


def test_streamed_n_equals_whole_and_best_of_keeps_the_most_likely(
    worker: WorkerHandle,
) -> None:
    body = _body(n=3, seed=4, logprobs=0)
    whole = httpx.post(f"{worker.api_url}/completions", json=body, timeout=60).json()
    texts = {0: "", 1: "", 2: ""}
    with httpx.stream("POST", f"{worker.api_url}/completions", json={**body, "stream": True},
                      timeout=60) as resp:  # fmt: skip
        for data in iter_sse_data(resp):
            if data != "[DONE]":
                for c in json.loads(data)["choices"]:
                    texts[c["index"]] += c["text"]
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}
    best = httpx.post(f"{worker.api_url}/completions", json=_body(n=2, best_of=3, seed=4),
                      timeout=60).json()  # fmt: skip
    likely = sorted(whole["choices"], key=lambda c: -sum(c["logprobs"]["token_logprobs"]))
    assert [c["text"] for c in best["choices"]] == [c["text"] for c in likely[:2]]
    assert best["usage"]["completion_tokens"] == 18
    assert worker.wait_idle()["pdworker_kv_blocks_used"] == 0


def test_stream_closed_early_frees_every_sequence(worker: WorkerHandle) -> None:
    worker.wait_idle()
    body = _body(n=3, seed=2, max_tokens=400, stream=True)
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", f"{worker.api_url}/completions", json=body) as resp,
    ):
        events = iter_sse_data(resp)
        for _ in range(6):
            assert json.loads(next(events))["choices"]
        mid = worker.metrics()
        # 2 shared prompt blocks, 3 own last blocks, maybe a block more each by now
        assert mid["pdworker_kv_blocks_used"] >= 5
    after = worker.wait_idle()
    assert after["pdworker_kv_blocks_used"] == 0
    assert after["pdworker_num_requests_in_flight"] == 0


def test_a_constrained_group_gives_every_sequence_a_valid_answer(worker: WorkerHandle) -> None:
    """n > 1 with a schema: the group's matchers (one per sequence) are built once, off the
    engine thread, and every choice follows the schema."""
    schema = {"type": "object", "properties": {"pet": {"enum": ["cat", "dog"]}},
              "required": ["pet"], "additionalProperties": False}  # fmt: skip
    body = {"model": "tiny", "messages": [{"role": "user", "content": "pet?"}], "n": 3,
            "seed": 5, "temperature": 0.9, "max_tokens": 40,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "p", "schema": schema}}}  # fmt: skip
    resp = httpx.post(f"{worker.api_url}/chat/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    choices = sorted(resp.json()["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1, 2]
    for choice in choices:
        assert choice["finish_reason"] == "stop"
        assert json.loads(choice["message"]["content"])["pet"] in ("cat", "dog")
    assert worker.wait_idle()["pdworker_kv_blocks_used"] == 0
