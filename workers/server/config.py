"""WorkerConfig: everything `pdworker serve` decides, built once from the flags (main.py).

    WorkerConfig
      role, host, port, log_level, internal_secret
      app           AppConfig: served model names, pending-request cap (the HTTP layer)
      engine        EngineConfig (workers/engine/engine_config.py)
      pd            PDSettings: pool addresses and handoff bounds (roles prefill and decode)
      registration  RegistrationConfig per router to register with (none, one or several)

Frozen, and passed down narrow: the engine gets EngineConfig, the pool client PDSettings, the
registrar RegistrationConfig. Each default is written once, in these dataclasses (and
EngineConfig); the flags take theirs from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdrouter.common.cli_args import ConfigError
from pdrouter.common.http_guard import HeadLimits
from pdrouter.wire.pd import MissingKVPolicy
from workers.engine.engine_config import EngineConfig

ROLES = ("mixed", "prefill", "decode")


@dataclass(frozen=True)
class AppConfig:
    """What the HTTP layer needs; the engine's own settings travel in the engine factory."""

    role: str
    served_model_names: tuple[str, ...]
    max_pending_requests: int = 256
    # Request bodies over it are refused with 413; None: derived from the context length
    # (pdrouter.common.body_limit, WORKER_BYTES_PER_TOKEN), refused with 400.
    max_body_bytes: int | None = None
    # The doors (pdrouter.common.doors.worker_door): with api_key set, /v1/* need it (or the
    # internal secret) and /metrics, /openapi.json need the secret or admin_key.
    api_key: str | None = field(default=None, repr=False)
    admin_key: str | None = field(default=None, repr=False)


@dataclass(frozen=True)
class PDSettings:
    """Where the pool is and how a P or D worker bounds its handoff."""

    master_addr: str
    metadata_url: str
    owner_addr: str | None = None  # same-host shared memory; None: TCP
    # The address Mooncake advertises for this client (its transfer endpoint): this host's
    # address when the pool owners are on other hosts, loopback when all is on one host.
    local_hostname: str = "127.0.0.1"
    num_staging_slots: int = 256
    transfer_batch_blocks: int = 64  # most blocks per swap + pool call (staging use bound)
    wait_s: float = 30.0  # bound on waiting for free staging slots or KV blocks
    missing_kv_policy: MissingKVPolicy = "recompute"
    # The pool as a shared prefix cache (workers/prefill/pool_prefix.py): a hit under
    # pool_prefix_min_tokens is not loaded; a load past pool_load_timeout_s is abandoned
    # and the request recomputes (benchmarks/cache: docs/benchmarks/cache.md).
    pool_prefix: bool = True
    pool_prefix_min_tokens: int = 32
    pool_load_timeout_s: float = 2.0
    # Prefill writes each chunk's blocks while the next chunk computes (handoff_writer.py)
    write_while_computing: bool = True
    # Decode writes prompt + output blocks back when a request ends (workers/decode/writeback.py)
    writeback: bool = True
    writeback_max_in_flight: int = 4

    def __post_init__(self) -> None:
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

    router_url: str
    advertise_url: str  # how the router reaches this worker
    admin_key: str | None = None
    heartbeat_interval_s: float = 2.0
    call_timeout_s: float = 2.0
    ready_poll_s: float = 0.2


@dataclass(frozen=True)
class WorkerConfig:
    role: str
    app: AppConfig
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 8100
    log_level: str = "info"
    pd: PDSettings | None = None  # required by the prefill and decode roles
    registration: tuple[RegistrationConfig, ...] = ()  # one per router, each independent
    internal_secret: str | None = field(default=None, repr=False)  # X-PD-Internal-Secret
    head_limits: HeadLimits = field(default_factory=HeadLimits)  # request heads (http_guard)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ConfigError(f"unknown role {self.role!r} (one of {', '.join(ROLES)})")
        if self.role != "mixed" and self.pd is None:
            raise ConfigError(
                f"pdworker serve --role {self.role} needs --master HOST:PORT and --metadata URL "
                "(the Mooncake master's RPC address and metadata URL; `pdrouter launch` starts "
                "one and passes them)"
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
