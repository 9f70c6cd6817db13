"""200 concurrent streaming requests across 2 P and 2 D: every one answered in full, none lost,
both of each role used, nothing held afterwards; a sample checked token for token against the
same requests sent one at a time."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from httpx_sse import aconnect_sse

from pdrouter.launcher import Cluster
from tests.chaos.conftest import MODEL, assert_nothing_held
from tests.pd.clients import client, complete, prompt_ids
from tests.pd.conftest import metrics_of

pytestmark = pytest.mark.slow

NUM_REQUESTS = 200
MAX_TOKENS = 16
BOUND_S = 240.0  # the whole load; a lost request would hang the gather past it


def _body(i: int) -> dict:
    return {"model": MODEL, "prompt": prompt_ids(20 + i % 13, salt=100 + i),
            "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip


async def _one(http: httpx.AsyncClient, url: str, i: int) -> tuple[int, str, int, str | None]:
    """(status, text, completion tokens, finish reason) of request i."""
    texts: list[str] = []
    usage, finish = None, None
    async with aconnect_sse(http, "POST", url, json=_body(i)) as source:
        if source.response.status_code != 200:
            await source.response.aread()
            return source.response.status_code, source.response.text, 0, None
        async for event in source.aiter_sse():
            if event.data == "[DONE]":
                break
            data = json.loads(event.data)
            assert "error" not in data, f"request {i}: {data}"
            for choice in data["choices"]:
                texts.append(choice["text"])
                finish = choice["finish_reason"] or finish
            usage = data.get("usage") or usage
    assert usage is not None, f"request {i}: no usage chunk"
    return 200, "".join(texts), usage["completion_tokens"], finish


def _served(urls: list[str], endpoint: str) -> list[float]:
    key = f'pdworker_requests_total{{endpoint="{endpoint}",status="success"}}'
    return [metrics_of(url).get(key, 0) for url in urls]


async def test_200_concurrent_streams_across_2p2d_none_lost(cluster: Cluster) -> None:
    sample = {i: complete(client(cluster.router_url), False,
                          **{k: v for k, v in _body(i).items()
                             if k not in ("stream", "stream_options", "ignore_eos")},
                          extra_body={"ignore_eos": True})
              for i in (0, 57, 133, 199)}  # fmt: skip
    prefill_before = _served(cluster.prefill_urls, "prefill")
    decode_before = _served(cluster.decode_urls, "decode")
    url = f"{cluster.router_url}/v1/completions"
    limits = httpx.Limits(max_connections=NUM_REQUESTS, max_keepalive_connections=NUM_REQUESTS)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(120.0)) as http:
        results = await asyncio.wait_for(
            asyncio.gather(*(_one(http, url, i) for i in range(NUM_REQUESTS))), BOUND_S
        )
    statuses = [status for status, *_ in results]
    assert statuses == [200] * NUM_REQUESTS, [r for r in results if r[0] != 200][:3]
    assert [(n, finish) for _, _, n, finish in results] == [(MAX_TOKENS, "length")] * NUM_REQUESTS
    for i, expected in sample.items():
        assert results[i][1] == expected.text, f"request {i} differs from its sequential run"
    prefill_delta = [a - b for a, b in zip(_served(cluster.prefill_urls, "prefill"),
                                           prefill_before, strict=True)]  # fmt: skip
    decode_delta = [a - b for a, b in zip(_served(cluster.decode_urls, "decode"),
                                          decode_before, strict=True)]  # fmt: skip
    assert sum(prefill_delta) == NUM_REQUESTS and min(prefill_delta) > 0, prefill_delta
    assert sum(decode_delta) == NUM_REQUESTS and min(decode_delta) > 0, decode_delta
    assert_nothing_held(cluster)
