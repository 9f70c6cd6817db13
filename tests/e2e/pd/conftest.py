"""One PD cluster per test session: master + pool owner + 2 P + 2 D + 1 mixed + router.

Started through `pdrouter.launch.cluster.Cluster` (what `pdrouter launch` runs), every process a
real one on loopback, stopped by PID in the finalizer whether the tests pass or not. Small on
purpose (2 cores): few KV blocks, short max_tokens. The mixed worker is the colocated
baseline every PD answer is compared with. The demo model's modules share a smaller cluster of
their own (demo_cluster).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from pdrouter.launch.cluster import Cluster
from pdrouter.launch.spec import ClusterSpec
from tests.e2e.cluster_fixture import QUIET_ENV, THROUGH_P, started_cluster
from tests.metrics_scrape import metrics_of
from tests.wait import wait_until

BLOCK_SIZE = 16
NUM_KV_BLOCKS = 96
# --max-num-batched-tokens: prompts over 64 tokens are prefilled in chunks, and P writes the
# blocks of each finished chunk while the next one computes
PREFILL_CHUNK_TOKENS = 64
MAX_MODEL_LEN = 512
MODEL = "tiny"


def wait_blocks_free(base_url: str, timeout_s: float = 20.0) -> float:
    """Until a worker holds no KV block and runs nothing; its blocks-used value then (0)."""

    def idle(m: dict[str, float]) -> bool:
        waiting = m["pdworker_num_requests_running"] + m["pdworker_num_requests_waiting"]
        return m["pdworker_kv_blocks_used"] + waiting == 0

    m = wait_until(lambda: metrics_of(base_url), timeout_s, f"{base_url} idle", done=idle)
    return m["pdworker_kv_blocks_used"]


@dataclass
class PDCluster:
    cluster: Cluster
    cache_dir: Path

    @property
    def router_url(self) -> str:
        return self.cluster.router_url

    @property
    def mixed_url(self) -> str:
        return self.cluster.mixed_urls[0]

    @property
    def worker_urls(self) -> list[str]:
        c = self.cluster
        return c.prefill_urls + c.decode_urls + c.mixed_urls

    def fingerprint(self) -> str:
        return httpx.get(f"{self.router_url}/health", timeout=10).json()["fingerprint"]

    def pool_keys(self) -> set[str]:
        """Every key the Mooncake master knows, from its admin port."""
        text = httpx.get(f"{self.cluster.master_admin_url}/get_all_keys", timeout=10).text
        return {line.strip() for line in text.splitlines() if line.strip()}


@pytest.fixture(scope="session")
def pd_cluster(
    tmp_path_factory: pytest.TempPathFactory, tiny_cache_dir: Path
) -> Iterator[PDCluster]:
    cache_dir = tiny_cache_dir
    log_dir = tmp_path_factory.mktemp("pd-logs")
    spec = ClusterSpec(
        model=MODEL,
        num_prefill=2,
        num_decode=2,
        num_mixed=1,
        pool_size="256MiB",
        worker_args=(
            "--block-size",
            str(BLOCK_SIZE),
            "--num-kv-blocks",
            str(NUM_KV_BLOCKS),
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--max-num-batched-tokens",
            str(PREFILL_CHUNK_TOKENS),
            "--model-cache-dir",
            str(cache_dir),
            "--staging-slots",
            "64",
            "--transfer-batch-blocks",
            "8",
        ),
        router_args=("--health-interval-s", "0.5", *THROUGH_P),
        env=QUIET_ENV,
        log_dir=str(log_dir),
        startup_timeout_s=240.0,
    )
    cluster = Cluster(spec)
    try:
        cluster.start()
        yield PDCluster(cluster, cache_dir)
    finally:
        cluster.stop()


@pytest.fixture(scope="package")
def demo_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """The packaged demo model: 1 P, 1 D, 1 mixed, every prompt through P; one for the
    modules that use it (its greedy answers, structured output and tools)."""
    spec = ClusterSpec(
        model="demo",
        num_prefill=1,
        num_decode=1,
        num_mixed=1,
        pool_size="256MiB",
        worker_args=("--block-size", str(BLOCK_SIZE), "--num-kv-blocks", "64"),
        router_args=THROUGH_P,
        env=QUIET_ENV,
        log_dir=str(tmp_path_factory.mktemp("demo-logs")),
        startup_timeout_s=240.0,
    )
    yield from started_cluster(spec)
