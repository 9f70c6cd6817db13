"""200 streams at full context at once on 1P1D whose engines run 4 sequences: the excess is
refused up front (429 with Retry-After, before any byte of a stream), and every stream that
started ends with [DONE] and its every token; nothing is held afterwards.

The router runs with its defaults (health checks every second, 1 s bound, --abandon-after-s
10): the bound it derives from each worker's /health (2 batches of --max-num-seqs, 2 KV caches
in tokens) is what refuses, not a flag of this test."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from httpx_sse import aconnect_sse

from pdrouter.launch.cluster import Cluster
from pdrouter.launch.spec import ClusterSpec
from tests.e2e.chaos.conftest import MODEL, assert_nothing_held, instance_state
from tests.e2e.cluster_fixture import QUIET_ENV, THROUGH_P, started_cluster
from tests.e2e.pd.clients import prompt_ids
from tests.metrics_scrape import metrics_of

pytestmark = pytest.mark.slow  # a real cluster, like every chaos module

NUM_STREAMS = 200
MAX_NUM_SEQS = 4
NUM_KV_BLOCKS = 128  # 2048 tokens: 4 sequences at full context
MAX_MODEL_LEN = 512
PROMPT_TOKENS = 440
MAX_TOKENS = 64  # prompt + output = 504 of 512: full context
BOUND = 2 * MAX_NUM_SEQS  # the router's default in-flight bound of each instance
BOUND_S = 240.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, chaos_cache_dir: Path) -> Iterator[Cluster]:
    spec = ClusterSpec(
        model=MODEL,
        num_prefill=1,
        num_decode=1,
        pool_size="128MiB",
        worker_args=(
            "--block-size=16",
            f"--num-kv-blocks={NUM_KV_BLOCKS}",
            f"--max-model-len={MAX_MODEL_LEN}",
            f"--max-num-seqs={MAX_NUM_SEQS}",
            f"--model-cache-dir={chaos_cache_dir}",
        ),
        router_args=THROUGH_P,
        env=QUIET_ENV,
        log_dir=str(tmp_path_factory.mktemp("chaos-overload-logs")),
        startup_timeout_s=240.0,
    )
    yield from started_cluster(spec)


def _body(i: int) -> dict:
    return {"model": MODEL, "prompt": prompt_ids(PROMPT_TOKENS, salt=500 + i),
            "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip


async def _one(http: httpx.AsyncClient, url: str, i: int) -> tuple[int, dict]:
    """(status, what came): a refusal's head and error, or a stream's events."""
    async with aconnect_sse(http, "POST", url, json=_body(i)) as source:
        resp = source.response
        if resp.status_code != 200:
            await resp.aread()
            return resp.status_code, {"retry_after": resp.headers.get("Retry-After"),
                                      "error": resp.json()["error"]}  # fmt: skip
        events = [event.data async for event in source.aiter_sse()]
    return 200, {"events": events}


def _stream_outcome(events: list[str]) -> tuple[bool, int, list[str]]:
    """(ended with [DONE], completion tokens, in-band errors) of a started stream."""
    errors: list[str] = []
    tokens = 0
    for data in events:
        if data == "[DONE]":
            continue
        chunk = json.loads(data)
        if "error" in chunk:
            errors.append(chunk["error"]["message"])
        elif chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
    return bool(events) and events[-1] == "[DONE]", tokens, errors


def test_streams_over_capacity_refused_up_front_and_no_started_stream_broken(
    cluster: Cluster,
) -> None:
    for url in (*cluster.prefill_urls, *cluster.decode_urls):
        state = instance_state(cluster, url)
        assert state["max_num_seqs"] == MAX_NUM_SEQS  # reported, so the bound follows it

    async def run() -> list[tuple[int, dict]]:
        limits = httpx.Limits(max_connections=NUM_STREAMS + 10)
        async with httpx.AsyncClient(timeout=BOUND_S, limits=limits) as http:
            url = f"{cluster.router_url}/v1/completions"
            return await asyncio.gather(*(_one(http, url, i) for i in range(NUM_STREAMS)))

    results = asyncio.run(asyncio.wait_for(run(), BOUND_S))
    started = [what for status, what in results if status == 200]
    refused = [what for status, what in results if status != 200]
    broken = []
    for what in started:
        done, tokens, errors = _stream_outcome(what["events"])
        if not done or tokens != MAX_TOKENS or errors:
            broken.append((done, tokens, errors))
    assert broken == [], f"{len(broken)} of {len(started)} started streams broken: {broken[:3]}"
    assert {status for status, _ in results} <= {200, 429}
    for what in refused:
        assert what["retry_after"] == "1"
        assert (what["error"]["type"], what["error"]["code"]) == ("rate_limit_error", "overloaded")
    # The first BOUND to arrive always find room; waves of BOUND at a time cannot serve half.
    assert len(started) >= BOUND
    assert len(refused) >= NUM_STREAMS // 2
    metrics = metrics_of(cluster.router_url)
    rejected = sum(v for k, v in metrics.items() if k.startswith("pdrouter_rejected_total"))
    assert rejected == len(refused)
    assert not any("InstanceDown" in k for k in metrics)
    assert_nothing_held(cluster)
