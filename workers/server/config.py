"""WorkerConfig: everything `pdworker serve` decides, built once from the flags (main.py).

    WorkerConfig
      role, host, port, log_level, internal_secret, router_only
      app           AppConfig: served model names, pending-request cap (the HTTP layer)
      engine        EngineConfig (workers/engine/engine_config.py)
      pd            PDSettings: pool addresses and handoff bounds (roles prefill and decode)
      registration  RegistrationConfig per router to register with (none, one or several)

Frozen, and passed down narrow: the engine gets EngineConfig, the pool client PDSettings, the
registrar RegistrationConfig. Each default is written once, in these dataclasses (and
EngineConfig); the flags and their PDWORKER_* mirrors are generated from these fields
(pdrouter.common.flags). A flag shared by two of them (--admin-key) is one flag.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pdrouter.common.cli_args import ConfigError
from pdrouter.common.flags import flag
from pdrouter.common.http_guard import HeadLimits
from pdrouter.common.tracing import TracingConfig
from pdrouter.wire.pd import MissingKVPolicy
from workers.engine.engine_config import EngineConfig

ROLES = ("mixed", "prefill", "decode")


# One flag, two fields: the key this worker accepts (AppConfig) and sends (RegistrationConfig).
_ADMIN_KEY = flag(
    "--admin-key",
    "the router's admin key: sent when registering, and accepted by this worker's /metrics and "
    "detailed /health (set it through PDWORKER_ADMIN_KEY: argv is public)",
)


@dataclass(frozen=True)
class AppConfig:
    """What the HTTP layer needs; the engine's own settings travel in the engine factory."""

    role: str
    served_model_names: tuple[str, ...] = field(
        metadata=flag(
            "--served-model-name",
            "model name(s) clients must send (default: the --model value)",
            nargs="+",
        )
    )
    # The one in-flight bound of the worker (workers/server/in_flight.py), registered with the
    # router as the worker's capacity.
    max_pending_requests: int = field(
        default=256,
        metadata=flag(
            "--max-pending-requests",
            "requests held at once: OpenAI requests and internal "
            "prefill and decode calls together (running + queued); past it 503 + Retry-After. "
            "Registered with the router, which sends no more at once",
        ),
    )
    # WORKER_BYTES_PER_TOKEN derives the bound (pdrouter.common.body_limit).
    max_body_bytes: int | None = field(
        default=None,
        metadata=flag(
            "--max-body-bytes",
            "largest request body accepted; a longer one is refused with 413 "
            "(default: derived from the context length, max_model_len x 80 + 64 KiB, a longer "
            "body refused with 400 context_length_exceeded before anything tokenizes it)",
        ),
    )
    # The doors (pdrouter.common.doors.worker_door).
    api_key: str | None = field(
        default=None,
        repr=False,
        metadata=flag(
            "--api-key",
            "client API key (or several, comma-separated: each its own prefix cache tenant): "
            "with it, /v1/* need it (or the internal secret) and every path but /health is "
            "locked (set it through PDWORKER_API_KEY: argv is public)",
        ),
    )
    admin_key: str | None = field(default=None, repr=False, metadata=_ADMIN_KEY)

    def __post_init__(self) -> None:
        if self.max_pending_requests < 1:
            raise ConfigError(
                f"--max-pending-requests ({self.max_pending_requests}) must be >= 1: a worker "
                "that holds no request serves none"
            )


