"""Limits that mean what they say, across real processes (master + pool owner + 1 P + 1 D +
router with an API keys file): what a key is charged, what a request may reserve, what
priority a key may claim, what a request may carry.

    a stream its client leaves     charged the tokens it was sent (status 499), not refunded
    a request past a key's bucket  400 naming both numbers (it could never pass)
    a request past D's side        400 (bigger than the KV the decode side ever holds) or
                                   past --max-request-tokens: 400; two that together exceed
                                   it: the second 429 reporting what is held
    a batch past P's calls         400, on an idle cluster (its calls could never fit)
    X-Priority past max_priority   clamped to the key's cap: the priority P and D were sent
    stop_token_ids past the cap    400 naming it, before P starts
    the tokenizer routes           counted against the key's requests per minute

D's side here: --num-kv-blocks 64 x --block-size 16 = 1024 tokens of KV, one batch of it
(--batches-in-flight-per-instance 1): 1024 tokens; --max-num-seqs 2: 2 calls per instance.
The prompt is 8 token ids, which the router estimates as 9 tokens before P counts them.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdrouter.launch.cluster import Cluster
from pdrouter.launch.spec import ClusterSpec
from pdrouter.wire.request_bounds import MAX_STOP_TOKEN_IDS
from tests.e2e.cluster_fixture import QUIET_ENV, THROUGH_P, started_cluster, timeline
from tests.wait import wait_until

D_TOKENS = 1024  # 1 x 64 blocks x 16 tokens
ESTIMATE = 9  # the router's estimate of PROMPT_IDS (4 characters' worth per id, + 1)
MAX_REQUEST_TOKENS = 3000
KEYS = {"keys": [
    {"id": "meter", "key": "sk-meter", "tokens_per_minute": 2000},
    {"id": "free", "key": "sk-free"},
    {"id": "capped", "key": "sk-capped", "priority": 5},
    {"id": "ranked", "key": "sk-ranked", "priority": 5, "max_priority": -2},
    {"id": "tok", "key": "sk-tok", "requests_per_minute": 2},
]}  # fmt: skip
PROMPT_IDS = [11, 12, 13, 14, 15, 16, 17, 18]  # the prompt as token ids: its count exact


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, tiny_cache_dir: Path) -> Iterator[Cluster]:
    keys_path = tmp_path_factory.mktemp("limit-keys") / "keys.json"
    keys_path.write_text(json.dumps(KEYS))
    spec = ClusterSpec(
        model="tiny",
        num_prefill=1,
        num_decode=1,
        pool_size="64MiB",
        worker_args=("--block-size=16", "--num-kv-blocks=64", "--max-model-len=512",
                     "--max-num-seqs=2", f"--model-cache-dir={tiny_cache_dir}"),
        router_args=(*THROUGH_P, "--health-interval-s=0.5", f"--api-keys-file={keys_path}",
                     "--api-keys-reload-s=3600", "--batches-in-flight-per-instance=1",
                     f"--max-request-tokens={MAX_REQUEST_TOKENS}"),
        env=QUIET_ENV,
        log_dir=str(tmp_path_factory.mktemp("limit-logs")),
        startup_timeout_s=240.0,
    )  # fmt: skip
    yield from started_cluster(spec)


def _metrics(c: Cluster, url: str) -> dict[str, float]:
    """url's samples as {'name{label="v",...}': value} (read with the admin key)."""
    text = httpx.get(f"{url}/metrics", headers=_auth(c.admin_key), timeout=10).text
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}"] = s.value
    return samples


def _router_metrics(c: Cluster) -> dict[str, float]:
    return _metrics(c, c.router_url)


def _prefill_requests(c: Cluster) -> float:
    """Every request P counted, whatever its status."""
    samples = _metrics(c, c.prefill_urls[0])
    return sum(v for k, v in samples.items() if k.startswith("pdworker_requests_total{"))


def _completion(c: Cluster, key: str, **body: object) -> httpx.Response:
    body = {"model": "tiny", "prompt": PROMPT_IDS, "temperature": 0, **body}
    return httpx.post(f"{c.router_url}/v1/completions", json=body, headers=_auth(key),
                      timeout=120)  # fmt: skip


