"""Running a whole `pdrouter.launch.cluster.Cluster` for the length of a fixture."""

from __future__ import annotations

from collections.abc import Iterator

import httpx

from pdrouter.launch.cluster import Cluster
from pdrouter.launch.spec import ClusterSpec

# The workers' environment in every e2e cluster: one thread, quiet Mooncake and glog.
QUIET_ENV = (("OMP_NUM_THREADS", "1"), ("MC_LOG_LEVEL", "ERROR"), ("GLOG_minloglevel", "2"))
# The router flags of a cluster whose tests follow the handoff through the pool: every prompt
# through P (conditional disaggregation would leave their short prompts to D's own prefill,
# the path tests/e2e/pd/test_local_prefill.py follows).
THROUGH_P = ("--local-prefill-below-tokens", "0")


def started_cluster(spec: ClusterSpec) -> Iterator[Cluster]:
    """Start spec's cluster, yield it, stop every process whether the tests pass or not
    (for a fixture to `yield from`)."""
    c = Cluster(spec)
    try:
        c.start()
        yield c
    finally:
        c.stop()


def timeline(c: Cluster, request_id: str) -> dict:
    """The router's timeline of request_id (GET /debug/requests/{id}, with the admin key)."""
    headers = {"Authorization": f"Bearer {c.admin_key}"}
    return httpx.get(f"{c.router_url}/debug/requests/{request_id}", headers=headers).json()
