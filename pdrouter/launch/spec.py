"""ClusterSpec: what `pdrouter launch` (and every test or benchmark cluster) starts, and the
check of its --model that runs before anything starts."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pdrouter.common.cli_args import ConfigError

# The models a worker knows by name (workers.engine.tiny.PRESETS, workers.models.packaged):
# written here too because pdrouter never imports workers/; a test keeps the two equal.
BUILTIN_MODELS = ("demo", "tiny", "tiny-large")


def check_model(model: str) -> None:
    """ConfigError (one line) unless model is a built-in name or a checkpoint folder with a
    config.json: a bad --model fails before the master and the pool start, not after."""
    if model in BUILTIN_MODELS:
        return
    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return
    what = (
        "a folder without config.json" if path.is_dir() else "neither a built-in name nor a folder"
    )
    raise ConfigError(
        f"--model {model!r} is {what}; give one of {', '.join(BUILTIN_MODELS)} or a Hugging "
        "Face checkpoint folder (config.json, tokenizer.json, *.safetensors)"
    )


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