@dataclass(frozen=True)
class PDSettings:
    """Where the pool is and how a P or D worker bounds its handoff."""

    master_addr: str = field(
        metadata=flag(
            "--master", "Mooncake master address (roles prefill and decode)", metavar="HOST:PORT"
        )
    )
    metadata_url: str = field(
        metadata=flag(
            "--metadata",
            "Mooncake metadata URL, e.g. http://127.0.0.1:PORT/metadata",
            metavar="URL",
        )
    )
    owner_addr: str | None = field(
        default=None,
        metadata=flag(
            "--pool-owner",
            "same-host shared-memory pool owner (its mooncake_client); none: TCP",
            metavar="HOST:PORT",
        ),
    )
    # Mooncake's transfer endpoint for this client: loopback when all is on one host.
    local_hostname: str = field(
        default="127.0.0.1",
        metadata=flag(
            "--pool-hostname",
            "this host's address as Mooncake advertises it to the pool (TCP): "
            "the pool owners on other hosts must reach it",
            metavar="ADDRESS",
        ),
    )
    num_staging_slots: int = field(
        default=256,
        metadata=flag(
            "--staging-slots",
            "KV blocks the host staging buffer holds (concurrent requests share it)",
        ),
    )
    transfer_batch_blocks: int = field(
        default=64,
        metadata=flag(
            "--transfer-batch-blocks",
            "most blocks moved per swap + pool call (at most --staging-slots)",
        ),
    )
    # workers/pool/handoff_path.py: auto takes device pointers when the cache is on a GPU, the
    # pool owner is on this host and a start-up self-test passes.
    handoff_path: Literal["auto", "device", "host"] = field(
        default="auto",
        metadata=flag(
            "--handoff-path",
            "how KV blocks go through the pool: device (GPU staging, device pointers to "
            "Mooncake's CUDA wheel; refuse to start if impossible), host (page-locked host "
            "staging), auto (device when it works, else host; /health says which and why)",
        ),
    )
    # workers/pool/checked_pool.py: every block in the pool carries a header proving its
    # content. Off by default: it cost 12-18% of a 4K handoff on the device path and 60% on
    # host staging (docs/benchmarks/handoff.md, "Integrity"), above the 3% it had to stay under.
    pool_integrity: Literal["on", "off"] = field(
        default="off",
        metadata=flag(
            "--pool-integrity",
            "on: every KV block put to the pool carries a header (format, model, key, tokens, "
            "length, payload checksum) and every read checks it; a block that fails is a miss, "
            "counted and removed. Every worker of one pool needs the same setting",
        ),
    )
    wait_s: float = field(
        default=30.0,
        metadata=flag("--pool-wait-s", "bound on waiting for free staging slots or KV blocks"),
    )
    missing_kv_policy: MissingKVPolicy = field(
        default="recompute",
        metadata=flag(
            "--missing-kv-policy", "decode: recompute blocks missing from the pool, or answer 502"
        ),
    )
    # The pool as a shared prefix cache (workers/handoff/pool_prefix.py, measured in
    # docs/benchmarks/cache.md).
    pool_prefix: bool = field(
        default=True,
        metadata=flag(
            "--no-pool-prefix-cache",
            "prefill: never read a prompt's prefix from the pool "
            "(compute what the device cache lacks)",
            negate=True,
        ),
    )
    pool_prefix_min_tokens: int = field(
        default=32,
        metadata=flag(
            "--pool-prefix-min-tokens", "prefill: smallest pool hit (tokens) worth loading"
        ),
    )
    pool_load_timeout_s: float = field(
        default=2.0,
        metadata=flag(
            "--pool-load-timeout-s",
            "prefill: bound on a pool prefix load; past it the request recomputes",
        ),
    )
    write_while_computing: bool = field(
        default=True,
        metadata=flag(
            "--no-write-while-computing",
            "prefill: write a prompt's blocks only once its whole "
            "prefill is done (default: the blocks of each finished chunk are written while the "
            "next chunk computes)",
            negate=True,
        ),
    )
    writeback: bool = field(
        default=True,
        metadata=flag(
            "--no-decode-writeback",
            "decode: do not write prompt + output blocks back to the pool "
            "when a request ends (workers/handoff/writeback.py)",
            negate=True,
        ),
    )
    writeback_max_in_flight: int = field(
        default=4,
        metadata=flag(
            "--writeback-max-in-flight",
            "decode: most write-backs running at once (more are skipped)",
        ),
    )
    # D starts with P (workers/decode/prefetch.py): reservations the router's early decode
    # makes before P answers.
    prefetch_max_fraction: float = field(
        default=0.25,
        metadata=flag(
            "--prefetch-max-fraction",
            "decode: most of the KV cache that prefetch reservations (prompt blocks reserved "
            "before P answers) may hold at once; past it a prefetch is refused and the request "
            "is served in the usual order (0: refuse every prefetch)",
        ),
    )
    prefetch_ttl_s: float = field(
        default=30.0,
        metadata=flag(
            "--prefetch-ttl-s",
            "decode: a prefetch reservation no decode adopted is released after this long",
        ),
    )
    prefetch_poll_s: float = field(
        default=0.005,
        metadata=flag(
            "--prefetch-poll-s",
            "decode: how often a prefetch asks the pool whether P's next blocks are there",
        ),
    )

    def __post_init__(self) -> None:
        if not 0 <= self.prefetch_max_fraction <= 1 or self.prefetch_ttl_s <= 0:
            raise ConfigError(
                f"--prefetch-max-fraction ({self.prefetch_max_fraction}) must be within 0..1 "
                f"and --prefetch-ttl-s ({self.prefetch_ttl_s}) > 0"
            )
        if self.prefetch_poll_s <= 0:
            raise ConfigError(f"--prefetch-poll-s ({self.prefetch_poll_s}) must be > 0")
        if self.pool_prefix_min_tokens < 0 or self.pool_load_timeout_s <= 0:
            raise ConfigError(
                f"--pool-prefix-min-tokens ({self.pool_prefix_min_tokens}) must be >= 0 and "
                f"--pool-load-timeout-s ({self.pool_load_timeout_s}) > 0"
            )
        if self.writeback_max_in_flight < 1:
            raise ConfigError(
                f"--writeback-max-in-flight ({self.writeback_max_in_flight}) must be >= 1"
            )
        if self.num_staging_slots < 1 or self.transfer_batch_blocks < 1:
            raise ConfigError(
                f"--staging-slots ({self.num_staging_slots}) and --transfer-batch-blocks "
                f"({self.transfer_batch_blocks}) must be >= 1"
            )
        if self.transfer_batch_blocks > self.num_staging_slots:
            raise ConfigError(
                f"--transfer-batch-blocks ({self.transfer_batch_blocks}) cannot exceed "
                f"--staging-slots ({self.num_staging_slots}): a batch takes one slot per block"
            )


