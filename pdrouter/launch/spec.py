"""ClusterSpec: what `pdrouter launch` (and every test or benchmark cluster) starts, and the
check of its --model that runs before anything starts."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path

from pdrouter.common.cli_args import ConfigError, env_name
from pdrouter.common.flags import flag
from pdrouter.launch.affinity import parse_affinity

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


def _split(flags: str) -> tuple[str, ...]:
    """--worker-args / --router-args: one string of flags, split as a shell would."""
    return tuple(shlex.split(flags))


@dataclass(frozen=True)
class ClusterSpec:
    """What to start; ports 0 are picked free. The flags of `pdrouter launch` are generated
    from these fields (pdrouter.common.flags)."""

    model: str = field(
        default="tiny",
        metadata=flag("--model", "'tiny', 'demo' or a Hugging Face checkpoint folder"),
    )
    num_prefill: int = field(default=1, metadata=flag("--prefill", "prefill workers to start"))
    num_decode: int = field(default=1, metadata=flag("--decode", "decode workers to start"))
    num_mixed: int = field(
        default=0, metadata=flag("--mixed", "mixed (colocated) workers to start")
    )
    # 0 (a free port) for tests and benchmarks; the command line serves on a known one.
    router_port: int = field(default=0, metadata=flag("--port", "router port", cli_default=8000))
    pool_size: str = field(
        default="512MiB",
        metadata=flag("--pool-size", "KV pool memory of the pool owner (`pdworker pool --size`)"),
    )
    worker_args: tuple[str, ...] = field(
        default=(),
        metadata=flag(
            "--worker-args",
            "extra flags for every `pdworker serve`, e.g. '--block-size 16'",
            parse=_split,
            metavar="'FLAGS'",
        ),
    )
    # Every worker's model runner and device (`pdworker serve --engine-backend`, `--device`);
    # None leaves the worker's own default (auto; the CPU). --worker-args still win.
    engine_backend: str | None = field(
        default=None,
        metadata=flag(
            "--engine-backend",
            "every worker's model runner: auto, paddle or torch (PyTorch, e.g. on a GPU host "
            "without paddlepaddle-gpu); `pdworker serve --engine-backend`",
            choices=("auto", "paddle", "torch"),
        ),
    )
    device: str | None = field(
        default=None,
        metadata=flag(
            "--device",
            "every worker's device: cpu, gpu or gpu:N (`pdworker serve --device`); workers "
            "on one GPU share it",
        ),
    )
    tensor_parallel_size: int = field(
        default=1,
        metadata=flag(
            "--tensor-parallel-size",
            "ranks (processes) per worker, every role (`pdworker serve --tensor-parallel-size`)",
            aliases=("-tp",),
        ),
    )
    # Per role, one size per worker in turn ("--prefill 2 --prefill-tp 1 2": one of each);
    # empty: --tensor-parallel-size.
    prefill_tp: tuple[int, ...] = field(
        default=(),
        metadata=flag("--prefill-tp", "prefill workers' TP sizes, one per worker in turn"),
    )
    decode_tp: tuple[int, ...] = field(
        default=(), metadata=flag("--decode-tp", "decode workers' TP sizes, one per worker in turn")
    )
    mixed_tp: tuple[int, ...] = field(
        default=(), metadata=flag("--mixed-tp", "mixed workers' TP sizes, one per worker in turn")
    )
    router_args: tuple[str, ...] = field(
        default=(),
        metadata=flag(
            "--router-args", "extra flags for `pdrouter serve`", parse=_split, metavar="'FLAGS'"
        ),
    )
    # (role, CPUs) pairs: the children of a role start pinned (pdrouter/launch/affinity.py).
    cpu_affinity: tuple[tuple[str, str], ...] = field(
        default=(),
        metadata=flag(
            "--cpu-affinity",
            "pin roles to CPUs, e.g. 'prefill=0 decode=1 router=1 pool=1' (roles: prefill, "
            "decode, mixed, router, pool; CPUs as taskset -c reads them); unnamed: every CPU",
            parse=parse_affinity,
            metavar="'ROLE=CPUS ...'",
        ),
    )
    env: tuple[tuple[str, str], ...] = (("OMP_NUM_THREADS", "1"), ("MC_LOG_LEVEL", "ERROR"))
    log_dir: str | None = field(
        default=None, metadata=flag("--log-dir", "where child logs go (default: a temp dir)")
    )
    startup_timeout_s: float = 300.0
    max_restarts: int = field(
        default=3, metadata=flag("--max-restarts", "restarts per dead worker")
    )
    api_key: str | None = field(
        default=None,
        repr=False,
        metadata=flag(
            "--api-key",
            "API key the router and the workers' /v1/* require; with it every other "
            "door is locked too (docs/security.md). Prefer PDROUTER_API_KEY: argv is public",
        ),
    )
    # The router's per-key limits (pdrouter/router/tenancy/keys_file.py). A flag of the launcher
    # too, so that its PDROUTER_API_KEYS_FILE mirror is the launcher's: the launcher hands its
    # children none of its own variables, and a keys file set that way used to be dropped,
    # leaving the router open.
    api_keys_file: str | None = field(
        default=None,
        metadata=flag(
            "--api-keys-file",
            "JSON file of API keys with per-key limits, for the router (`pdrouter serve "
            "--api-keys-file`); the workers then answer the router alone (--router-only)",
        ),
    )
    # Same-host workers reach the pool owner through shared memory.
    shared_memory: bool = field(
        default=True,
        metadata=flag(
            "--pool-tcp",
            "workers reach the pool over TCP instead of same-host shared memory",
            negate=True,
        ),
    )
    # None: a fresh random one per cluster.
    internal_secret: str | None = field(
        default=None,
        repr=False,
        metadata=flag(
            "--internal-secret",
            "secret the router sends and the workers require on /internal/* "
            "(default: a random one per launch; children get it through their environment)",
        ),
    )
    # The admin key of router, workers and pool owner; None: a fresh random one per cluster.
    admin_key: str | None = field(
        default=None,
        repr=False,
        metadata=flag(
            "--admin-key",
            "admin key of the router's admin API, /metrics and detailed /health "
            "(and the workers' and pool owner's); default: a random one per launch, written to "
            "LOG_DIR/admin_key (mode 0600). Prefer PDROUTER_ADMIN_KEY: argv is public",
        ),
    )

    host: str = "127.0.0.1"  # every process binds it: the launcher's processes share one host

    @property
    def keys_file_mode(self) -> bool:
        """Whether the router gets an --api-keys-file (the launcher's, in router_args, or its
        PDROUTER_ mirror in env): its workers then start --router-only, so that no client
        dodges the keys' limits by calling a worker (pdrouter.common.doors)."""
        keys_flag = "--api-keys-file"
        in_router_args = keys_flag in {arg.split("=", 1)[0] for arg in self.router_args}
        in_env = any(name == env_name(keys_flag) for name, _ in self.env)
        return bool(self.api_keys_file) or in_router_args or in_env

    def tp_size(self, role: str, index: int) -> int:
        """The TP size of worker `index` of this role."""
        sizes = {"prefill": self.prefill_tp, "decode": self.decode_tp, "mixed": self.mixed_tp}[role]
        return sizes[index % len(sizes)] if sizes else self.tensor_parallel_size


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
