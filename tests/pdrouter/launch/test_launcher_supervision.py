"""Cluster.check(): what the launcher does when a child dies, on real (short-lived) processes."""

from __future__ import annotations

import sys
from pathlib import Path

from pdrouter.launch.cluster import Child, Cluster
from pdrouter.launch.spec import ClusterSpec
from tests.wait import wait_until

EXIT_3 = [sys.executable, "-c", "import sys; sys.exit(3)"]
SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]


def _wait_dead(child: Child, timeout_s: float = 10.0) -> None:
    wait_until(
        lambda: child.proc is None or not child.proc.alive(), timeout_s, f"{child.name} to exit"
    )


def test_dead_worker_is_restarted_up_to_the_limit(tmp_path: Path) -> None:
    cluster = Cluster(ClusterSpec(max_restarts=2, log_dir=str(tmp_path)))
    worker = Child("decode-0", EXIT_3, "http://127.0.0.1:1/health", essential=False)
    cluster._spawn(worker)
    try:
        reports: list[str] = []
        for attempt in (1, 2):
            _wait_dead(worker)
            assert cluster.check(report=reports.append) is None
            assert reports[-1] == (
                f"decode-0 died (exit code 3); restarting ({attempt}/2); log: "
                f"{tmp_path / 'decode-0.log'}"
            )
            assert worker.proc is not None and worker.restarts == attempt
        _wait_dead(worker)
        assert cluster.check(report=reports.append) is None
        assert reports[-1] == "decode-0 died (exit code 3); restart limit reached, left down"
        assert worker.proc is None and len(reports) == 3
        assert cluster.check(report=reports.append) is None and len(reports) == 3  # quiet now
    finally:
        cluster.stop()


def test_dead_essential_process_is_named_and_others_are_stopped(tmp_path: Path) -> None:
    cluster = Cluster(ClusterSpec(log_dir=str(tmp_path)))
    worker = Child("prefill-0", SLEEP, "http://127.0.0.1:1/health", essential=False)
    router = Child("router", EXIT_3, "http://127.0.0.1:1/health", essential=True)
    cluster._spawn(worker)
    cluster._spawn(router)
    try:
        _wait_dead(router)
        assert cluster.check(report=lambda _: None) == "router (exit code 3)"
        assert worker.proc is not None and worker.proc.alive()
    finally:
        cluster.stop()
    assert worker.proc is not None and not worker.proc.alive()
    assert cluster.describe() == [
        f"prefill-0        pid {worker.proc.pid:<7} http://127.0.0.1:1",
        f"router           pid {router.proc.pid:<7} http://127.0.0.1:1",  # type: ignore[union-attr]
    ]