def test_a_stream_its_client_leaves_is_charged_what_it_was_sent(cluster: Cluster) -> None:
    body = {"model": "tiny", "prompt": PROMPT_IDS, "max_tokens": 400, "ignore_eos": True,
            "temperature": 0, "stream": True}  # fmt: skip
    num_chunks = 0
    with httpx.stream("POST", f"{cluster.router_url}/v1/completions", json=body,
                      headers=_auth("sk-meter"), timeout=120) as resp:  # fmt: skip
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                num_chunks += 1
                if num_chunks == 5:
                    break  # the client leaves with 5 tokens of its 400
    left = 'pdrouter_api_key_requests_total{key_id="meter",status="499"}'
    samples = wait_until(lambda: _router_metrics(cluster), 30, "the stream's end counted",
                         done=lambda m: m.get(left) == 1)  # fmt: skip
    generated = samples['pdrouter_api_key_tokens_total{key_id="meter",kind="generation"}']
    assert samples['pdrouter_api_key_tokens_total{key_id="meter",kind="prompt"}'] == 8
    assert 5 <= generated <= 400  # at least what the client read, charged, not refunded


def test_a_request_past_its_keys_bucket_is_a_400_naming_both_numbers(cluster: Cluster) -> None:
    resp = _completion(cluster, "sk-meter", max_tokens=300, n=8)  # 9 + 8 x 300 > 2000
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert (error["type"], error["param"], error["code"]) == (
        "invalid_request_error", "max_tokens", "request_too_large")  # fmt: skip
    assert error["message"] == (
        "this request may use 2409 tokens (its prompt plus max_tokens, or what the context "
        "leaves, times its sequences), more than API key 'meter' may use in a minute (2000, "
        "tokens_per_minute); lower max_tokens or n"
    )


