"""One huge request cannot stall a worker.

- The body bound follows the context length (max_model_len x WORKER_BYTES_PER_TOKEN + 64 KiB):
  a longer body is refused with 400 context_length_exceeded before anything tokenizes it.
- A huge prompt that is allowed in (here through an explicit --max-body-bytes) is templated and
  tokenized on the worker's CPU threads (workers/server/cpu_work.py) with the GIL released:
  while it tokenizes, /health and a small request are answered.
"""

from __future__ import annotations

import concurrent.futures
import json
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pdrouter.common.body_limit import DRAIN_MAX_BYTES, ENVELOPE_BYTES, WORKER_BYTES_PER_TOKEN
from tests.socket_read import read_to_close
from tests.workers.server.conftest import MAX_MODEL_LEN, WorkerHandle, start_worker

LIMIT_BYTES = MAX_MODEL_LEN * WORKER_BYTES_PER_TOKEN + ENVELOPE_BYTES
SMALL = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
# 4 million characters: several seconds of tokenization with the tiny byte-level tokenizer.
HUGE_PROMPT_CHARS = 4_000_000


def test_a_body_over_the_derived_limit_is_400_and_the_worker_keeps_serving(
    worker: WorkerHandle,
) -> None:
    big = {**SMALL, "prompt": "x" * LIMIT_BYTES}
    resp = httpx.post(f"{worker.api_url}/completions", json=big, timeout=60)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "context_length_exceeded")
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in error["message"]
    assert f"({LIMIT_BYTES} bytes at {WORKER_BYTES_PER_TOKEN} bytes per token" in error["message"]
    assert "X-Request-Id" in resp.headers
    # Under the bound the body is tokenized and refused by the token count instead.
    fits = {**SMALL, "prompt": "x" * (LIMIT_BYTES - 1000)}
    resp = httpx.post(f"{worker.api_url}/completions", json=fits, timeout=60)
    assert resp.status_code == 400, resp.text
    assert "but the prompt has" in resp.json()["error"]["message"]
    resp = httpx.post(f"{worker.api_url}/completions", json=SMALL, timeout=60)
    assert resp.status_code == 200, resp.text


def test_a_declared_length_far_over_the_limit_is_refused_before_the_body_is_read(
    worker: WorkerHandle,
) -> None:
    """Content-Length says 100 MB (more than a refused body is ever drained): the answer comes
    at once, with only a sliver of the body sent, and the connection closes."""
    host, port = worker.base_url.removeprefix("http://").split(":")
    declared = DRAIN_MAX_BYTES + 1
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json"
            f"\r\nContent-Length: {declared}\r\n\r\n")  # fmt: skip
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(head.encode() + b'{"model": "tiny", "prompt": "' + b"x" * 1000)
        answer = read_to_close(sock, reset_ends=False)
    status_line, _, rest = answer.partition(b"\r\n")
    assert status_line == b"HTTP/1.1 400 Bad Request", answer[:500]
    body = json.loads(rest.partition(b"\r\n\r\n")[2])
    assert body["error"]["code"] == "context_length_exceeded"
    assert f"at least {declared} bytes" in body["error"]["message"]
    assert httpx.get(f"{worker.base_url}/health", timeout=10).status_code == 200


@pytest.fixture(scope="module")
def roomy_worker(
    tmp_path_factory: pytest.TempPathFactory, tiny_cache_dir: Path
) -> Iterator[WorkerHandle]:
    handle = start_worker(
        tmp_path_factory.mktemp("roomy-worker"),
        tiny_cache_dir,
        "--max-body-bytes",
        str(4 * HUGE_PROMPT_CHARS),
        name="pdworker-roomy",
    )
    try:
        yield handle
    finally:
        assert handle.proc is not None
        handle.proc.stop()


def test_health_and_small_requests_are_served_while_a_huge_prompt_tokenizes(
    roomy_worker: WorkerHandle,
) -> None:
    url = roomy_worker.api_url
    huge = {**SMALL, "prompt": "hello world " * (HUGE_PROMPT_CHARS // 12)}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        big = pool.submit(httpx.post, f"{url}/completions", json=huge, timeout=600)
        served_while_busy = 0
        # The race under test: each answer below arrives while the huge prompt is still being
        # tokenized (before the fix the event loop tokenized it and answered nothing else).
        while not big.done() and served_while_busy < 3:
            health = httpx.get(f"{roomy_worker.base_url}/health", timeout=120)
            small = httpx.post(f"{url}/completions", json=SMALL, timeout=120)
            assert (health.status_code, small.status_code) == (200, 200), small.text
            if not big.done():
                served_while_busy += 1
        assert served_while_busy == 3, "the huge prompt finished before 3 small requests"
        resp = big.result()
    assert resp.status_code == 400, resp.text  # millions of tokens do not fit 1024
    assert "but the prompt has" in resp.json()["error"]["message"]
