"""The KV pool failing under the cluster: the Mooncake master killed then restarted on its
ports, and the pool owner (the process holding the pool memory) stopped. Decode must fall back
to recomputing the prompt (policy `recompute`: the same answer) or fail with a 502 naming the
missing blocks (policy `fail`); nothing may hang or leak a block."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from pdrouter.launch.cluster import Cluster
from pdrouter.router.config import RouterConfig
from pdrouter.router.orchestrator import HopTimeouts, OrchestratorConfig
from tests.e2e.chaos.conftest import MODEL, assert_nothing_held, chaos_spec
from tests.e2e.cluster_fixture import started_cluster
from tests.e2e.pd.clients import Answer, client, complete, prompt_ids
from tests.metrics_scrape import metrics_of
from tests.pdrouter.router.in_process_router import in_process_router
from tests.wait import wait_until

pytestmark = pytest.mark.slow

PROMPT_TOKENS = 100
POOL_READ = "pdrouter_pool_bytes_read_total"
RECOMPUTED = "pdrouter_recomputed_prompt_tokens_total"


@pytest.fixture()
def cluster(tmp_path_factory: pytest.TempPathFactory, chaos_cache_dir: Path) -> Iterator[Cluster]:
    """A chaos cluster per test (each test breaks the pool for good) with a decode event bound
    above the pool's failure time: a pool call to a dead master fails after ~4 s, and D's first
    event waits for it."""
    log_dir = tmp_path_factory.mktemp("chaos-pool-logs")
    yield from started_cluster(chaos_spec(log_dir, chaos_cache_dir, decode_timeout_s=30.0))


def _body(salt: int) -> dict:
    return {"model": MODEL, "prompt": prompt_ids(PROMPT_TOKENS, salt=salt), "max_tokens": 6,
            "temperature": 0, "extra_body": {"ignore_eos": True}}  # fmt: skip


def _ask(c: Cluster, salt: int, stream: bool = False) -> tuple[Answer, float, float]:
    """(answer, pool bytes read, prompt tokens recomputed) of one request through the router."""
    before = metrics_of(c.router_url)
    answer = complete(client(c.router_url), stream, **_body(salt))
    after = metrics_of(c.router_url)
    return (
        answer,
        after.get(POOL_READ, 0) - before.get(POOL_READ, 0),
        after.get(RECOMPUTED, 0) - before.get(RECOMPUTED, 0),
    )


def test_master_killed_then_restarted(cluster: Cluster) -> None:
    undisturbed = {salt: complete(client(cluster.router_url), False, **_body(salt))
                   for salt in (30, 31, 32)}  # fmt: skip
    # A repeated prompt is served from the pool: nothing recomputed.
    answer, read_bytes, recomputed = _ask(cluster, 30)
    assert (answer, recomputed) == (undisturbed[30], 0) and read_bytes > 0

    cluster.child("mooncake_master").proc.kill()  # type: ignore[union-attr]
    # Every pool call fails (master unreachable): D recomputes the whole prompt.
    for salt, stream in ((31, False), (30, True)):
        answer, read_bytes, recomputed = _ask(cluster, salt, stream)
        assert (answer, read_bytes, recomputed) == (undisturbed[salt], 0, PROMPT_TOKENS)

    cluster.restart("mooncake_master")  # the same command line: the same ports

    # Pool clients find the new master by themselves (a restart loses every object): within a
    # bound, a prompt written after the restart is read back from the pool again, by a plain
    # and then a streamed request in a row. Each of the 4 workers reconnects on its own, and
    # the two requests may go to different Ds: one D reading again is not yet the cluster.
    def both_read_from_the_pool() -> bool:
        reads = []
        for stream in (False, True):
            answer, read_bytes, recomputed = _ask(cluster, 32, stream)
            assert answer == undisturbed[32]  # recomputed or read, always the same answer
            reads.append(read_bytes > 0 and recomputed == 0)
        return all(reads)

    wait_until(
        both_read_from_the_pool, 30.0, "the pool to serve a plain and a streamed request in a row",
        interval_s=0.2,
    )  # fmt: skip
    assert_nothing_held(cluster)


def _fail_policy_router(c: Cluster) -> AsyncIterator[httpx.AsyncClient]:
    cfg = RouterConfig(
        prefill_urls=tuple(c.prefill_urls),
        decode_urls=tuple(c.decode_urls),
        orchestrator=OrchestratorConfig(
            timeouts=HopTimeouts(connect_s=1.0, prefill_s=60.0, decode_event_s=30.0),
            missing_kv_policy="fail",
        ),
        internal_secret=c.internal_secret,  # what the launched workers require
    )
    return in_process_router(cfg)


async def test_pool_owner_stopped(cluster: Cluster) -> None:
    undisturbed = {salt: complete(client(cluster.router_url), False, **_body(salt))
                   for salt in (40, 41)}  # fmt: skip
    cluster.child("pool-owner").proc.stop()  # type: ignore[union-attr]
    # Policy recompute (the default): the same answer, the whole prompt recomputed.
    for salt, stream in ((40, False), (41, True), (40, True)):
        answer, read_bytes, recomputed = _ask(cluster, salt, stream)
        assert (answer, read_bytes, recomputed) == (undisturbed[salt], 0, PROMPT_TOKENS)
    # Policy fail: a 502 naming the decode stage and the blocks it could not read.
    body = _body(42)
    body.update(body.pop("extra_body"))
    async for router in _fail_policy_router(cluster):
        resp = await router.post("/v1/completions", json=body)
        assert resp.status_code == 502, resp.text
        message = resp.json()["error"]["message"]
        assert "KV blocks could not be read from the pool (policy fail)" in message, message
        num_blocks = -(-PROMPT_TOKENS // 16)
        assert f"{num_blocks} of {num_blocks} KV blocks" in message, message
    assert_nothing_held(cluster)