def test_a_chat_without_max_tokens_is_charged_what_the_context_leaves(cluster: Cluster) -> None:
    """Its budget is the context less the prompt's estimate (512 - 1 for "hi"), per sequence:
    4 x 511 + 1 is past the key's 2,000 tokens a minute."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": 4}
    resp = httpx.post(f"{cluster.router_url}/v1/chat/completions", json=body,
                      headers=_auth("sk-meter"), timeout=120)  # fmt: skip
    assert resp.status_code == 400
    assert resp.json()["error"]["message"].startswith(
        "this request may use 2045 tokens (its prompt plus max_tokens, or what the context "
        "leaves, times its sequences), more than API key 'meter' may use in a minute (2000,"
    )


def test_a_request_larger_than_the_decode_side_or_the_flag_is_a_400(cluster: Cluster) -> None:
    past_d = _completion(cluster, "sk-free", max_tokens=100, n=16)  # 9 + 16 x 100 = 1609
    assert past_d.status_code == 400
    error = past_d.json()["error"]
    assert (error["param"], error["code"]) == ("max_tokens", "request_too_large")
    assert error["message"].startswith(
        "this request may hold 1609 tokens (its prompt plus max_tokens, or what the context "
        f"leaves, times its sequences), more than the decode side can ever hold: {D_TOKENS} "
        "tokens (1 instances,"
    )
    past_flag = _completion(cluster, "sk-free", max_tokens=400, n=8)  # 3209 > 3000
    assert past_flag.status_code == 400
    assert past_flag.json()["error"]["message"].startswith(
        f"this request may hold 3209 tokens (its prompt plus max_tokens, or what the context "
        f"leaves, times its sequences), more than the {MAX_REQUEST_TOKENS} one request may "
        "hold (--max-request-tokens)"
    )


def test_two_requests_that_together_exceed_the_decode_side_the_second_429s(
    cluster: Cluster,
) -> None:
    """D frozen (SIGSTOP) so that the first request stays in flight past P's first token
    (the tiny model would otherwise finish it before the second arrives); the second comes
    while the router still counts D healthy."""
    body = {"model": "tiny", "prompt": PROMPT_IDS, "max_tokens": 300, "n": 2,
            "ignore_eos": True, "temperature": 0, "stream": True}  # fmt: skip
    decode = cluster.child("decode-0").proc
    assert decode is not None
    decode.freeze()
    try:
        with httpx.stream(
            "POST",
            f"{cluster.router_url}/v1/completions",
            json=body,
            headers=_auth("sk-free"),
            timeout=120,
        ) as first:  # 9 + 2 x 300
            assert first.status_code == 200  # P's first tokens: the head is out
            second = _completion(cluster, "sk-free", max_tokens=300, n=2)
            decode.signal(signal.SIGCONT)
            assert second.status_code == 429
            assert second.headers["Retry-After"] == "1"
            error = second.json()["error"]
            assert (error["type"], error["code"]) == ("rate_limit_error", "overloaded")
            assert error["message"] == (
                f"the decode side is full: requests in flight hold 609 of its {D_TOKENS} "
                "tokens and this request may hold 609 (its prompt plus max_tokens, or what "
                "the context leaves, times its sequences); retry later"
            )
    finally:
        decode.signal(signal.SIGCONT)
    # The first left: its reservation is back, and the same request passes.
    again = wait_until(lambda: _completion(cluster, "sk-free", max_tokens=300, n=2), 60,
                       "the first request's tokens given back",
                       done=lambda r: r.status_code == 200)  # fmt: skip
    assert len(again.json()["choices"]) == 2


def test_a_batch_whose_prefill_calls_can_never_fit_is_a_400_on_an_idle_cluster(
    cluster: Cluster,
) -> None:
    prompts = [[20 + i, 21, 22, 23] for i in range(3)]  # 3 calls at once; P takes 2
    resp = _completion(cluster, "sk-free", prompt=prompts, max_tokens=0, echo=True, logprobs=1)
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert (error["param"], error["code"]) == ("prompt", "request_too_large")
    assert error["message"] == (
        "this request makes 3 prefill calls at once (one per prompt and sequence), more than "
        "its 1 prefill instances ever take at once (2 calls); send fewer prompts per request"
    )
    fits = _completion(cluster, "sk-free", prompt=prompts[:2], max_tokens=0, echo=True,
                       logprobs=1)  # fmt: skip
    assert fits.status_code == 200 and len(fits.json()["choices"]) == 2


@pytest.mark.parametrize(
    ("key", "headers", "field", "sent"),
    [
        ("sk-capped", {"X-Priority": "-1000"}, None, 5),  # max_priority: its own default
        ("sk-capped", {}, -3, 5),  # the body's field is capped too
        ("sk-capped", {"X-Priority": "9"}, None, 9),  # less urgent: as asked
        ("sk-ranked", {"X-Priority": "-1000"}, None, -2),
        ("sk-ranked", {"X-Priority": "-1"}, None, -1),
        ("sk-ranked", {}, None, 5),
    ],
)
def test_a_keys_priority_is_clamped_to_its_max_priority(
    cluster: Cluster, key: str, headers: dict[str, str], field: int | None, sent: int
) -> None:
    request_id = f"prio-{key}-{headers.get('X-Priority')}-{field}"
    body: dict[str, object] = {"model": "tiny", "prompt": PROMPT_IDS, "max_tokens": 2}
    if field is not None:
        body["priority"] = field
    resp = httpx.post(f"{cluster.router_url}/v1/completions", json=body, timeout=120,
                      headers={**_auth(key), **headers, "X-Request-Id": request_id})  # fmt: skip
    assert resp.status_code == 200
    assert timeline(cluster, request_id)["priority"] == sent


def test_stop_token_ids_past_the_cap_are_refused_before_p(cluster: Cluster) -> None:
    before = _prefill_requests(cluster)
    resp = _completion(
        cluster, "sk-free", max_tokens=2, stop_token_ids=[1] * (MAX_STOP_TOKEN_IDS + 1)
    )
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", "stop_token_ids")
    assert (
        f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids (got {MAX_STOP_TOKEN_IDS + 1})"
        in (error["message"])
    )
    assert _prefill_requests(cluster) == before  # refused by the router: P never saw it
    at_cap = _completion(cluster, "sk-free", max_tokens=2, stop_token_ids=[1] * MAX_STOP_TOKEN_IDS)
    assert at_cap.status_code == 200
    assert _prefill_requests(cluster) == before + 1  # P counts what reaches it


def test_the_tokenizer_routes_count_against_the_keys_requests_per_minute(
    cluster: Cluster,
) -> None:
    url, tok = cluster.router_url, _auth("sk-tok")
    first = httpx.post(f"{url}/tokenize", json={"model": "tiny", "prompt": "hi"}, headers=tok)
    second = httpx.get(f"{url}/tokenizer_info", headers=tok)
    assert (first.status_code, second.status_code) == (200, 200)
    third = httpx.post(f"{url}/detokenize", json={"model": "tiny", "tokens": [11]}, headers=tok)
    assert third.status_code == 429
    error = third.json()["error"]
    assert (error["param"], error["code"]) == ("requests_per_minute", "rate_limit_exceeded")
    assert 1 <= int(third.headers["Retry-After"]) <= 30
    refused = _completion(cluster, "sk-tok", max_tokens=2)  # the same bucket
    assert refused.status_code == 429
