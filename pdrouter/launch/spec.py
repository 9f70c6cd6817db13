"""ClusterSpec: what `pdrouter launch` (and every test or benchmark cluster) starts."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ClusterSpec:
    """What to start; ports 0 are picked free."""

    model: str = "tiny"
    num_prefill: int = 1
    num_decode: int = 1
    num_mixed: int = 0
    router_port: int = 0
    pool_size: str = "512MiB"  # `pdworker pool --size` (e.g. 2GiB, 512MiB)
    worker_args: tuple[str, ...] = ()  # extra `pdworker serve` flags for every worker
    router_args: tuple[str, ...] = ()  # extra `pdrouter serve` flags
    env: tuple[tuple[str, str], ...] = (("OMP_NUM_THREADS", "1"), ("MC_LOG_LEVEL", "ERROR"))
    log_dir: str | None = None
    startup_timeout_s: float = 300.0
    max_restarts: int = 3
    api_key: str | None = field(default=None, repr=False)
    shared_memory: bool = True  # same-host workers reach the pool owner through shared memory
    # The router <-> worker secret on /internal/*; None: a fresh random one per cluster.
    internal_secret: str | None = field(default=None, repr=False)
    # The admin key of router, workers and pool owner; None: a fresh random one per cluster.
    admin_key: str | None = field(default=None, repr=False)
    host: str = "127.0.0.1"  # every process binds it: the launcher's processes share one host


@dataclass(frozen=True)
class PoolEndpoints:
    """Where the cluster's pool is.

    master_addr / metadata_url: every worker (`--master`, `--metadata`).
    owner_addr: same-host workers that want shared memory (`--pool-owner`).
    owner_url: the owner's /health and /metrics.  admin_url: the master's /metrics etc.
    """

    master_addr: str
    metadata_url: str
    owner_addr: str
    owner_url: str
    admin_url: str
