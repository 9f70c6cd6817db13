"""The launcher decides its children's settings by flags: its own PDROUTER_* / PDWORKER_*
environment never reaches them (PDROUTER_HOST meant for a router once moved every worker), and
--cpu-affinity pins the roles it names, only those."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import httpx
import pytest

from pdrouter.launch.cluster import Cluster
from pdrouter.launch.spec import ClusterSpec

pytestmark = pytest.mark.slow

# TEST-NET-3 (RFC 5737): no interface here has it, so a child that tried to bind it would die.
FOREIGN_HOST = "203.0.113.7"
ALL_CPUS = os.sched_getaffinity(0)
LAST_CPU = max(ALL_CPUS)


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def test_launcher_variables_stay_out_of_its_children(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_cache_dir: Path
) -> None:
    for prefix in ("PDROUTER_", "PDWORKER_"):
        monkeypatch.setenv(prefix + "HOST", FOREIGN_HOST)
        monkeypatch.setenv(prefix + "BLOCK_SIZE", "bogus")
    spec = ClusterSpec(
        pool_size="128MiB",
        worker_args=("--num-kv-blocks", "64", "--model-cache-dir", str(tiny_cache_dir)),
        log_dir=str(tmp_path),
        startup_timeout_s=240.0,
        cpu_affinity=(("prefill", "0"), ("router", str(LAST_CPU))),
        engine_backend="paddle",
        device="cpu",
    )
    with Cluster(spec) as cluster:
        for child in cluster.children:
            if child.name.startswith(("prefill-", "decode-")):  # --engine-backend, --device
                argv = Path(f"/proc/{child.proc.pid}/cmdline").read_bytes().split(b"\0")
                pairs = list(itertools.pairwise(argv))
                assert (b"--engine-backend", b"paddle") in pairs, argv
                assert (b"--device", b"cpu") in pairs, argv
            assert child.proc is not None and child.proc.alive(), child.name
            env = _environ(child.proc.pid)
            leaked = sorted(k for k in env if k.startswith(("PDROUTER_", "PDWORKER_")))
            # Only the secrets the child uses, under its own prefix (no API key was given).
            expected = {
                "router": ["PDROUTER_ADMIN_KEY", "PDROUTER_INTERNAL_SECRET"],
                "pool-owner": ["PDWORKER_ADMIN_KEY"],
                "metadata": [],
                "mooncake_master": [],
            }.get(child.name, ["PDWORKER_ADMIN_KEY", "PDWORKER_INTERNAL_SECRET"])
            assert leaked == expected, (child.name, leaked)
            # --cpu-affinity: P and the router pinned (taskset execs: the same pid), the rest free.
            cpus = {"prefill-0": {0}, "router": {LAST_CPU}}.get(child.name, ALL_CPUS)
            assert os.sched_getaffinity(child.proc.pid) == cpus, child.name
            assert child.health_url.startswith("http://127.0.0.1:")
            assert httpx.get(child.health_url, timeout=10).status_code == 200
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
        resp = httpx.post(f"{cluster.router_url}/v1/completions", json=body, timeout=60)
        assert resp.status_code == 200