@dataclass(frozen=True)
class RegistrationConfig:
    """Where to register and how; built once from the worker's flags."""

    router_url: str = field(
        metadata=flag(
            "--router",
            "router to register with once ready (roles prefill and decode); "
            "heartbeats, and deregisters on a clean shutdown. Give it once per router (the "
            "environment mirror takes a comma-separated list): each is kept independently",
            metavar="URL",
            nargs="append",
        )
    )
    advertise_url: str = field(
        metadata=flag(
            "--advertise-url",
            "how the router reaches this worker (default: http://HOST:PORT)",
            metavar="URL",
        )
    )
    admin_key: str | None = field(default=None, repr=False, metadata=_ADMIN_KEY)
    heartbeat_interval_s: float = field(
        default=2.0,
        metadata=flag(
            "--heartbeat-interval-s",
            "seconds between heartbeats to --router (at most a third of its TTL)",
        ),
    )
    call_timeout_s: float = 2.0
    ready_poll_s: float = 0.2


@dataclass(frozen=True)
class WorkerConfig:
    role: str = field(
        metadata=flag("--role", "what this worker serves", choices=ROLES, cli_default="mixed")
    )
    app: AppConfig
    engine: EngineConfig
    host: str = field(default="127.0.0.1", metadata=flag("--host", "address to bind"))
    port: int = field(default=8100, metadata=flag("--port", "HTTP port"))
    log_level: str = field(
        default="info", metadata=flag("--log-level", "debug, info, warning or error")
    )
    pd: PDSettings | None = None  # required by the prefill and decode roles
    registration: tuple[RegistrationConfig, ...] = ()  # one per router, each independent
    internal_secret: str | None = field(
        default=None,
        repr=False,
        metadata=flag(
            "--internal-secret",
            "shared secret /internal/* require in X-PD-Internal-Secret (the "
            "router's --internal-secret); none: open (bind loopback)",
        ),
    )
    # The doors (pdrouter.common.doors.worker_door): a worker behind a router with a keys file.
    router_only: bool = field(
        default=False,
        metadata=flag(
            "--router-only",
            "only the router (the internal secret) may call this worker: /v1/* and the "
            "tokenizer routes need --internal-secret (or --api-key when set), /metrics the "
            "secret or --admin-key. For workers behind a router with --api-keys-file, whose "
            "per-key limits a client calling a worker would dodge (`pdrouter launch` sets it "
            "then); needs --internal-secret",
        ),
    )
    head_limits: HeadLimits = field(default_factory=HeadLimits)  # request heads (http_guard)
    tracing: TracingConfig = field(default_factory=TracingConfig)  # --otlp-endpoint

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ConfigError(f"unknown role {self.role!r} (one of {', '.join(ROLES)})")
        if self.role != "mixed" and self.pd is None:
            raise ConfigError(
                f"pdworker serve --role {self.role} needs --master HOST:PORT and --metadata URL "
                "(the Mooncake master's RPC address and metadata URL; `pdrouter launch` starts "
                "one and passes them)"
            )
        if self.router_only and not self.internal_secret:
            raise ConfigError(
                "--router-only needs --internal-secret (PDWORKER_INTERNAL_SECRET, the router's "
                "--internal-secret): without it no one could call this worker"
            )
        if (
            self.pd is not None
            and self.pd.pool_integrity == "on"
            and (self.engine.tensor_parallel_size > 1)
        ):
            raise ConfigError(
                "--pool-integrity on checks whole-block objects: it does not yet cover the "
                "shards of --tensor-parallel-size > 1 (turn one of them off)"
            )


def advertise_url_of(host: str, port: int, given: str | None) -> str:
    """The URL the router should call: given, else http://host:port for a concrete host."""
    if given:
        return given.rstrip("/")
    if host in ("0.0.0.0", "::", ""):
        raise ConfigError(
            f"--host {host!r} is not an address a router can call: give --advertise-url "
            "http://ADDRESS:PORT (how the router reaches this worker)"
        )
    return f"http://{host}:{port}"
