"""Tenant isolation of the prefix cache, end to end: a 1P1D cluster whose router and workers
hold two API keys (`--api-key key-a,key-b`). Each key, and each cache_salt under a key, is its
own cache scope: a prompt another scope sent, or another scope's prompt + answer (written back
by D), is never reported in cached_tokens (exactly 0), while the same scope's repeat hits its
full blocks exactly. With the router's --share-cache-across-keys the two keys share again.

One P: every repeat lands on the P whose device cache and pool writes the first request made,
so a 0 can only be the isolation, never a routing miss."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdrouter.launch.cluster import Cluster
from pdrouter.launch.spec import ClusterSpec
from tests.e2e.cache.conftest import BLOCK_SIZE, MODEL, cache_spec
from tests.e2e.cluster_fixture import started_cluster
from tests.e2e.pd.clients import prompt_ids
from tests.wait import wait_until

pytestmark = pytest.mark.slow
KEY_A, KEY_B = "key-a-7f3c", "key-b-91d2"
KEYS = f"{KEY_A},{KEY_B}"


def _spec(log_dir: Path, cache_dir: Path, *router_args: str) -> ClusterSpec:
    spec = cache_spec(log_dir, cache_dir)
    return dataclasses.replace(spec, num_prefill=1, num_decode=1, api_key=KEYS,
                               router_args=(*spec.router_args, *router_args))  # fmt: skip


@pytest.fixture(scope="module")
def isolated(tmp_path_factory: pytest.TempPathFactory, tiny_cache_dir: Path) -> Iterator[Cluster]:
    log_dir = tmp_path_factory.mktemp("tenant-logs")
    yield from started_cluster(_spec(log_dir, tiny_cache_dir))


def cached_tokens(
    base_url: str, key: str, prompt: list[int], salt: str | None = None, max_tokens: int = 4
) -> tuple[int, str]:
    """(usage's cached_tokens, the answer's text) of one greedy completion."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0, timeout=120)
    extra: dict[str, Any] = {"ignore_eos": True}
    if salt is not None:
        extra["cache_salt"] = salt
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                  temperature=0, extra_body=extra)  # fmt: skip
    assert r.usage.completion_tokens == max_tokens
    return r.usage.prompt_tokens_details.cached_tokens, r.choices[0].text


def metrics_of(c: Cluster, url: str) -> dict[str, float]:
    """A worker's unlabelled samples, read with the admin key (its /metrics is locked)."""
    headers = {"Authorization": f"Bearer {c.secrets.admin_key}"}
    text = httpx.get(f"{url}/metrics", headers=headers, timeout=10).raise_for_status().text
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.labels
    }


def assert_no_blocks_held(c: Cluster) -> None:
    """P and D idle with no KV block referenced (cached, evictable blocks are not held)."""
    for url in (*c.prefill_urls, *c.decode_urls):

        def idle(m: dict[str, float]) -> bool:
            busy = m["pdworker_num_requests_running"] + m["pdworker_num_requests_waiting"]
            return m["pdworker_kv_blocks_used"] + busy == 0

        wait_until(lambda u=url: metrics_of(c, u), 30.0, f"{url} idle", done=idle)


