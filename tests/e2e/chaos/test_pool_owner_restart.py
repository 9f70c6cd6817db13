"""The pool owner killed (kill -9) or stopped (SIGSTOP) for 20 s, or a prefill or decode worker
stopped 20 s (past the owner's 10 s client TTL), under a serving cluster: every request is
answered (recompute), no stream is cut silently, every worker's /health says "degraded" while
the pool is away and "ok" once it is back, and the handoff goes through the pool again within
a bound, because the launcher restarts the owner on its ports and the workers' pool clients
reconnect by themselves. (The owner's 20 s pause also passed with the clients' probe off in one run:
Mooncake's own reconnect loop covers that case when its ping fails; the stopped worker, whose
ping never fails, is the case only the probe heals.)

The three 20 s pauses are marked `soak`: `make test-soak` and `make test-all` run them, `make
test` leaves them out to stay under 15 minutes (the pool's own tests pause past the TTL inside
it: tests/workers/pool/test_self_heal.py)."""

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
WORKER_PAUSE_S = 20.0  # past the owner's TTL: it drops a client it has not heard from for 10 s
WRITTEN = "pdworker_pool_blocks_written_total"
LOADED = "pdworker_pool_blocks_loaded_total"
DEGRADED_WITHIN_S = 10.0  # the clients' probe runs every second, each probe bounded by 1 s


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, chaos_cache_dir: Path) -> Iterator[Cluster]:
    """One chaos cluster for the module, supervised as `pdrouter launch` supervises it; each
    test leaves it serving through the pool again (that is what each one waits for)."""
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


def _in_flight(c: Cluster) -> float:
    """Calls the router holds on its instances now."""
    samples = metrics_of(c.router_url)
    return sum(v for k, v in samples.items() if k.startswith("pdrouter_instance_in_flight{"))


def _statuses(c: Cluster) -> set[str]:
    """The /health status of every P and D ("unreachable" for one that does not answer)."""

    def status(url: str) -> str:
        try:
            return str(httpx.get(f"{url}/health", timeout=2.0).json()["status"])
        except (httpx.HTTPError, ValueError, KeyError):
            return "unreachable"

    return {status(url) for url in [*c.prefill_urls, *c.decode_urls]}


def _pool_in_use(c: Cluster, first_salt: int, timeout_s: float, what: str) -> None:
    salts = iter(range(first_salt, first_salt + 400, 2))
    wait_until(lambda: _read_from_pool(c, next(salts)), timeout_s, what, interval_s=0.2)


def test_owner_killed_every_request_answered_and_the_pool_back(cluster: Cluster) -> None:
    _pool_in_use(cluster, 1000, 30.0, "the handoff through the pool before the fault")
    owner = cluster.child("pool-owner")
    first, restarts = owner.proc, owner.restarts
    with ThreadPoolExecutor(16) as pool:
        streams = [pool.submit(_stream, cluster, 100 + i) for i in range(16)]
        wait_until(lambda: _in_flight(cluster), 30.0, "the streams to be in flight",
                   done=lambda n: n > 0)  # fmt: skip  # the fault lands while they run
        first.kill()  # type: ignore[union-attr]
        killed = time.monotonic()
        results = [f.result(timeout=120) for f in streams]
    assert all(_answered(r) for r in results), [r[-1:] for r in results]
    _pool_in_use(cluster, 2000, KILL_BACK_S, "the handoff through the restarted owner")
    print(f"pool back {time.monotonic() - killed:.1f} s after the kill")
    assert owner.proc is not first and owner.restarts == restarts + 1
    assert cluster.router_url and httpx.get(f"{cluster.router_url}/health").status_code == 200


@pytest.mark.soak
def test_owner_stopped_20s_the_pool_back_within_10s_of_sigcont(cluster: Cluster) -> None:
    _pool_in_use(cluster, 3000, 30.0, "the handoff through the pool before the fault")
    owner = cluster.child("pool-owner")
    assert _statuses(cluster) == {"ok"}
    owner.proc.freeze()  # type: ignore[union-attr]
    try:
        paused = time.monotonic()
        with ThreadPoolExecutor(4) as pool:  # served meanwhile, by recompute
            results = list(pool.map(lambda s: _stream(cluster, s), range(500, 504)))
        assert all(_answered(r) for r in results), [r[-1:] for r in results]
        wait_until(lambda: _statuses(cluster) == {"degraded"}, DEGRADED_WITHIN_S,
                   "every P and D to say degraded while the owner is stopped")  # fmt: skip
        time.sleep(max(0.0, PAUSE_S - (time.monotonic() - paused)))  # the fault: 20 s
        assert _statuses(cluster) == {"degraded"}
    finally:
        owner.proc.signal(signal.SIGCONT)  # type: ignore[union-attr]
    resumed = time.monotonic()
    _pool_in_use(cluster, 4000, PAUSE_BACK_S, "the handoff through the pool after SIGCONT")
    print(f"pool back {time.monotonic() - resumed:.1f} s after SIGCONT")
    wait_until(lambda: _statuses(cluster) == {"ok"}, PAUSE_BACK_S, "every P and D to say ok")


@pytest.mark.soak
@pytest.mark.parametrize(("name", "counter"), [("prefill-0", WRITTEN), ("decode-0", LOADED)])
def test_a_worker_stopped_20s_uses_the_pool_again(
    cluster: Cluster, name: str, counter: str
) -> None:
    # The owner unmaps the staging of a worker silent for 10 s; the worker's own ping thread
    # never notices: without the pool client's probe, that worker wrote (P) or read (D)
    # nothing through the pool again until restarted.
    role, index = name.split("-")
    url = (cluster.prefill_urls if role == "prefill" else cluster.decode_urls)[int(index)]
    worker = cluster.child(name).proc
    worker.freeze()  # type: ignore[union-attr]
    try:
        time.sleep(WORKER_PAUSE_S)  # the fault: a pause of this length
    finally:
        worker.signal(signal.SIGCONT)  # type: ignore[union-attr]
    resumed = time.monotonic()
    salts = iter(range(5000, 5800, 2))

    def uses_the_pool() -> bool:
        before = metrics_of(url).get(counter, 0)
        for _ in range(4):  # the router spreads requests over both Ps and both Ds
            salt = next(salts)
            assert _answered(_stream(cluster, salt))
            assert _answered(_stream(cluster, salt))  # D reads what the pool holds from before
        return metrics_of(url).get(counter, 0) > before

    wait_until(uses_the_pool, PAUSE_BACK_S, f"{name} to use the pool again", interval_s=0.2)
    print(f"{name} uses the pool again {time.monotonic() - resumed:.1f} s after SIGCONT")
