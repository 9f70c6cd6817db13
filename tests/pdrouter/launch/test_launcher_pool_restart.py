"""The launcher restarts the pool's processes (owner, master, metadata) instead of stopping the
cluster, on real short-lived processes (tests/e2e/chaos/test_pool_owner_restart.py kills the
real owner of a real cluster)."""

from __future__ import annotations

import sys
from pathlib import Path

from pdrouter.launch.cluster import Child, Cluster
from pdrouter.launch.spec import ClusterSpec
from tests.wait import wait_until

EXIT_3 = [sys.executable, "-c", "import sys; sys.exit(3)"]


def test_a_dead_pool_owner_is_restarted_on_its_command_line_not_fatal(tmp_path: Path) -> None:
    cluster = Cluster(ClusterSpec(max_restarts=1, log_dir=str(tmp_path)))
    owner = Child("pool-owner", EXIT_3, "http://127.0.0.1:1/health", True, restartable=True)
    cluster._spawn(owner)
    try:
        reports: list[str] = []
        first = owner.proc
        wait_until(lambda: not first.alive(), 10.0, "the owner to exit")  # type: ignore[union-attr]
        assert cluster.check(report=reports.append) is None
        assert reports == [
            f"pool-owner died (exit code 3); restarting (1/1); log: {tmp_path / 'pool-owner.log'}"
        ]
        assert owner.proc is not None and owner.proc is not first
        assert owner.proc.argv == EXIT_3  # the same command line: the same ports
        wait_until(lambda: not owner.proc.alive(), 10.0, "the owner to exit again")  # type: ignore[union-attr]
        assert cluster.check(report=reports.append) is None  # the router keeps serving
        assert reports[-1] == "pool-owner died (exit code 3); restart limit reached, left down"
    finally:
        cluster.stop()
