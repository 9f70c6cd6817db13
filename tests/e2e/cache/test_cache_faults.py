"""The pool failing under the prefix cache: the master restarted between two turns of one
conversation (every object lost), then the pool owner stopped. Each request still succeeds with
the exact answer of a worker that caches nothing; no pool hit is claimed for what the pool lost;
no worker keeps a block. (Blocks deleted between lookup and load, and a load past its time
bound: tests/workers/handoff/test_pool_prefix.py, where the fault can be placed exactly.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from pdrouter.launch.cluster import Cluster
from tests.e2e.cache.conftest import (
    MODEL,
    ask,
    assert_no_blocks_held,
    by_source,
    cache_spec,
    delta,
)
from tests.e2e.cluster_fixture import started_cluster
from tests.e2e.pd.clients import prompt_ids
from tests.workers.server.conftest import WorkerHandle

pytestmark = pytest.mark.slow


@pytest.fixture()
def broken_cluster(
    tmp_path_factory: pytest.TempPathFactory, tiny_cache_dir: Path
) -> Iterator[Cluster]:
    """A cluster of its own: this test breaks its pool for good."""
    yield from started_cluster(
        cache_spec(tmp_path_factory.mktemp("cache-fault-logs"), tiny_cache_dir)
    )


def _turn(c: Cluster, reference: WorkerHandle, prompt: list[int], stream: bool) -> dict:
    kwargs = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0,
              "extra_body": {"ignore_eos": True}}  # fmt: skip
    before = by_source(c.router_url)
    got = ask(c.router_url, False, stream, **kwargs)
    assert got.answer == ask(reference.base_url, False, False, **kwargs).answer
    return delta(by_source(c.router_url), before)


def test_master_restarted_between_turns_then_owner_stopped(
    broken_cluster: Cluster, reference: WorkerHandle
) -> None:
    c = broken_cluster
    turn1 = prompt_ids(60, salt=2000)
    _turn(c, reference, turn1, False)
    pool_hit = _turn(c, reference, turn1, False)  # the other P: a pool hit
    assert pool_hit["pool"] == 48

    c.child("mooncake_master").proc.kill()  # type: ignore[union-attr]
    c.restart("mooncake_master")  # the same ports; every object lost
    turn2 = turn1 + prompt_ids(30, salt=2001)
    counts = _turn(c, reference, turn2, True)
    assert counts["pool"] == 0  # nothing of turn 1 survived in the pool

    c.child("pool-owner").proc.stop()  # type: ignore[union-attr]
    turn3 = turn2 + prompt_ids(30, salt=2002)
    for stream in (False, True):
        counts = _turn(c, reference, turn3, stream)
        assert counts["pool"] == 0
    assert_no_blocks_held(c, timeout_s=60.0)
