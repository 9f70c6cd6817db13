"""Answers with the device and pool caches equal a worker that caches nothing, token for token;
usage.prompt_tokens_details.cached_tokens is exact for a cold prompt (D's load of P's handoff
not counted), a pool hit on the other P and a device hit; decode writes the answer back.

The tiny model's tokenizer is byte-level: equal text and equal completion_tokens mean equal
tokens (tests/e2e/pd/test_pd_equivalence.py)."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from pdrouter.launch.cluster import Cluster
from tests.e2e.cache.conftest import (
    BLOCK_SIZE,
    MODEL,
    ask,
    assert_no_blocks_held,
    by_source,
    delta,
)
from tests.e2e.pd.clients import prompt_ids
from tests.metrics_scrape import metrics_of
from tests.wait import wait_until
from tests.workers.server.conftest import WorkerHandle

pytestmark = pytest.mark.slow
MAX_TOKENS = 6


def full_blocks_before_last(num_tokens: int) -> int:
    """Prompt tokens a cache can serve: the full blocks before the last token."""
    return (num_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE


@pytest.mark.parametrize("num_tokens", [BLOCK_SIZE, BLOCK_SIZE + 1, 2 * BLOCK_SIZE + 1, 75])
def test_completions_cold_pool_hit_device_hit_equal_the_reference(
    cache_cluster: Cluster, reference: WorkerHandle, num_tokens: int
) -> None:
    """Three times one fresh prompt: cold on P_a, a pool hit on P_b (its device cache never
    saw it), a device hit on P_a; streamed and not. cached_tokens and the router's by-source
    counts exact each time."""
    kwargs = {"model": MODEL, "prompt": prompt_ids(num_tokens, salt=1600 + num_tokens),
              "max_tokens": MAX_TOKENS, "temperature": 0,
              "extra_body": {"ignore_eos": True}}  # fmt: skip
    expected = ask(reference.base_url, False, False, **kwargs)
    assert expected.cached_tokens == 0
    hit = full_blocks_before_last(num_tokens)
    plan = [(False, "computed", 0), (True, "pool", hit), (False, "device", hit)]
    for stream, source, cached in plan:
        before = by_source(cache_cluster.router_url)
        got = ask(cache_cluster.router_url, False, stream, **kwargs)
        assert got.answer == expected.answer, f"{source} (stream={stream})"
        assert got.cached_tokens == cached, f"{source} (stream={stream})"
        counts = delta(by_source(cache_cluster.router_url), before)
        want = {"device": 0.0, "pool": 0.0, "computed": float(num_tokens - cached)}
        if cached:
            want[source] = float(cached)
        assert counts == want, source
    assert_no_blocks_held(cache_cluster)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_with_a_cached_system_prompt_equals_the_reference(
    cache_cluster: Cluster, reference: WorkerHandle, stream: bool
) -> None:
    system = "".join(chr(c) for c in prompt_ids(70, salt=1700 + stream))
    answers = []
    for question in ("first question?", "second one?", "first question?"):
        kwargs = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0,
                  "messages": [{"role": "system", "content": system},
                               {"role": "user", "content": question}]}  # fmt: skip
        expected = ask(reference.base_url, True, False, **kwargs)
        got = ask(cache_cluster.router_url, True, stream, **kwargs)
        assert got.answer == expected.answer, question
        answers.append(got)
    # The system prompt's full blocks are shared from the second request on (pool, then
    # device), never all of the prompt: the question's blocks differ.
    assert answers[0].cached_tokens == 0
    assert 64 <= answers[1].cached_tokens < answers[1].answer.prompt_tokens
    assert answers[2].cached_tokens == full_blocks_before_last(answers[2].answer.prompt_tokens)
    assert_no_blocks_held(cache_cluster)


def test_concurrent_requests_with_one_new_prefix_are_all_correct(
    cache_cluster: Cluster, reference: WorkerHandle
) -> None:
    prefix = prompt_ids(64, salt=1800)
    prompts = [prefix + prompt_ids(9, salt=1810 + i) for i in range(6)]
    expected = [
        ask(reference.base_url, False, False, model=MODEL, prompt=p, max_tokens=MAX_TOKENS,
            temperature=0, extra_body={"ignore_eos": True}).answer
        for p in prompts
    ]  # fmt: skip

    async def one(prompt: list[int]) -> tuple[str, int, int]:
        client = openai.AsyncOpenAI(base_url=f"{cache_cluster.router_url}/v1", api_key="unused",
                                    max_retries=0, timeout=120)  # fmt: skip
        r = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        return (r.choices[0].text, r.usage.completion_tokens,
                r.usage.prompt_tokens_details.cached_tokens)  # fmt: skip

    async def all_at_once() -> list[tuple[str, int, int]]:
        return await asyncio.gather(*(one(p) for p in prompts))

    results = asyncio.run(all_at_once())
    for (text, n_out, cached), want in zip(results, expected, strict=True):
        assert (text, n_out) == (want.text, want.completion_tokens)
        assert cached in (0, 16, 32, 48, 64)  # whatever was shared when each one started
    assert_no_blocks_held(cache_cluster)


def test_decode_writes_prompt_and_output_blocks_back(cache_cluster: Cluster) -> None:
    """After a request of 40 prompt + 30 output tokens, the pool holds the full blocks of
    the first 69 tokens (the last one has no KV): P wrote blocks 0-1 and the partial block,
    D wrote blocks 2 and 3 back."""
    before_keys = _pool_keys(cache_cluster)
    written = "pdworker_writeback_blocks_total"
    before = sum(metrics_of(u).get(written, 0) for u in cache_cluster.decode_urls)
    ask(cache_cluster.router_url, False, False, model=MODEL, prompt=prompt_ids(40, salt=1900),
        max_tokens=30, temperature=0, extra_body={"ignore_eos": True})  # fmt: skip

    def written_back() -> float:
        return sum(metrics_of(u).get(written, 0) for u in cache_cluster.decode_urls) - before

    assert wait_until(written_back, 30.0, "the write-back", done=lambda n: n >= 2) == 2
    new_keys = _pool_keys(cache_cluster) - before_keys
    assert len(new_keys) == 5 and sum(":partial:" in k for k in new_keys) == 1
    assert_no_blocks_held(cache_cluster)


def _pool_keys(c: Cluster) -> set[str]:
    text = httpx.get(f"{c.master_admin_url}/get_all_keys", timeout=10).text
    return {line.strip() for line in text.splitlines() if line.strip()}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_seeded_sampling_over_cached_blocks_equals_the_reference(
    cache_cluster: Cluster, reference: WorkerHandle, stream: bool
) -> None:
    """Sampling randomness is a function of (seed, position): over a pool hit and a device
    hit the sampled tokens are the reference's."""
    kwargs = {"model": MODEL, "prompt": prompt_ids(41, salt=2100 + stream), "max_tokens": 10,
              "temperature": 0.9, "top_p": 0.95, "seed": 1234,
              "extra_body": {"top_k": 40, "ignore_eos": True}}  # fmt: skip
    expected = ask(reference.base_url, False, False, **kwargs).answer
    cached = [ask(cache_cluster.router_url, False, stream, **kwargs) for _ in range(3)]
    assert [c.answer for c in cached] == [expected] * 3
    assert [c.cached_tokens for c in cached] == [0, 32, 32]  # cold, pool (other P), device
    assert_no_blocks_held(cache_cluster)
