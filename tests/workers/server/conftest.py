"""Fixtures: one real `pdworker serve --role mixed --model tiny` process for the server tests.

Started once per session (a Paddle process costs seconds and a core), stopped by PID in the
finalizer whether the tests pass or not. The tiny checkpoint is materialized under a session
temp folder, which the tests' own tokenizer reads too, so expected token counts come from the
very files the server loaded.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pdrouter.common.proc import ManagedProcess, find_free_port, wait_for_http
from tests.metrics_scrape import metrics_of
from tests.repo import REPO_ROOT
from tests.wait import wait_until
from workers.engine.tiny import materialize_tiny
from workers.engine.tokenizer import Tokenizer

BLOCK_SIZE = 16
NUM_KV_BLOCKS = 128
MAX_MODEL_LEN = 1024
STARTUP_TIMEOUT_S = 180.0
# Run these tests against a worker already serving there (same flags as start_worker's).
EXTERNAL_WORKER_ENV = "PDROUTER_TEST_WORKER_URL"


@dataclass
class WorkerHandle:
    base_url: str
    proc: ManagedProcess | None

    @property
    def api_url(self) -> str:
        return f"{self.base_url}/v1"

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics as {'name{label="v",...}': value}."""
        return metrics_of(self.base_url)

    def wait_until(
        self, predicate: Callable[[dict[str, float]], bool], timeout_s: float = 30.0
    ) -> dict[str, float]:
        """The first /metrics sample for which predicate(sample) holds."""
        return wait_until(self.metrics, timeout_s, "a /metrics sample to match", done=predicate)

    def wait_idle(self, timeout_s: float = 30.0) -> dict[str, float]:
        """The first /metrics sample with no request running, waiting or holding a KV block."""

        def idle(m: dict[str, float]) -> bool:
            busy = (
                m["pdworker_kv_blocks_used"],
                m["pdworker_num_requests_running"],
                m["pdworker_num_requests_waiting"],
                m["pdworker_num_requests_in_flight"],
            )
            return busy == (0, 0, 0, 0)

        return wait_until(self.metrics, timeout_s, "the worker to be idle", done=idle)


def worker_env(cache_dir: Path) -> dict[str, str]:
    return {
        "OMP_NUM_THREADS": "1",
        "GLOG_minloglevel": "2",
        "PDWORKER_MODEL_CACHE_DIR": str(cache_dir),
    }


def start_worker(
    log_dir: Path, cache_dir: Path, *extra_args: str, name: str = "pdworker-mixed"
) -> WorkerHandle:
    """Start a mixed worker on a free port and wait for /health (stopped by the caller)."""
    port = find_free_port()
    argv = [
        sys.executable, "-m", "workers.cli", "serve", "--role", "mixed", "--model", "tiny",
        "--port", str(port), "--block-size", str(BLOCK_SIZE),
        "--num-kv-blocks", str(NUM_KV_BLOCKS), "--max-model-len", str(MAX_MODEL_LEN),
        *extra_args,
    ]  # fmt: skip
    proc = ManagedProcess(
        name, argv, env=worker_env(cache_dir), log_path=log_dir / f"{name}.log",
        cwd=str(REPO_ROOT),
    )  # fmt: skip
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_for_http(f"{base_url}/health", STARTUP_TIMEOUT_S, proc)
    except BaseException:
        proc.stop()
        raise
    return WorkerHandle(base_url, proc)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_cache_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(materialize_tiny("tiny", 0, tiny_cache_dir))


@pytest.fixture(scope="session")
def worker(
    tmp_path_factory: pytest.TempPathFactory, tiny_cache_dir: Path
) -> Iterator[WorkerHandle]:
    external = os.environ.get(EXTERNAL_WORKER_ENV)
    if external:
        # A worker started by hand with the flags above (e.g. on a GPU host): used, not owned.
        wait_for_http(f"{external}/health", STARTUP_TIMEOUT_S)
        yield WorkerHandle(external.rstrip("/"), None)
        return
    handle = start_worker(tmp_path_factory.mktemp("worker-logs"), tiny_cache_dir)
    try:
        yield handle
    finally:
        assert handle.proc is not None
        handle.proc.stop()
