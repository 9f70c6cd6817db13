"""One large request cannot take the cluster down, on the session's PD cluster.

Before: a 10-million-character prompt (under the old 32 MiB body limit) went to a prefill
worker, which tokenized it on its event loop for seconds: its /health went silent, the router
marked it down, and the requests sent meanwhile got 503. Now the router refuses it at once
(its body bound follows the served context length), the workers bound theirs the same way and
tokenize off their event loop (tests/workers/server/test_large_requests.py holds a worker busy
with a huge legal prompt), and request heads are bounded on every server.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

import httpx
import pytest

from tests.e2e.pd.clients import prompt_ids
from tests.e2e.pd.conftest import MAX_MODEL_LEN, MODEL, PDCluster
from tests.socket_read import read_to_close

pytestmark = pytest.mark.slow

NUM_NORMAL = 20
BIG_PROMPT_CHARS = 10_000_000


async def _watch_health(
    router_url: str, admin: dict[str, str], seen_down: list[str], stop: asyncio.Event
) -> None:
    """Every instance the router lists as not healthy while the requests run."""
    async with httpx.AsyncClient(timeout=30, headers=admin) as http:
        while not stop.is_set():
            for inst in (await http.get(f"{router_url}/instances")).json()["instances"]:
                if not inst["healthy"]:
                    seen_down.append(f"{inst['url']}: {inst['last_error']}")
            with contextlib.suppress(TimeoutError):  # the next poll, or the end at once
                await asyncio.wait_for(stop.wait(), 0.05)


async def test_a_10_mb_prompt_is_refused_and_20_normal_requests_are_served(
    pd_cluster: PDCluster,
) -> None:
    url = pd_cluster.router_url
    admin = {"Authorization": f"Bearer {pd_cluster.cluster.admin_key}"}  # /instances
    big = {"model": MODEL, "prompt": "hello world " * (BIG_PROMPT_CHARS // 12), "max_tokens": 4}
    seen_down: list[str] = []
    stop = asyncio.Event()
    watcher = asyncio.ensure_future(_watch_health(url, admin, seen_down, stop))
    try:
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:

            async def normal(k: int) -> httpx.Response:
                body = {"model": MODEL, "prompt": prompt_ids(24, salt=1300 + k), "max_tokens": 4}
                return await http.post("/v1/completions", json=body)

            answers = await asyncio.gather(
                http.post("/v1/completions", json=big), *(normal(k) for k in range(NUM_NORMAL))
            )
    finally:
        stop.set()
        await watcher
    refused, served = answers[0], answers[1:]
    assert refused.status_code == 400, refused.text[:500]
    error = refused.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in error["message"]
    assert "bytes per token" in error["message"]  # the router's refusal: no worker tokenized it
    assert [resp.status_code for resp in served] == [200] * NUM_NORMAL
    assert seen_down == []
    instances = httpx.get(f"{url}/instances", headers=admin, timeout=30).json()["instances"]
    assert [(i["healthy"], i["breaker"]) for i in instances] == [(True, "closed")] * len(instances)
    models = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
    assert [(m["id"], m["max_model_len"]) for m in models] == [(MODEL, MAX_MODEL_LEN)]


def _raw(base_url: str, head: bytes) -> bytes:
    host, port = base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(head)
        return read_to_close(sock)


def test_request_heads_are_bounded_on_the_router_and_the_workers(pd_cluster: PDCluster) -> None:
    c = pd_cluster.cluster
    many = b"".join(b"X-H%d: v\r\n" % i for i in range(101))
    huge = b"X-Big: " + b"v" * (70 * 1024) + b"\r\n"
    for base_url in (c.router_url, c.prefill_urls[0], c.decode_urls[0]):
        for extra in (many, huge):
            answer = _raw(base_url, b"GET /health HTTP/1.1\r\nHost: t\r\n" + extra + b"\r\n")
            assert answer.startswith(b"HTTP/1.1 431 "), (base_url, answer[:200])
        assert httpx.get(f"{base_url}/health", timeout=30).status_code == 200


def test_the_router_log_has_no_health_check_lines(pd_cluster: PDCluster) -> None:
    log = (pd_cluster.cluster.log_dir / "router.log").read_text()
    assert "cluster fingerprint" in log  # the log is the router's, written at INFO
    assert [line for line in log.splitlines() if " INFO " in line and "/health" in line] == []
