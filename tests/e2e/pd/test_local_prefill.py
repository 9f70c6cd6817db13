"""Conditional disaggregation through real processes: a second router over the session
cluster's P and D with the default --local-prefill-below-tokens (the cluster's own router
sends every prompt through P), against the mixed worker. A short prompt, and a new turn over
a cached prefix, are prefilled by D itself, token for token as the mixed worker answers; the
router's first-to-second token gap and the handoff left after P's first token are exported
and observed on the paths that have them."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from benchmarks.pd_paths import extra_router
from pdrouter.router.orchestrator.config import DEFAULT_LOCAL_PREFILL_BELOW_TOKENS
from tests.e2e.pd.clients import client, complete, prompt_ids
from tests.e2e.pd.conftest import BLOCK_SIZE, MODEL, PDCluster
from tests.metrics_scrape import metrics_of

DECISIONS = "pdrouter_disaggregation_decisions_total"
LOCAL = f'{DECISIONS}{{path="local",reason="uncached_below_threshold"}}'
GAP = "pdrouter_first_to_second_token_seconds"
HANDOFF = "pdrouter_handoff_after_first_token_seconds"


@pytest.fixture(scope="module")
def local_router(pd_cluster: PDCluster) -> Iterator[str]:
    with extra_router(pd_cluster.cluster, (), "default-threshold") as url:
        yield url


def _p_blocks_written(pd_cluster: PDCluster) -> float:
    return sum(metrics_of(url).get("pdworker_pool_blocks_written_total", 0.0)
               for url in pd_cluster.cluster.prefill_urls)  # fmt: skip


def _timeline(pd_cluster: PDCluster, router_url: str, request_id: str) -> list[dict]:
    headers = {"Authorization": f"Bearer {pd_cluster.cluster.admin_key}"}
    resp = httpx.get(f"{router_url}/debug/requests/{request_id}", headers=headers, timeout=10)
    assert resp.status_code == 200, resp.text
    return resp.json()["events"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_short_prompt_is_prefilled_on_decode_token_exact(
    pd_cluster: PDCluster, local_router: str, stream: bool
) -> None:
    prompt = prompt_ids(DEFAULT_LOCAL_PREFILL_BELOW_TOKENS - 24, salt=2501 + stream)
    kwargs = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0.0}
    expected = complete(client(pd_cluster.mixed_url), stream, **kwargs)
    before, written = metrics_of(local_router), _p_blocks_written(pd_cluster)
    assert complete(client(local_router), stream, **kwargs) == expected
    after = metrics_of(local_router)
    assert after[LOCAL] - before.get(LOCAL, 0.0) == 1
    assert _p_blocks_written(pd_cluster) == written  # P computed and wrote nothing
    assert after[f"{GAP}_count"] - before.get(f"{GAP}_count", 0.0) == (1 if stream else 0)
    for name in (HANDOFF, "pdrouter_handoff_get_seconds"):  # no handoff on this path
        assert after.get(f"{name}_count", 0.0) == before.get(f"{name}_count", 0.0), name


def test_a_new_turn_over_a_cached_prefix_is_prefilled_on_decode(
    pd_cluster: PDCluster, local_router: str
) -> None:
    turn_1 = prompt_ids(6 * BLOCK_SIZE + 8, salt=2503)  # 6 full blocks through P
    turn_2 = prompt_ids(6 * BLOCK_SIZE + 40, salt=2503)  # turn 1 and 32 more tokens
    api = client(pd_cluster.router_url)
    api.completions.create(model=MODEL, prompt=turn_1, max_tokens=2, temperature=0.0)
    kwargs = {"model": MODEL, "prompt": turn_2, "max_tokens": 6, "temperature": 0.0}
    expected = complete(client(pd_cluster.mixed_url), False, **kwargs)
    before = metrics_of(local_router)
    resp = client(local_router).completions.with_raw_response.create(**kwargs)
    answer = resp.parse()
    assert answer.choices[0].text == expected.text
    # 40 uncached tokens (below the threshold); D took the 6 blocks from its cache or the pool.
    assert answer.usage.prompt_tokens_details.cached_tokens == 6 * BLOCK_SIZE
    assert metrics_of(local_router)[LOCAL] - before.get(LOCAL, 0.0) == 1
    events = _timeline(pd_cluster, local_router, resp.headers["X-Request-Id"])
    decision = next(e for e in events if e["event"] == "disaggregation")
    assert (decision["path"], decision["uncached_tokens"]) == ("local", 40)


def test_the_gap_and_the_handoff_left_are_observed_through_p_and_the_pool(
    pd_cluster: PDCluster,
) -> None:
    router = pd_cluster.router_url
    kwargs = {"model": MODEL, "prompt": prompt_ids(48, salt=2505), "max_tokens": 6,
              "temperature": 0.0, "stream": True}  # fmt: skip
    before = metrics_of(router)
    resp = client(router).completions.with_raw_response.create(**kwargs)
    request_id = resp.headers["X-Request-Id"]
    text = "".join(c.choices[0].text for c in resp.parse() if c.choices)
    assert text
    after = metrics_of(router)
    for name in (GAP, HANDOFF):
        assert after[f"{name}_count"] - before.get(f"{name}_count", 0.0) == 1, name
        assert after[f"{name}_sum"] > before.get(f"{name}_sum", 0.0), name
    assert after[f'{DECISIONS}{{path="pd",reason="disabled"}}'] >= 1
    events = {e["event"]: e for e in _timeline(pd_cluster, router, request_id)}
    assert events["first_decode_token"]["handoff_after_first_token_ms"] > 0
    assert events["second_token_sent"]["first_to_second_token_ms"] > 0
    assert events["disaggregation"]["path"] == "pd"
