"""Scoring, batched prompts, n and best_of through PD equal the mixed worker's, choice for
choice: echo with logprobs (max_tokens 0: the prompt scored alone), a batch of prompts with n
choices each, best_of ranking, chat's n; streamed and whole (pdrouter.wire.choices,
pdrouter.wire.scoring)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.e2e.pd.clients import client, prompt_ids
from tests.e2e.pd.conftest import BLOCK_SIZE, MODEL, PDCluster, wait_blocks_free
from tests.metrics_scrape import metrics_of
from tests.wait import wait_until

TOLERANCE = 1e-4


def _completions(base_url: str, stream: bool, **kwargs: Any) -> dict[int, dict[str, Any]]:
    """index -> {text, tokens, token_logprobs, finish_reason} (a stream's chunks joined),
    plus -1 -> usage."""
    api = client(base_url)
    out: dict[int, dict[str, Any]] = {}
    usage = None
    if stream:
        chunks = api.completions.create(
            stream=True, stream_options={"include_usage": True}, **kwargs
        )
    else:
        chunks = [api.completions.create(**kwargs)]
    for chunk in chunks:
        usage = chunk.usage or usage
        for c in chunk.choices:
            row = out.setdefault(c.index, {"text": "", "tokens": [], "lps": [], "finish": None})
            row["text"] += c.text
            row["finish"] = c.finish_reason or row["finish"]
            if c.logprobs is not None:
                row["tokens"] += c.logprobs.tokens
                row["lps"] += c.logprobs.token_logprobs
    assert usage is not None
    out[-1] = {"usage": (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens)}
    return out


def _assert_same(pd: dict[int, dict[str, Any]], mixed: dict[int, dict[str, Any]]) -> None:
    assert sorted(pd) == sorted(mixed)
    for index in pd:
        a, b = pd[index], mixed[index]
        if index == -1:
            assert a == b
            continue
        assert (a["text"], a["tokens"], a["finish"]) == (b["text"], b["tokens"], b["finish"])
        assert len(a["lps"]) == len(b["lps"])
        for x, y in zip(a["lps"], b["lps"], strict=True):
            assert (x is None) == (y is None) and (x is None or abs(x - y) < TOLERANCE)


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_prompt_scored_alone_equals_mixed(pd_cluster: PDCluster, stream: bool) -> None:
    prompt = prompt_ids(37, salt=2701)
    kwargs = {"model": MODEL, "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 2}
    pd = _completions(pd_cluster.router_url, stream, **kwargs)
    mixed = _completions(pd_cluster.mixed_url, stream, **kwargs)
    _assert_same(pd, mixed)
    (choice,) = [pd[i] for i in pd if i >= 0]
    # every prompt token, the first with a null logprob; nothing generated
    assert len(choice["tokens"]) == len(prompt) and choice["lps"][0] is None
    assert all(lp <= 0 for lp in choice["lps"][1:])
    assert choice["text"] == "".join(chr(t) for t in prompt) and choice["finish"] == "length"
    assert pd[-1]["usage"] == (len(prompt), 0, len(prompt))


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_batch_with_n_and_echo_equals_mixed(pd_cluster: PDCluster, stream: bool) -> None:
    prompts = ["the batch's first", "and its second prompt", "a third"]
    kwargs = {"model": MODEL, "prompt": prompts, "n": 2, "max_tokens": 5, "temperature": 0.9,
              "seed": 31, "echo": True, "extra_body": {"ignore_eos": True}}  # fmt: skip
    pd = _completions(pd_cluster.router_url, stream, **kwargs)
    mixed = _completions(pd_cluster.mixed_url, stream, **kwargs)
    _assert_same(pd, mixed)
    assert sorted(pd) == [-1, 0, 1, 2, 3, 4, 5]
    for index in range(6):
        assert pd[index]["text"].startswith(prompts[index // 2])
    # the two choices of a prompt sample with different seeds
    assert pd[0]["text"] != pd[1]["text"]
    num_prompt = sum(len(p) + 1 for p in prompts)  # the tiny tokenizer: bos, a token per byte
    assert pd[-1]["usage"] == (num_prompt, 30, num_prompt + 30)


@pytest.mark.slow
def test_best_of_keeps_the_most_likely_and_equals_mixed(pd_cluster: PDCluster) -> None:
    kwargs = {"model": MODEL, "prompt": "rank these", "max_tokens": 4, "temperature": 1.0,
              "seed": 5, "extra_body": {"ignore_eos": True}}  # fmt: skip
    pd = _completions(pd_cluster.router_url, False, best_of=3, n=2, **kwargs)
    mixed = _completions(pd_cluster.mixed_url, False, best_of=3, n=2, **kwargs)
    _assert_same(pd, mixed)
    assert pd[0]["lps"] == [] and pd[-1]["usage"][1] == 12  # logprobs not asked: none shown
    every = _completions(pd_cluster.router_url, False, n=3, logprobs=0, **kwargs)
    ranked = sorted(range(3), key=lambda i: -sum(every[i]["lps"]))
    assert [pd[0]["text"], pd[1]["text"]] == [every[i]["text"] for i in ranked[:2]]


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_n_equals_mixed(pd_cluster: PDCluster, stream: bool) -> None:
    kwargs = {"model": MODEL, "messages": [{"role": "user", "content": "two answers"}], "n": 2,
              "max_tokens": 4, "temperature": 0.8, "seed": 9,
              "extra_body": {"ignore_eos": True}}  # fmt: skip
    answers = []
    for url in (pd_cluster.router_url, pd_cluster.mixed_url):
        api = client(url)
        texts = {0: "", 1: ""}
        if stream:
            for chunk in api.chat.completions.create(stream=True, **kwargs):
                for c in chunk.choices:
                    texts[c.index] += c.delta.content or ""
        else:
            for c in api.chat.completions.create(**kwargs).choices:
                texts[c.index] = c.message.content
        answers.append(texts)
    assert answers[0] == answers[1] and answers[0][0] != answers[0][1]


def _computed(base_url: str) -> float:
    return metrics_of(base_url)['pdworker_prompt_tokens_by_source_total{source="computed"}']


def _count(base_url: str, key: str) -> float:
    return metrics_of(base_url).get(key, 0.0)


def _counts(base_url: str, *keys: str) -> tuple[float, ...]:
    samples = metrics_of(base_url)
    return tuple(samples.get(key, 0.0) for key in keys)


def _deltas(
    after: list[tuple[float, ...]], before: list[tuple[float, ...]]
) -> list[tuple[float, ...]]:
    return [
        tuple(a - b for a, b in zip(x, y, strict=True)) for x, y in zip(after, before, strict=True)
    ]


COMPUTED = 'pdworker_prompt_tokens_by_source_total{source="computed"}'
PREFILLS = 'pdworker_requests_total{endpoint="prefill",status="success"}'
DECODES = 'pdworker_requests_total{endpoint="decode",status="success"}'
LOADED = "pdworker_pool_blocks_loaded_total"
GENERATED = "pdworker_generation_tokens_total"
# The router's counts of a request: each once, whatever its sequences.
PER_REQUEST = (
    "pdrouter_prompt_tokens_total",
    "pdrouter_generation_tokens_total",
    "pdrouter_time_to_first_token_seconds_count",
    "pdrouter_time_per_output_token_seconds_count",
    "pdrouter_handoff_after_first_token_seconds_count",
    "pdrouter_first_to_second_token_seconds_count",  # a stream's only
)


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_group_is_prefilled_once_and_loaded_once_on_one_d(
    pd_cluster: PDCluster, stream: bool
) -> None:
    """n=3 over a prompt of 2 full blocks and 8 tokens: the mixed worker computes it once;
    through PD one P computes it once (one prefill), one D loads its 3 blocks once (one
    decode) and decodes the three sequences: PD equals mixed choice for choice. P counts the
    three first tokens it sampled, D the twelve others; the router counts the request, its
    tokens, its first token, its time per output token, its handoff and a stream's second
    token once."""
    prompt = prompt_ids(2 * BLOCK_SIZE + 8, salt=8128 + int(stream))
    kwargs = {"model": MODEL, "prompt": prompt, "n": 3, "max_tokens": 5, "temperature": 0.7,
              "seed": 3, "logprobs": 1, "extra_body": {"ignore_eos": True}}  # fmt: skip
    before = _computed(pd_cluster.mixed_url)
    mixed = _completions(pd_cluster.mixed_url, stream, **kwargs)
    assert _computed(pd_cluster.mixed_url) - before == len(prompt)
    p_urls, d_urls = pd_cluster.cluster.prefill_urls, pd_cluster.cluster.decode_urls
    p_before = [_counts(u, COMPUTED, PREFILLS, GENERATED) for u in p_urls]
    d_before = [_counts(u, LOADED, DECODES, GENERATED) for u in d_urls]
    router_before = metrics_of(pd_cluster.router_url)
    pd = _completions(pd_cluster.router_url, stream, **kwargs)
    _assert_same(pd, mixed)
    assert sorted(pd) == [-1, 0, 1, 2] and len({pd[i]["text"] for i in range(3)}) == 3
    assert pd[-1]["usage"] == (len(prompt), 15, len(prompt) + 15)
    # P samples the three first tokens, D generates the other 12 (4 per sequence): each
    # worker counts the group as one request (D's count lands once its body has ended).
    wait_until(lambda: sum(_count(u, DECODES) for u in d_urls), 10, "D's decode counted",
               done=lambda n: n == sum(d[1] for d in d_before) + 1)  # fmt: skip
    p_delta = _deltas([_counts(u, COMPUTED, PREFILLS, GENERATED) for u in p_urls], p_before)
    assert sorted(p_delta) == [(0, 0, 0), (len(prompt), 1, 3)]
    d_delta = _deltas([_counts(u, LOADED, DECODES, GENERATED) for u in d_urls], d_before)
    assert sorted(d_delta) == [(0, 0, 0), (3, 1, 12)]
    # The router's counts of the request once (after its end: the service's, past the answer).
    served = 'pdrouter_requests_total{endpoint="completions",status="200"}'
    num_served = router_before.get(served, 0.0) + 1
    router_after = wait_until(lambda: metrics_of(pd_cluster.router_url), 10, "the request's end",
                              done=lambda m: m[served] == num_served)  # fmt: skip
    assert [router_after[k] - router_before.get(k, 0.0) for k in PER_REQUEST] == [
        len(prompt), 15, 1, 1, 1, int(stream)]  # fmt: skip


@pytest.mark.slow
def test_best_of_group_equals_mixed_and_ranks_by_cumulative_logprob(pd_cluster: PDCluster) -> None:
    kwargs = {"model": MODEL, "prompt": prompt_ids(21, salt=99), "max_tokens": 4,
              "temperature": 1.0, "seed": 12, "extra_body": {"ignore_eos": True}}  # fmt: skip
    pd = _completions(pd_cluster.router_url, False, best_of=3, n=2, logprobs=0, **kwargs)
    mixed = _completions(pd_cluster.mixed_url, False, best_of=3, n=2, logprobs=0, **kwargs)
    _assert_same(pd, mixed)
    every = _completions(pd_cluster.router_url, False, n=3, logprobs=0, **kwargs)
    ranked = sorted(range(3), key=lambda i: -sum(every[i]["lps"]))
    assert [pd[0]["text"], pd[1]["text"]] == [every[i]["text"] for i in ranked[:2]]


@pytest.mark.slow
def test_signed_seeds_and_the_default_max_tokens(pd_cluster: PDCluster) -> None:
    """Any signed 64-bit seed is taken (a negative one samples as PD and mixed agree; -1 is
    "no seed"), and completions without max_tokens stop at 16 tokens."""
    kwargs = {"model": MODEL, "prompt": "signed seeds", "temperature": 1.0,
              "extra_body": {"ignore_eos": True}}  # fmt: skip
    pd = _completions(pd_cluster.router_url, False, seed=-(2**63), **kwargs)
    mixed = _completions(pd_cluster.mixed_url, False, seed=-(2**63), **kwargs)
    _assert_same(pd, mixed)
    assert pd[-1]["usage"][1] == 16
    for base in (pd_cluster.router_url, pd_cluster.mixed_url):
        assert _completions(base, False, seed=-1, max_tokens=2, **kwargs)[-1]["usage"][1] == 2


@pytest.mark.slow
def test_a_client_leaving_a_group_frees_every_sequence_on_d(pd_cluster: PDCluster) -> None:
    kwargs = {"model": MODEL, "prompt": prompt_ids(37, salt=4242), "n": 3, "max_tokens": 300,
              "temperature": 0.9, "seed": 8, "extra_body": {"ignore_eos": True}}  # fmt: skip
    with client(pd_cluster.router_url).completions.create(stream=True, **kwargs) as stream:
        chunks = iter(stream)
        for _ in range(12):
            next(chunks)
        # the prompt's 2 full blocks shared, a last block each: at least 5 in use on one D
        assert (
            max(
                metrics_of(url)["pdworker_kv_blocks_used"] for url in pd_cluster.cluster.decode_urls
            )
            >= 5
        )
    for url in [*pd_cluster.cluster.decode_urls, *pd_cluster.cluster.prefill_urls]:
        assert wait_blocks_free(url) == 0


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "seeded"])
def test_a_batch_runs_one_group_per_prompt_and_equals_mixed(
    pd_cluster: PDCluster, temperature: float
) -> None:
    prompts = [prompt_ids(19, salt=301), prompt_ids(34, salt=302)]
    kwargs = {"model": MODEL, "prompt": prompts, "n": 2, "max_tokens": 4, "seed": 77,
              "temperature": temperature, "extra_body": {"ignore_eos": True}}  # fmt: skip
    p_before = sum(_count(u, PREFILLS) for u in pd_cluster.cluster.prefill_urls)
    pd = _completions(pd_cluster.router_url, True, **kwargs)
    assert sum(_count(u, PREFILLS) for u in pd_cluster.cluster.prefill_urls) - p_before == 2
    mixed = _completions(pd_cluster.mixed_url, True, **kwargs)
    _assert_same(pd, mixed)
    assert (pd[0]["text"] == pd[1]["text"]) == (temperature == 0.0)
    assert pd[-1]["usage"] == (19 + 34, 16, 19 + 34 + 16)
