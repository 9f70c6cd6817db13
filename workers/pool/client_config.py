"""The pool client's settings and counters (KVPoolClient, open_store)."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

from workers.pool.errors import BatchResult, KeyStatus

_NOT_ERRORS = frozenset({KeyStatus.OK, KeyStatus.MISSING})  # a miss is counted apart


@dataclass(frozen=True)
class PoolClientConfig:
    """Where the pool is and how this client bounds its calls.

    call_timeout_s bounds one put_from/get_into/exists/remove including its retries;
    retry_budget_s bounds how long pool-full (put) and not-ready (get) keys are retried,
    starting retry_backoff_s after the first try and doubling. page_lock: the engine's KV
    cache is on a GPU, so the staging buffer is page-locked (cudaHostRegister) at connect and
    unlocked at close; connect() raises PoolSetupError if it cannot be (workers/pool/page_lock.py).
    cuda_device: the cache's GPU, made current on the threads that call Mooncake (device
    pointers are looked up there: workers/pool/device_staging.py); None on a CPU worker.
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
    cuda_device: int | None = None
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


class PoolCounters:
    """The client's running counts (thread safe): bytes and keys moved, hits, misses, and
    failed keys by KeyStatus ("err_<status>")."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(("bytes_put", "bytes_got", "keys_put", "hits", "misses"), 0)

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._counts[name] = self._counts.get(name, 0) + delta

    def add_errors(self, result: BatchResult) -> None:
        failed = Counter(s.value for s in result.statuses if s not in _NOT_ERRORS)
        if failed:
            self.add(**{f"err_{name}": n for name, n in failed.items()})

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def restore(self, counts: dict[str, int]) -> None:
        """Put back a snapshot (the staging warm-up is not counted as traffic)."""
        with self._lock:
            self._counts = dict(counts)

    def stats(self, timeouts: int) -> PoolStats:
        counts = self.snapshot()
        errors = {k[len("err_") :]: v for k, v in counts.items() if k.startswith("err_")}
        return PoolStats(
            bytes_put=counts.get("bytes_put", 0),
            bytes_got=counts.get("bytes_got", 0),
            keys_put=counts.get("keys_put", 0),
            hits=counts.get("hits", 0),
            misses=counts.get("misses", 0),
            errors=errors,
            timeouts=timeouts,
        )
