"""The pool client's settings and counters (KVPoolClient, open_store)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class PoolClientConfig:
    """Where the pool is and how this client bounds its calls.

    call_timeout_s bounds one put_from/get_into/exists/remove including its retries;
    retry_budget_s bounds how long pool-full (put) and not-ready (get) keys are retried,
    starting retry_backoff_s after the first try and doubling. page_lock: the engine's KV
    cache is on a GPU, so the staging buffer is page-locked (cudaHostRegister) at connect and
    unlocked at close; connect() raises PoolSetupError if it cannot be (workers/pool/page_lock.py).
    warm_staging: over shared memory, connect() puts and removes every staging slot once, so
    that the owner's first copies into this staging are not slowed by its page faults
    (workers/pool/warm_staging.py).
    probe_interval_s: how often a background thread checks that the pool still answers and
    still maps this client's staging, and reconnects when it does not (0: no thread);
    probe_timeout_s bounds one probe, max_reconnects the reconnections over the client's life
    (each keeps its predecessor's staging mapped: workers/pool/pool_health.py).
    """

    master_addr: str
    metadata_url: str
    num_slots: int
    slot_bytes: int
    owner_addr: str | None = None
    local_hostname: str = "127.0.0.1"
    call_timeout_s: float = 10.0
    setup_timeout_s: float = 15.0
    close_timeout_s: float = 5.0
    retry_budget_s: float = 1.0
    retry_backoff_s: float = 0.05
    transfer_timeout_s: int = 5
    page_lock: bool = False
    warm_staging: bool = True
    probe_interval_s: float = 1.0
    probe_timeout_s: float = 1.0
    max_reconnects: int = 32


@dataclass(frozen=True)
class PoolStats:
    """Counters since connect, for metrics."""

    bytes_put: int = 0
    bytes_got: int = 0
    keys_put: int = 0
    hits: int = 0
    misses: int = 0
    errors: dict[str, int] = field(default_factory=dict)  # KeyStatus value -> keys
    timeouts: int = 0
