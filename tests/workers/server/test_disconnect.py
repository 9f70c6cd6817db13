"""A client that goes away mid-request has its engine request aborted and its KV blocks freed,
seen from outside through /metrics, as an operator would see it."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.sse import iter_sse_data
from tests.workers.server.conftest import MAX_MODEL_LEN, WorkerHandle

PROMPT_IDS = [65 + i % 26 for i in range(40)]
# Long enough that the engine is still generating when the client leaves.
MAX_TOKENS = MAX_MODEL_LEN - len(PROMPT_IDS) - 1
ABORTED = 'pdworker_requests_total{endpoint="completion",status="aborted"}'


def _body(stream: bool) -> dict:
    return {"model": "tiny", "prompt": PROMPT_IDS, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": stream}  # fmt: skip


def test_stream_closed_early_aborts_and_frees_blocks(worker: WorkerHandle) -> None:
    before = worker.wait_idle()
    assert before["pdworker_kv_blocks_used"] == 0
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", f"{worker.api_url}/completions", json=_body(stream=True)) as resp,
    ):
        assert resp.status_code == 200
        # One live iterator: abandoning it closes the connection when the `with` ends.
        events = iter_sse_data(resp)
        for _ in range(3):
            assert json.loads(next(events))["choices"]
        mid = worker.metrics()
        # The request is alive and holds the blocks of its prompt (40 tokens: 3 blocks of 16).
        assert mid["pdworker_num_requests_in_flight"] == 1
        assert mid["pdworker_kv_blocks_used"] >= 3
    # Leaving the `with` closed the connection after three events.
    after = worker.wait_idle()
    assert after["pdworker_kv_blocks_used"] == 0
    assert after["pdworker_num_requests_running"] == 0
    assert after["pdworker_num_requests_in_flight"] == 0
    assert after[ABORTED] - before.get(ABORTED, 0) == 1
    generated = (
        after["pdworker_generation_tokens_total"] - before["pdworker_generation_tokens_total"]
    )
    assert 3 <= generated < MAX_TOKENS


def test_non_stream_client_timeout_aborts_and_frees_blocks(worker: WorkerHandle) -> None:
    before = worker.wait_idle()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{worker.api_url}/completions", json=_body(stream=False), timeout=0.5)
    # On a busy machine the server may only now be admitting the request: wait for its end.
    worker.wait_until(lambda m: m.get(ABORTED, 0) - before.get(ABORTED, 0) >= 1)
    after = worker.wait_idle()
    assert after["pdworker_kv_blocks_used"] == 0
    assert after["pdworker_num_requests_in_flight"] == 0
    assert after[ABORTED] - before.get(ABORTED, 0) == 1
    generated = (
        after["pdworker_generation_tokens_total"] - before["pdworker_generation_tokens_total"]
    )
    assert generated < MAX_TOKENS


def test_worker_serves_normally_after_disconnects(worker: WorkerHandle) -> None:
    resp = httpx.post(f"{worker.api_url}/completions", timeout=60,
                      json={**_body(stream=False), "max_tokens": 4})  # fmt: skip
    assert resp.status_code == 200
    usage = resp.json()["usage"]
    # The prompt's 2 full blocks before its last token are a device hit when another test of
    # this module ran it first (any order): cached_tokens says which.
    cached = usage.pop("prompt_tokens_details")["cached_tokens"]
    assert usage == {"prompt_tokens": 40, "completion_tokens": 4, "total_tokens": 44}
    assert cached in (0, 32)