def hit(num_tokens: int) -> int:
    """What a cache can serve of a prompt: its full blocks before the last token."""
    return (num_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE


def test_two_keys_never_see_each_others_cached_tokens(isolated: Cluster) -> None:
    prompt = prompt_ids(75, salt=2400)
    url = isolated.router_url
    assert cached_tokens(url, KEY_A, prompt)[0] == 0  # cold
    assert cached_tokens(url, KEY_B, prompt)[0] == 0  # the same prompt, the other key
    assert cached_tokens(url, KEY_A, prompt)[0] == hit(75)  # key a's own blocks
    assert cached_tokens(url, KEY_B, prompt)[0] == hit(75)  # key b's own blocks now
    assert_no_blocks_held(isolated)


def test_two_salts_under_one_key_never_share(isolated: Cluster) -> None:
    prompt = prompt_ids(50, salt=2500)
    url = isolated.router_url
    assert cached_tokens(url, KEY_A, prompt, salt="s1")[0] == 0
    assert cached_tokens(url, KEY_A, prompt, salt="s2")[0] == 0
    assert cached_tokens(url, KEY_A, prompt)[0] == 0  # no salt: the key's own scope
    assert cached_tokens(url, KEY_B, prompt, salt="s1")[0] == 0  # the salt, another key
    assert cached_tokens(url, KEY_A, prompt, salt="s1")[0] == hit(50)
    assert cached_tokens(url, KEY_A, prompt, salt="s2")[0] == hit(50)
    assert_no_blocks_held(isolated)


def test_written_back_answers_are_confirmed_only_for_their_tenant(isolated: Cluster) -> None:
    """D writes prompt + answer back under the request's scope: another key sending the
    prompt with that answer learns nothing; the same key hits past its prompt's blocks."""
    prompt = prompt_ids(40, salt=2600)
    url = isolated.router_url
    written = "pdworker_writeback_blocks_total"
    d_url = isolated.decode_urls[0]
    before = metrics_of(isolated, d_url).get(written, 0)
    _, answer = cached_tokens(url, KEY_A, prompt, max_tokens=30)
    # Blocks 2 and 3 (tokens 32-63 of prompt + answer) are D's to write back.
    wait_until(lambda: metrics_of(isolated, d_url).get(written, 0) - before, 30.0,
               "the write-back", done=lambda n: n >= 2)  # fmt: skip
    answer_ids = list(answer.encode())  # byte-level tokenizer: one token per byte
    assert len(answer_ids) == 30, "the tiny model answered printable ASCII"
    turn = [*prompt, *answer_ids, *prompt_ids(5, salt=2601)]  # 75 tokens
    assert cached_tokens(url, KEY_B, turn)[0] == 0
    # Key a: blocks 0-1 from P's device cache, 2-3 from the pool (D's write-back).
    assert cached_tokens(url, KEY_A, turn)[0] == hit(75)
    assert_no_blocks_held(isolated)


def test_a_worker_serving_v1_directly_isolates_its_keys(isolated: Cluster) -> None:
    prompt = prompt_ids(60, salt=2700)
    p_url = isolated.prefill_urls[0]
    assert cached_tokens(p_url, KEY_A, prompt)[0] == 0
    assert cached_tokens(p_url, KEY_B, prompt)[0] == 0
    assert cached_tokens(p_url, KEY_A, prompt)[0] == hit(60)
    assert cached_tokens(p_url, KEY_A, prompt, salt="s1")[0] == 0
    assert cached_tokens(p_url, KEY_A, prompt, salt="s1")[0] == hit(60)
    assert_no_blocks_held(isolated)


def test_an_empty_cache_salt_is_refused(isolated: Cluster) -> None:
    client = openai.OpenAI(base_url=f"{isolated.router_url}/v1", api_key=KEY_A, max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=1,
                                  extra_body={"cache_salt": ""})  # fmt: skip
    assert "cache_salt" in str(err.value)


@pytest.fixture(scope="module")
def shared(
    isolated: Cluster, tmp_path_factory: pytest.TempPathFactory, tiny_cache_dir: Path
) -> Iterator[Cluster]:
    """The same cluster with --share-cache-across-keys (started after the isolated one)."""
    log_dir = tmp_path_factory.mktemp("tenant-shared-logs")
    yield from started_cluster(_spec(log_dir, tiny_cache_dir, "--share-cache-across-keys"))


def test_with_sharing_on_two_keys_share_but_salts_still_isolate(shared: Cluster) -> None:
    prompt = prompt_ids(75, salt=2800)
    url = shared.router_url
    assert cached_tokens(url, KEY_A, prompt)[0] == 0
    assert cached_tokens(url, KEY_B, prompt)[0] == hit(75)  # key a's blocks
    assert cached_tokens(url, KEY_B, prompt, salt="s1")[0] == 0
    assert cached_tokens(url, KEY_A, prompt, salt="s1")[0] == hit(75)
    assert_no_blocks_held(shared)
