"""One chaos cluster per test module: master + pool owner + 2 P + 2 D + router, real processes.

Every test here breaks something for real (SIGKILL, SIGSTOP, a stopped pool owner, a master
restart, a client that walks away) and then checks the three things that must hold after any
failure: the client got the right answer or the right status within a bound, no worker holds a
KV block or a request, and the router holds no request.

The router runs with short hop timeouts so that a stopped (SIGSTOP) worker is given up on in
seconds; prefill is chunked into small steps so that a long prompt's prefill lasts long enough
to be killed in the middle of it. Every worker runs a host tier (write_through), so the faults
meet blocks in host memory too.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pdrouter.common.proc import wait_for_http
from pdrouter.launch.cluster import Cluster
from pdrouter.launch.spec import ClusterSpec
from tests.e2e.cluster_fixture import QUIET_ENV, THROUGH_P, started_cluster
from tests.e2e.pd.conftest import wait_blocks_free
from tests.metrics_scrape import metrics_of
from tests.wait import wait_until

MODEL = "tiny"
BLOCK_SIZE = 16
NUM_KV_BLOCKS = 640
MAX_MODEL_LEN = 2048
PREFILL_CHUNK_TOKENS = 32  # --max-num-batched-tokens: a 1900-token prompt takes ~60 steps
DECODE_TIMEOUT_S = 3.0  # router: the gap between two decode events before it moves on
HEALTH_INTERVAL_S = 0.5


def chaos_spec(
    log_dir: Path,
    cache_dir: Path,
    decode_timeout_s: float = DECODE_TIMEOUT_S,
    router_args: tuple[str, ...] = (),
) -> ClusterSpec:
    """The cluster every chaos module starts; decode_timeout_s is the router's event bound,
    router_args the module's own router flags."""
    return ClusterSpec(
        model=MODEL,
        num_prefill=2,
        num_decode=2,
        pool_size="256MiB",
        worker_args=(
            f"--block-size={BLOCK_SIZE}",
            f"--num-kv-blocks={NUM_KV_BLOCKS}",
            f"--max-model-len={MAX_MODEL_LEN}",
            f"--max-num-batched-tokens={PREFILL_CHUNK_TOKENS}",
            "--max-num-seqs=128",
            f"--model-cache-dir={cache_dir}",
            "--staging-slots=128",
            "--transfer-batch-blocks=16",
            "--pool-wait-s=10",
            # The host tier on, copying every block: each fault here also meets blocks in
            # host memory and swap-ins (workers/engine/host_tier.py).
            "--swap-space=0.05",
            "--write-policy=write_through",
        ),
        router_args=(
            f"--health-interval-s={HEALTH_INTERVAL_S}",
            f"--decode-timeout-s={decode_timeout_s}",
            "--prefill-timeout-s=60",
            *THROUGH_P,
            *router_args,
        ),
        env=QUIET_ENV,
        log_dir=str(log_dir),
        startup_timeout_s=240.0,
    )


@pytest.fixture(scope="session")
def chaos_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where every worker of the session materializes the tiny checkpoint (once)."""
    return tmp_path_factory.mktemp("chaos-tiny-cache")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, chaos_cache_dir: Path) -> Iterator[Cluster]:
    """A fresh cluster per module: a module may leave its pool or master broken."""
    yield from started_cluster(chaos_spec(tmp_path_factory.mktemp("chaos-logs"), chaos_cache_dir))


def workers_of(c: Cluster) -> list[str]:
    return c.prefill_urls + c.decode_urls


def assert_nothing_held(c: Cluster, timeout_s: float = 20.0, skip: tuple[str, ...] = ()) -> None:
    """No worker holds a KV block or a request, and the router holds no request."""
    for url in workers_of(c):
        if url in skip:
            continue
        assert wait_blocks_free(url, timeout_s) == 0, f"{url} leaked KV blocks"

    def holding() -> dict[str, float]:
        m = metrics_of(c.router_url)
        return {k: v for k, v in m.items() if k.startswith("pdrouter_instance_in_flight")} | {
            "pdrouter_requests_in_progress": m["pdrouter_requests_in_progress"]
        }

    wait_until(holding, timeout_s, "the router to hold nothing", done=lambda h: not any(h.values()))


def instance_state(c: Cluster, url: str) -> dict:
    """The router's view of one instance (from its /health)."""
    body = httpx.get(f"{c.router_url}/health", timeout=5).json()
    return next(i for i in body["instances"] if i["url"] == url)


def restart_dead(c: Cluster, name: str) -> None:
    """One supervision pass restarts the dead worker; then the router must take it back (its
    own checks, --healthy-after of them: a test after this one finds every worker in use)."""
    reports: list[str] = []
    assert c.check(report=reports.append) is None
    assert len(reports) == 1 and reports[0].startswith(f"{name} died (exit code -9); restarting")
    child = c.child(name)
    wait_for_http(child.health_url, 120.0, proc=child.proc)
    url = child.health_url.removesuffix("/health")
    wait_until(lambda: instance_state(c, url)["healthy"], 10.0, f"the router to take {url} back")
