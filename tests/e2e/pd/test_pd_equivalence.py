"""PD answers equal the colocated (mixed) worker's, token for token.

The tiny model's tokenizer is byte-level, so equal text plus equal completion_tokens means equal
tokens (up to invalid UTF-8 bytes, which both sides render with the same replacement).
"""

from __future__ import annotations

import asyncio

import pytest

from tests.e2e.pd.clients import Answer, async_client, chat, client, complete, prompt_ids
from tests.e2e.pd.conftest import BLOCK_SIZE, MODEL, PDCluster, metrics_of, wait_blocks_free

PROMPT_LENGTHS = [1, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, 3 * BLOCK_SIZE + 5, 300]
MAX_TOKENS = 8


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("num_tokens", PROMPT_LENGTHS)
def test_completion_greedy_equals_mixed(pd_cluster: PDCluster, num_tokens: int, stream: bool):
    kwargs = {"model": MODEL, "prompt": prompt_ids(num_tokens, salt=num_tokens),
              "max_tokens": MAX_TOKENS, "temperature": 0}  # fmt: skip
    pd = complete(client(pd_cluster.router_url), stream, **kwargs)
    mixed = complete(client(pd_cluster.mixed_url), False, **kwargs)
    assert pd == mixed
    assert pd.prompt_tokens == num_tokens
    assert pd.completion_tokens == MAX_TOKENS and pd.finish_reason == "length"


def _chat_overhead_tokens(pd_cluster: PDCluster) -> int:
    """Template tokens around one user message: prompt_tokens of content 'x' minus one."""
    answer = chat(client(pd_cluster.mixed_url), False, model=MODEL, max_tokens=1,
                  messages=[{"role": "user", "content": "x"}])  # fmt: skip
    return answer.prompt_tokens - 1


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_greedy_equals_mixed_at_block_boundaries(pd_cluster: PDCluster, stream: bool):
    overhead = _chat_overhead_tokens(pd_cluster)
    for num_tokens in PROMPT_LENGTHS[1:]:
        if num_tokens <= overhead:
            continue
        content = "".join(chr(c) for c in prompt_ids(num_tokens - overhead, salt=num_tokens))
        kwargs = {"model": MODEL, "messages": [{"role": "user", "content": content}],
                  "max_tokens": MAX_TOKENS, "temperature": 0}  # fmt: skip
        pd = chat(client(pd_cluster.router_url), stream, **kwargs)
        mixed = chat(client(pd_cluster.mixed_url), False, **kwargs)
        assert pd == mixed, f"prompt of {num_tokens} tokens"
        assert pd.prompt_tokens == num_tokens


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_seeded_sampling_equals_mixed(pd_cluster: PDCluster, stream: bool) -> None:
    kwargs = {"model": MODEL, "prompt": prompt_ids(37, salt=5), "max_tokens": 12,
              "temperature": 0.9, "top_p": 0.95, "seed": 1234,
              "extra_body": {"top_k": 40}}  # fmt: skip
    pd = complete(client(pd_cluster.router_url), stream, **kwargs)
    mixed = complete(client(pd_cluster.mixed_url), False, **kwargs)
    assert pd == mixed
    chat_kwargs = {"model": MODEL, "messages": [{"role": "user", "content": "sample me"}],
                   "max_tokens": 12, "temperature": 1.0, "seed": 99}  # fmt: skip
    assert chat(client(pd_cluster.router_url), stream, **chat_kwargs) == chat(
        client(pd_cluster.mixed_url), False, **chat_kwargs
    )


@pytest.mark.slow
def test_sixteen_concurrent_streams_on_two_p_and_two_d(pd_cluster: PDCluster) -> None:
    prompts = [prompt_ids(20 + 3 * i, salt=100 + i) for i in range(16)]
    before = {url: metrics_of(url) for url in pd_cluster.worker_urls}

    async def one_stream(prompt: list[int]) -> Answer:
        api = async_client(pd_cluster.router_url)
        texts, finish, usage = [], None, None
        stream = await api.completions.create(
            model=MODEL, prompt=prompt, max_tokens=6, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        async for chunk in stream:
            for choice in chunk.choices:
                texts.append(choice.text)
                finish = choice.finish_reason or finish
            usage = chunk.usage or usage
        await api.close()
        return Answer("".join(texts), finish, usage.prompt_tokens, usage.completion_tokens)

    async def all_streams() -> list[Answer]:
        return await asyncio.gather(*(one_stream(p) for p in prompts))

    answers = asyncio.run(all_streams())
    mixed_api = client(pd_cluster.mixed_url)
    for prompt, answer in zip(prompts, answers, strict=True):
        expected = complete(mixed_api, False, model=MODEL, prompt=prompt, max_tokens=6,
                            temperature=0)  # fmt: skip
        assert answer == expected
    c = pd_cluster.cluster
    for url in c.prefill_urls + c.decode_urls:
        assert wait_blocks_free(url) == 0, f"{url} leaked KV blocks"
    # Round robin spread the work: every P prefilled and every D decoded some of the 16.
    for role, urls in (("prefill", c.prefill_urls), ("decode", c.decode_urls)):
        key = f'pdworker_requests_total{{endpoint="{role}",status="success"}}'
        served = [metrics_of(u).get(key, 0) - before[u].get(key, 0) for u in urls]
        assert sum(served) == 16 and min(served) >= 1, (role, served)


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_requests_over_after_one_token_skip_decode_and_equal_mixed(
    pd_cluster: PDCluster, stream: bool
) -> None:
    c = pd_cluster.cluster
    key = 'pdworker_requests_total{endpoint="decode",status="success"}'
    decodes_before = sum(metrics_of(u).get(key, 0) for u in c.decode_urls)
    base = {"model": MODEL, "prompt": prompt_ids(21, salt=7), "temperature": 0}
    mixed_api, pd_api = client(pd_cluster.mixed_url), client(pd_cluster.router_url)
    greedy = complete(mixed_api, False, max_tokens=4, **base)
    first_char = greedy.text[0]
    assert first_char.isascii(), "the tiny model's greedy answer starts with one ASCII byte"
    cases = [
        {"max_tokens": 1},  # length after one token
        {"max_tokens": 4, "extra_body": {"stop_token_ids": [ord(first_char)]}},  # stop token
        {"max_tokens": 4, "stop": [first_char]},  # stop string inside the first token
    ]
    for extra in cases:
        pd = complete(pd_api, stream, **base, **extra)
        assert pd == complete(mixed_api, False, **base, **extra), extra
        assert pd.completion_tokens == 1
    assert sum(metrics_of(u).get(key, 0) for u in c.decode_urls) == decodes_before
