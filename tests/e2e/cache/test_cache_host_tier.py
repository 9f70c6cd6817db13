"""Answers with the host tier on equal a worker that caches nothing, token for token: 1 P and
1 D with a device cache smaller than the working set (--num-kv-blocks 24) and a host tier
(--swap-space, write_through), so revisited prompts come back from host memory on P.

Reuses the cache suite's reference worker and helpers (tests/e2e/cache/conftest.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from pdrouter.launch.cluster import Cluster
from tests.e2e.cache.conftest import BLOCK_SIZE, MODEL, ask, assert_no_blocks_held, cache_spec
from tests.e2e.cluster_fixture import started_cluster
from tests.e2e.pd.clients import prompt_ids
from tests.metrics_scrape import metrics_of
from tests.workers.server.conftest import WorkerHandle

pytestmark = pytest.mark.slow
MAX_TOKENS = 5
NUM_PROMPTS = 5  # 7 blocks each: 35 > the 24 blocks of P's device cache
NUM_TOKENS = 6 * BLOCK_SIZE + 5


@pytest.fixture(scope="module")
def host_cluster(tmp_path_factory: pytest.TempPathFactory, tiny_cache_dir: Path):
    spec = cache_spec(tmp_path_factory.mktemp("host-tier-logs"), tiny_cache_dir,
                      "--swap-space=0.05", "--write-policy=write_through")  # fmt: skip
    args = tuple(a for a in spec.worker_args if not a.startswith(("--num-kv-blocks", "--max-m")))
    args += ("--num-kv-blocks=24", "--max-model-len=256")
    spec = dataclasses.replace(spec, num_prefill=1, num_decode=1, worker_args=args)
    yield from started_cluster(spec)


def test_revisited_prompts_swapped_in_from_the_host_tier_equal_the_reference(
    host_cluster: Cluster, reference: WorkerHandle
) -> None:
    prompts = [prompt_ids(NUM_TOKENS, salt=2600 + i) for i in range(NUM_PROMPTS)]
    expected = [
        ask(reference.base_url, False, False, model=MODEL, prompt=p, max_tokens=MAX_TOKENS,
            temperature=0, extra_body={"ignore_eos": True}).answer
        for p in prompts
    ]  # fmt: skip
    p_url = host_cluster.prefill_urls[0]
    for round_index, stream in ((0, False), (1, True)):
        for prompt, want in zip(prompts, expected, strict=True):
            got = ask(host_cluster.router_url, False, stream, model=MODEL, prompt=prompt,
                      max_tokens=MAX_TOKENS, temperature=0,
                      extra_body={"ignore_eos": True})  # fmt: skip
            assert got.answer == want, f"round {round_index}"
            if round_index:  # device, host or pool: the whole cacheable prefix, never less
                assert got.cached_tokens == (NUM_TOKENS - 1) // BLOCK_SIZE * BLOCK_SIZE
    m = metrics_of(p_url)
    # The first prompts of round 2 were evicted from P's device by the later ones of round 1:
    # they came back from host memory, ahead of the pool.
    assert m['pdworker_prompt_tokens_by_source_total{source="host"}'] >= 6 * BLOCK_SIZE
    assert m["pdworker_host_tier_hits_total"] >= 6
    assert m['pdworker_host_tier_copies_total{policy="write_through"}'] >= NUM_PROMPTS * 6
    # P's result carries the split: the router counts the same host tokens
    router = metrics_of(host_cluster.router_url)
    assert (router['pdrouter_prompt_tokens_by_source_total{source="host"}']
            == m['pdworker_prompt_tokens_by_source_total{source="host"}'])  # fmt: skip
    assert_no_blocks_held(host_cluster)
