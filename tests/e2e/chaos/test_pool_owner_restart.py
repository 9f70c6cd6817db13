"""The pool owner killed (kill -9) or stopped (SIGSTOP), or a prefill worker stopped past the
owner's 10 s client TTL, under a serving cluster: every request is answered (recompute), no
stream is cut silently, and the handoff goes through the pool again within a bound, because
the launcher restarts the owner on its ports and the workers' pool clients reconnect by
themselves. (The owner's 20 s pause also passed with the clients' probe off in one run:
Mooncake's own reconnect loop covers that case when its ping fails; the stopped worker, whose
ping never fails, is the case only the probe heals.)"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from pdrouter.launch.cluster import Cluster
from tests.e2e.chaos.conftest import MODEL, chaos_spec
from tests.e2e.cluster_fixture import started_cluster
from tests.e2e.pd.clients import prompt_ids
from tests.metrics_scrape import metrics_of
from tests.sse import DONE, sse_data
from tests.wait import wait_until

pytestmark = pytest.mark.slow

PROMPT_TOKENS = 100
POOL_READ = "pdrouter_pool_bytes_read_total"
KILL_BACK_S = 15.0
PAUSE_S = 20.0
PAUSE_BACK_S = 10.0
PAST_OWNER_TTL_S = 13.0  # the owner drops a client it has not heard from for 10 s
WRITTEN = "pdworker_pool_blocks_written_total"


@pytest.fixture()
def cluster(tmp_path_factory: pytest.TempPathFactory, chaos_cache_dir: Path) -> Iterator[Cluster]:
    """A chaos cluster per test, supervised as `pdrouter launch` supervises it."""
    log_dir = tmp_path_factory.mktemp("chaos-owner-logs")
    for c in started_cluster(chaos_spec(log_dir, chaos_cache_dir, decode_timeout_s=30.0)):
        stop = threading.Event()
        supervisor = threading.Thread(target=c.supervise, args=(stop, 0.2, lambda _: None))
        supervisor.start()
        try:
            yield c
        finally:
            stop.set()
            supervisor.join(timeout=10)


def _stream(c: Cluster, salt: int) -> list[str]:
    body = {"model": MODEL, "prompt": prompt_ids(PROMPT_TOKENS, salt=salt), "max_tokens": 8,
            "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
    resp = httpx.post(f"{c.router_url}/v1/completions", json=body, timeout=120)
    if resp.status_code != 200:  # an error status with its OpenAI error body is an answer too
        return [resp.text]
    return sse_data(resp)


def _answered(events: list[str]) -> bool:
    """Ended with [DONE], or told the client why in an error event: never a silent cut."""
    return bool(events) and (events[-1] == DONE or '"error"' in events[-1])


def _read_from_pool(c: Cluster, salt: int) -> bool:
    """A prompt asked twice: the second time, D read its blocks from the pool."""
    assert _answered(_stream(c, salt))
    before = metrics_of(c.router_url).get(POOL_READ, 0)
    assert _answered(_stream(c, salt))
    return metrics_of(c.router_url).get(POOL_READ, 0) > before


def _pool_in_use(c: Cluster, first_salt: int, timeout_s: float, what: str) -> None:
    salts = iter(range(first_salt, first_salt + 400, 2))
    wait_until(lambda: _read_from_pool(c, next(salts)), timeout_s, what, interval_s=0.2)


def test_owner_killed_every_request_answered_and_the_pool_back(cluster: Cluster) -> None:
    _pool_in_use(cluster, 1000, 30.0, "the handoff through the pool before the fault")
    owner = cluster.child("pool-owner")
    first = owner.proc
    with ThreadPoolExecutor(16) as pool:
        streams = [pool.submit(_stream, cluster, 100 + i) for i in range(16)]
        time.sleep(0.3)  # the fault lands while those streams run
        first.kill()  # type: ignore[union-attr]
        killed = time.monotonic()
        results = [f.result(timeout=120) for f in streams]
    assert all(_answered(r) for r in results), [r[-1:] for r in results]
    _pool_in_use(cluster, 2000, KILL_BACK_S, "the handoff through the restarted owner")
    print(f"pool back {time.monotonic() - killed:.1f} s after the kill")
    assert owner.proc is not first and owner.restarts == 1
    assert cluster.router_url and httpx.get(f"{cluster.router_url}/health").status_code == 200


def test_owner_stopped_20s_the_pool_back_within_10s_of_sigcont(cluster: Cluster) -> None:
    _pool_in_use(cluster, 3000, 30.0, "the handoff through the pool before the fault")
    owner = cluster.child("pool-owner")
    owner.proc.signal(signal.SIGSTOP)  # type: ignore[union-attr]
    try:
        paused = time.monotonic()
        with ThreadPoolExecutor(4) as pool:  # served meanwhile, by recompute
            results = list(pool.map(lambda s: _stream(cluster, s), range(500, 504)))
        assert all(_answered(r) for r in results), [r[-1:] for r in results]
        time.sleep(max(0.0, PAUSE_S - (time.monotonic() - paused)))  # the fault: 20 s
    finally:
        owner.proc.signal(signal.SIGCONT)  # type: ignore[union-attr]
    resumed = time.monotonic()
    _pool_in_use(cluster, 4000, PAUSE_BACK_S, "the handoff through the pool after SIGCONT")
    print(f"pool back {time.monotonic() - resumed:.1f} s after SIGCONT")


def test_prefill_stopped_past_the_owner_ttl_writes_to_the_pool_again(cluster: Cluster) -> None:
    # The owner unmaps the staging of a worker silent for 10 s; the worker's own ping thread
    # never notices: without the pool client's probe, P wrote nothing again until restarted.
    url = cluster.prefill_urls[0]
    worker = cluster.child("prefill-0").proc
    worker.signal(signal.SIGSTOP)  # type: ignore[union-attr]
    try:
        time.sleep(PAST_OWNER_TTL_S)  # the fault: a pause of this length
    finally:
        worker.signal(signal.SIGCONT)  # type: ignore[union-attr]
    resumed = time.monotonic()
    salts = iter(range(5000, 5400))

    def p0_writes() -> bool:
        before = metrics_of(url).get(WRITTEN, 0)
        for _ in range(4):  # the router spreads requests over both Ps
            assert _answered(_stream(cluster, next(salts)))
        return metrics_of(url).get(WRITTEN, 0) > before

    wait_until(p0_writes, PAUSE_BACK_S, "prefill-0 to write to the pool again", interval_s=0.2)
    print(f"prefill-0 writes again {time.monotonic() - resumed:.1f} s after SIGCONT")
