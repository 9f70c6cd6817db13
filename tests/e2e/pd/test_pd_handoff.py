"""The handoff itself: the keys P writes, D's answer to missing blocks, ids across hops,
disconnects, and errors a worker raises on the router's behalf."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pdrouter.common.auth import INTERNAL_SECRET_HEADER
from pdrouter.launch.cluster import Cluster
from pdrouter.wire.pd import DecodeEvent, DecodeRequest, PrefillRequest, PrefillResult
from tests.e2e.chaos.raw_client import RawRequest
from tests.e2e.pd.clients import client, complete, prompt_ids
from tests.e2e.pd.conftest import (
    BLOCK_SIZE,
    MAX_MODEL_LEN,
    MODEL,
    PREFILL_CHUNK_TOKENS,
    PDCluster,
    metrics_of,
    wait_blocks_free,
)
from tests.sse import iter_sse_data, sse_data
from tests.wait import wait_until
from workers.pool.keys import block_keys, shard_key

pytestmark = pytest.mark.slow


def _secret(c: Cluster) -> dict[str, str]:
    """The header the launched workers require on /internal/* (the router sends it too)."""
    return {INTERNAL_SECRET_HEADER: c.internal_secret}


def _prefill(c: Cluster, url: str, request_id: str, body: dict) -> PrefillResult:
    req = PrefillRequest(request_id=request_id, endpoint="completions", body=body)
    resp = httpx.post(f"{url}/internal/prefill", json=req.model_dump(), timeout=60,
                      headers={"X-Request-Id": request_id, **_secret(c)})  # fmt: skip
    assert resp.status_code == 200, resp.text
    return PrefillResult.model_validate(resp.json())


def _decode(
    c: Cluster, url: str, body: dict, result: PrefillResult, policy: str | None
) -> httpx.Response:
    req = DecodeRequest(
        request_id=result.request_id + "-d", endpoint="completions", body=body,
        prompt_token_ids=result.prompt_token_ids, output_token_ids=[result.first_token_id],
        kv=result.kv, missing_kv_policy=policy,
    )  # fmt: skip
    return httpx.post(f"{url}/internal/decode", json=req.model_dump(), timeout=60,
                      headers=_secret(c))  # fmt: skip


def _events(resp: httpx.Response) -> list[DecodeEvent]:
    assert resp.status_code == 200, resp.text
    return [DecodeEvent.model_validate_json(data) for data in sse_data(resp)]


@pytest.fixture(scope="module")
def pool_client(pd_cluster: PDCluster) -> Iterator[object]:
    """A real pool client in this process (TCP), for removing keys as eviction would."""
    from workers.pool.client import KVPoolClient, PoolClientConfig

    addrs = pd_cluster.cluster.pool_addresses
    config = PoolClientConfig(master_addr=addrs.master_addr, metadata_url=addrs.metadata_url,
                              num_slots=1, slot_bytes=4096)  # fmt: skip
    with KVPoolClient(config) as pool:
        yield pool


def _remove(pool: object, keys: list[str], timeout_s: float = 10.0) -> None:
    """Remove keys, waiting out read leases (they expire by themselves)."""
    wait_until(
        lambda: pool.remove(keys).ok,  # type: ignore[attr-defined]
        timeout_s,
        "the keys' read leases to expire so they can be removed",
        interval_s=0.1,
    )
    assert pool.exists(keys) == [False] * len(keys)  # type: ignore[attr-defined]


def test_pool_holds_exactly_the_full_and_partial_keys(pd_cluster: PDCluster) -> None:
    p_url = pd_cluster.cluster.prefill_urls[0]
    prompt = prompt_ids(3 * BLOCK_SIZE + 5, salt=71)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    before = pd_cluster.pool_keys()
    result = _prefill(pd_cluster.cluster, p_url, "keys-1", body)
    expected = block_keys(pd_cluster.fingerprint(), prompt, BLOCK_SIZE)
    assert len(expected) == 4 and expected[-1].endswith(":partial:5")
    assert result.kv is not None and result.kv.keys == expected
    assert result.kv.num_tokens == len(prompt) and result.prompt_token_ids == prompt
    assert (result.num_blocks_written, result.num_blocks_skipped) == (4, 0)
    # One object per block: tp=1 workers write a shard of all the tiny model's 2 KV heads.
    assert pd_cluster.pool_keys() - before == {shard_key(k, 0, 2, 2) for k in expected}
    assert wait_blocks_free(p_url) == 0  # P released its blocks once the write was confirmed
    # The same prompt again writes nothing: every key is in the pool already.
    again = _prefill(pd_cluster.cluster, pd_cluster.cluster.prefill_urls[1], "keys-2", body)
    assert (again.num_blocks_written, again.num_blocks_skipped, again.num_bytes_written) == (
        0, 4, 0,
    )  # fmt: skip


def test_a_chunked_prompt_is_written_while_its_later_chunks_compute(pd_cluster: PDCluster) -> None:
    c = pd_cluster.cluster
    p_url = c.prefill_urls[0]
    prompt = prompt_ids(300, salt=1773)  # chunks of 64 tokens: four full ones, then 44 tokens
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    early = "pdworker_pool_blocks_written_early_total"
    before = metrics_of(p_url)[early]
    result = _prefill(c, p_url, "chunked-1", body)
    expected = block_keys(pd_cluster.fingerprint(), prompt, BLOCK_SIZE)
    assert result.kv is not None and result.kv.keys == expected and len(expected) == 19
    assert (result.num_blocks_written, result.num_blocks_skipped) == (19, 0)
    # The 16 blocks of the first four chunks were handed over before the last chunk ended.
    assert metrics_of(p_url)[early] - before == 4 * PREFILL_CHUNK_TOKENS // BLOCK_SIZE
    assert wait_blocks_free(p_url) == 0  # blocks and their pins went back
    events = _events(_decode(c, c.decode_urls[0], body, result, None))
    assert events[-1].num_blocks_loaded == 19 and events[-1].num_tokens_recomputed == 0
    text = result.first_text + "".join(e.text for e in events)
    mixed = complete(client(pd_cluster.mixed_url), False, **body)
    assert (text, events[-1].num_output_tokens) == (mixed.text, mixed.completion_tokens)


def test_missing_blocks_are_recomputed_with_the_same_output(
    pd_cluster: PDCluster, pool_client: object
) -> None:
    c = pd_cluster.cluster
    prompt = prompt_ids(3 * BLOCK_SIZE + 5, salt=72)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    result = _prefill(c, c.prefill_urls[0], "evict-1", body)
    assert result.kv is not None
    _remove(pool_client, [shard_key(result.kv.keys[1], 0, 2, 2)])  # a hole after the first block
    events = _events(_decode(c, c.decode_urls[0], body, result, None))
    final = events[-1]
    assert final.finished and final.finish_reason == "length"
    assert (final.num_blocks_loaded, final.num_tokens_recomputed) == (1, len(prompt) - BLOCK_SIZE)
    text = result.first_text + "".join(e.text for e in events)
    mixed = complete(client(pd_cluster.mixed_url), False, **body)
    assert (text, final.num_output_tokens) == (mixed.text, mixed.completion_tokens)
    assert wait_blocks_free(c.decode_urls[0]) == 0


def test_missing_blocks_under_fail_policy_give_502_naming_them(
    pd_cluster: PDCluster, pool_client: object
) -> None:
    c = pd_cluster.cluster
    prompt = prompt_ids(2 * BLOCK_SIZE + 3, salt=73)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    result = _prefill(c, c.prefill_urls[1], "fail-1", body)
    assert result.kv is not None
    missing = result.kv.keys[2]
    _remove(pool_client, [shard_key(missing, 0, 2, 2)])
    resp = _decode(c, c.decode_urls[1], body, result, "fail")
    assert resp.status_code == 502
    error = resp.json()["error"]
    assert error["missing_keys"] == [missing]
    assert error["message"] == (
        "1 of 3 KV blocks could not be read from the pool (policy fail); first missing: " + missing
    )
    assert wait_blocks_free(c.decode_urls[1]) == 0  # the blocks it had allocated went back


def test_one_request_id_on_every_hop(pd_cluster: PDCluster) -> None:
    rid = "pd-hop-42"
    resp = httpx.post(
        f"{pd_cluster.router_url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hop"}], "max_tokens": 3},
        headers={"X-Request-Id": rid},
        timeout=60,
    )
    assert resp.status_code == 200, resp.text
    assert resp.headers["X-Request-Id"] == rid and resp.json()["id"] == f"chatcmpl-{rid}"
    logs = Path(pd_cluster.cluster.log_dir)
    p_logs = "".join((logs / f"prefill-{i}.log").read_text() for i in range(2))
    d_logs = "".join((logs / f"decode-{i}.log").read_text() for i in range(2))
    assert f"prefill {rid}: " in p_logs and f"decode {rid}: " in d_logs
    router_log = (logs / "router.log").read_text()
    line = next(ln for ln in router_log.splitlines() if f"request {rid}: " in ln)
    c = pd_cluster.cluster
    assert any(f"prefill {u}, decode " in line for u in c.prefill_urls), line
    assert any(line.endswith(f"decode {u}") for u in c.decode_urls), line


def test_client_disconnect_mid_stream_frees_decode_blocks(pd_cluster: PDCluster) -> None:
    body = {"model": MODEL, "prompt": prompt_ids(70, salt=74), "max_tokens": 300,
            "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
    with httpx.stream("POST", f"{pd_cluster.router_url}/v1/completions", json=body,
                      timeout=60) as resp:  # fmt: skip
        assert resp.status_code == 200
        events = iter_sse_data(resp)
        chunks = [json.loads(next(events)) for _ in range(3)]
        assert all(chunk["choices"] for chunk in chunks)  # three tokens, then the client leaves
    for url in pd_cluster.cluster.decode_urls + pd_cluster.cluster.prefill_urls:
        assert wait_blocks_free(url) == 0, f"{url} kept the blocks of a gone client"


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"model": MODEL, "prompt": prompt_ids(MAX_MODEL_LEN + 1)}, "prompt",
         "context_length_exceeded"),
        ({"model": "no-such-model", "prompt": "hi"}, "model", "model_not_found"),
    ],
)  # fmt: skip
def test_prefill_rejections_reach_the_client_as_400(
    pd_cluster: PDCluster, body: dict, param: str, code: str
) -> None:
    resp = httpx.post(f"{pd_cluster.router_url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["param"], error["code"], error["type"]) == (
        param, code, "invalid_request_error",
    )  # fmt: skip


def test_router_models_and_health_reflect_the_cluster(pd_cluster: PDCluster) -> None:
    models = client(pd_cluster.router_url).models.list()
    assert [m.id for m in models.data] == [MODEL]
    health = httpx.get(f"{pd_cluster.router_url}/health", timeout=10)
    assert health.status_code == 200
    body = health.json()
    assert (body["status"], body["num_prefill_healthy"], body["num_decode_healthy"]) == (
        "ok", 2, 2,
    )  # fmt: skip
    worker_fp = httpx.get(f"{pd_cluster.cluster.prefill_urls[0]}/health").json()["fingerprint"]
    assert body["fingerprint"] == worker_fp
    for url in pd_cluster.cluster.prefill_urls + pd_cluster.cluster.decode_urls:
        worker = httpx.get(f"{url}/health").json()  # CPU workers: the host path, and why
        assert (worker["handoff_path"], worker["handoff_path_reason"]) == (
            "host", "the KV cache is not on a GPU",
        )  # fmt: skip
        paths = metrics_of(url)
        assert (paths['pdworker_handoff_path{path="host"}'],
                paths['pdworker_handoff_path{path="device"}']) == (1, 0)  # fmt: skip


def test_non_stream_client_leaving_aborts_the_decode(pd_cluster: PDCluster) -> None:
    c = pd_cluster.cluster
    key = 'pdworker_requests_total{endpoint="decode",status="aborted"}'
    aborted_before = sum(metrics_of(u).get(key, 0) for u in c.decode_urls)
    body = {"model": MODEL, "prompt": prompt_ids(70, salt=75),
            "max_tokens": MAX_MODEL_LEN - 70, "temperature": 0, "ignore_eos": True}  # fmt: skip
    # The client leaves once D is decoding (not after a read timeout: on an idle machine the
    # whole answer can come within any fixed timeout).
    req = RawRequest(f"{pd_cluster.router_url}/v1/completions", body)
    try:
        wait_until(
            lambda: any(metrics_of(u)["pdworker_num_requests_running"] for u in c.decode_urls),
            20.0,
            "D decoding",
            interval_s=0.0,
        )
    finally:
        req.close()
    for url in c.decode_urls + c.prefill_urls:
        assert wait_blocks_free(url) == 0, f"{url} kept the blocks of a gone client"
    assert sum(metrics_of(u).get(key, 0) for u in c.decode_urls) == aborted_before + 1


def test_launched_workers_refuse_internal_calls_without_the_clusters_secret(
    pd_cluster: PDCluster,
) -> None:
    """The launcher gives router and workers a random secret, through the environment."""
    c = pd_cluster.cluster
    assert len(c.internal_secret) >= 32
    req = PrefillRequest(request_id="no-secret", endpoint="completions", body={"prompt": "hi"})
    for url in c.prefill_urls + c.decode_urls:
        for path in ("/internal/prefill", "/internal/decode"):
            resp = httpx.post(f"{url}{path}", json=req.model_dump(), timeout=10)
            assert resp.status_code == 401, resp.text
            assert resp.json()["error"]["code"] == "invalid_secret"
    for child in c.children:
        assert child.proc is not None
        cmdline = Path(f"/proc/{child.proc.pid}/cmdline").read_bytes()
        assert c.internal_secret.encode() not in cmdline, f"{child.name} shows the secret"
