"""DevicePool: the handoff's pool on the device-pointer path, with host staging behind it.

    put_blocks / get_blocks (workers/handoff/pipeline.py) take it as they take KVPoolClient:
      .slots, .buffer     the device staging (GPU memory): swap_cache_layout gathers into or
                          scatters out of it
      .put_from/.get_into one batch of device pointers, split over `calls` concurrent
                          Mooncake calls (the owner pays ~0.3 ms per key on a get: parallel
                          calls hide it); a key that fails as a device call can fail (-600,
                          -800, a bare error) is tried once more, then redone through the
                          client's host staging (device slot <-> host slot copy + host call)

The pipeline, the writer, the reader and the prefix reads never branch on the path: the
worker picks this object or the plain client once, at start (workers/pool/handoff_path.py).
A fallback is counted (on_fallback(op, reason): pdworker_handoff_fallbacks_total) and logged
once when the path starts falling back and once when device calls work again; a key the host
redo cannot move either keeps its failure, which the handoff already answers (D recomputes).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from workers.pool.client import KVPoolClient
from workers.pool.client_config import PoolClientConfig, PoolStats
from workers.pool.errors import BatchResult, KeyStatus, status_for_code
from workers.pool.pool_health import PoolHealth
from workers.pool.staging import SlotAllocator, StagingBuffer

log = logging.getLogger(__name__)

# Concurrent Mooncake calls one batch is split over (docs/benchmarks/handoff.md measures 1-4).
DEVICE_CALLS = 4
# What a device-pointer call answers when the device path itself is at fault (a pointer the
# owner could not map, an IPC copy that failed): worth a retry, then the host staging. Misses,
# a full pool, a dead master or our own timeout would fail the same way through the host.
DEVICE_SUSPECT = frozenset({KeyStatus.BAD_PARAMS, KeyStatus.TRANSFER_FAILED, KeyStatus.ERROR})
HOST_SLOTS_WAIT_S = 1.0  # a redo waits this long for host staging slots, then keeps the failure

OnFallback = Callable[[str, str], None]  # (op "put" | "get", reason: the KeyStatus value)


class DeviceSlots(Protocol):
    """The device staging (workers/pool/device_staging.py; a numpy stand-in in CPU tests)."""

    slots: SlotAllocator
    slot_ptrs: list[int]
    view: object
    checksum_kind: int  # what checksums() computes by default (workers/pool/checked_pool.py)

    def checksums(self, slots: Sequence[int], kind: int) -> list[int]: ...

    def to_host(
        self, slots: Sequence[int], host: StagingBuffer, host_slots: Sequence[int]
    ) -> None: ...

    def from_host(
        self, host: StagingBuffer, host_slots: Sequence[int], slots: Sequence[int]
    ) -> None: ...

    def close(self) -> None: ...


class DevicePool:
    """A KVPoolClient seen through device staging; what the handoff uses on this path."""

    headers_later = sharded = None  # neither optional capability (handoff/slots.py HandoffPool)

    def __init__(
        self,
        client: KVPoolClient,
        staging: DeviceSlots,
        calls: int = DEVICE_CALLS,
        on_fallback: OnFallback | None = None,
    ) -> None:
        if calls < 1:
            raise ValueError(f"calls must be >= 1, got {calls}")
        client.use_device_staging(staging)  # type: ignore[arg-type]
        self.client, self.staging, self.calls = client, staging, calls
        self._on_fallback = on_fallback
        self._pool = concurrent.futures.ThreadPoolExecutor(calls - 1) if calls > 1 else None
        self._lock = threading.Lock()
        self._falling_back = False  # logged once per transition

    # ---- what the handoff reads off a pool (workers/handoff/slots.py HandoffPool) -----------
    @property
    def is_open(self) -> bool:
        return self.client.is_open

    @property
    def config(self) -> PoolClientConfig:
        return self.client.config

    @property
    def slots(self) -> SlotAllocator:
        return self.staging.slots

    @property
    def buffer(self) -> DeviceSlots:
        return self.staging

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return self.client.exists(keys)

    def remove(self, keys: Sequence[str], force: bool = False) -> BatchResult:
        return self.client.remove(keys, force)

    def health(self) -> PoolHealth:
        return self.client.health()

    def stats(self) -> PoolStats:
        return self.client.stats()

    def close(self) -> bool:
        """Close the client (bounded wait for its calls), then free the device staging; the
        caller waited for its own copies first. A Mooncake call still running past the
        client's bound may still be copying into the staging: then it is left to process
        exit, as the client leaves its store (False)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        if not self.client.close():
            log.warning("device staging left allocated: a pool call still runs")
            return False
        self.staging.close()
        return True

    # ---- the two data calls ----------------------------------------------------------------
    def put_from(
        self,
        keys: Sequence[str],
        slots: Sequence[int],
        sizes_bytes: Sequence[int] | None = None,
        staging: Any = None,
    ) -> BatchResult:
        """Store each device slot under its key (device pointers; host staging as fallback)."""
        return self._move("put", list(keys), list(slots), sizes_bytes, staging)

    def get_into(
        self, keys: Sequence[str], slots: Sequence[int], staging: Any = None
    ) -> BatchResult:
        """Read each key into its device slot (device pointers; host staging as fallback)."""
        return self._move("get", list(keys), list(slots), None, staging)

    def _move(
        self,
        op: str,
        keys: list[str],
        slots: list[int],
        sizes: Sequence[int] | None,
        staging: Any,
    ) -> BatchResult:
        if staging is not None and staging is not self.staging:
            raise ValueError("staging= names a buffer that is not this pool's device staging")
        codes = self._device(op, keys, slots, sizes)
        suspect = _suspects(codes)
        if suspect:  # once more as a device call, the failed keys only
            again = self._device(op, *_pick(suspect, keys, slots, sizes))
            for i, code in zip(suspect, again, strict=True):
                codes[i] = code
            suspect = _suspects(codes)
        if suspect:
            reason = status_for_code(codes[suspect[0]]).value
            self._fell_back(op, reason, len(suspect))
            redo = self._host(op, *_pick(suspect, keys, slots, sizes))
            for i, code in zip(suspect, redo, strict=True) if redo is not None else ():
                codes[i] = code
        elif self._falling_back:
            self._recovered()
        return BatchResult.from_codes(keys, codes)

    def _device(
        self, op: str, keys: list[str], slots: list[int], sizes: Sequence[int] | None
    ) -> list[int]:
        """One batch of device pointers, its keys split over up to `calls` calls at once."""
        parts = _split(len(keys), self.calls)
        if self._pool is None or len(parts) == 1:
            return self._call(op, keys, slots, sizes, self.staging)
        futures = [
            self._pool.submit(self._call, op, *_part(p, keys, slots, sizes), self.staging)
            for p in parts[1:]
        ]
        first = self._call(op, *_part(parts[0], keys, slots, sizes), self.staging)
        return first + [code for f in futures for code in f.result()]

    def _call(
        self,
        op: str,
        keys: list[str],
        slots: list[int],
        sizes: Sequence[int] | None,
        staging: object,
    ) -> list[int]:
        if op == "put":
            return list(self.client.put_from(keys, slots, sizes, staging=staging).codes)
        return list(self.client.get_into(keys, slots, staging=staging).codes)

    def _host(
        self, op: str, keys: list[str], slots: list[int], sizes: Sequence[int] | None
    ) -> list[int] | None:
        """The keys through the client's host staging: device slots copied out before a put,
        host slots copied in after a get. Codes as the host call answered them; None (the
        failure stands) when no host slots come free in time."""
        client = self.client
        host = client.buffer
        host_slots = client.slots.allocate_within(len(keys), HOST_SLOTS_WAIT_S)
        if host_slots is None:
            log.warning("no %d free host staging slots for a device-path redo", len(keys))
            return None
        try:
            if op == "put":
                self.staging.to_host(slots, host, host_slots)
                return self._call(op, keys, host_slots, sizes, host)
            codes = self._call(op, keys, host_slots, sizes, host)
            ok = [i for i, code in enumerate(codes) if code >= 0]
            self.staging.from_host(host, [host_slots[i] for i in ok], [slots[i] for i in ok])
            return codes
        finally:
            client.slots.free(host_slots)

    def _fell_back(self, op: str, reason: str, num_keys: int) -> None:
        with self._lock:
            first, self._falling_back = not self._falling_back, True
        if first:
            log.warning(
                "device-pointer %s failed twice (%s) for %d keys: redone through host "
                "staging; further fallbacks are counted in pdworker_handoff_fallbacks_total",
                op,
                reason,
                num_keys,
            )
        if self._on_fallback is not None:
            self._on_fallback(op, reason)

    def _recovered(self) -> None:
        with self._lock:
            was, self._falling_back = self._falling_back, False
        if was:
            log.info("device-pointer pool calls work again")


def _suspects(codes: list[int]) -> list[int]:
    return [i for i, code in enumerate(codes) if status_for_code(code) in DEVICE_SUSPECT]


def _pick(
    idx: list[int], keys: list[str], slots: list[int], sizes: Sequence[int] | None
) -> tuple[list[str], list[int], list[int] | None]:
    return (
        [keys[i] for i in idx],
        [slots[i] for i in idx],
        None if sizes is None else [sizes[i] for i in idx],
    )


def _part(
    part: range, keys: list[str], slots: list[int], sizes: Sequence[int] | None
) -> tuple[list[str], list[int], list[int] | None]:
    return _pick(list(part), keys, slots, sizes)


def _split(n: int, calls: int) -> list[range]:
    """n keys as up to `calls` contiguous parts of near-equal size (none empty)."""
    k = max(1, min(calls, n))
    return [range(i * n // k, (i + 1) * n // k) for i in range(k)]
