"""Typed pool errors and the map from Mooncake return codes to them.

Mooncake answers per key with an int: >= 0 is success (bytes for a get), < 0 an ErrorCode.
Callers never see those ints: each key gets a KeyStatus, each failure kind a PoolError
subclass, so a decode worker can tell "recompute this block" (MISSING) from "the pool is gone"
(MASTER_UNREACHABLE, TRANSFER_FAILED) without knowing Mooncake's numbering.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Sequence
from dataclasses import dataclass


class KeyStatus(enum.Enum):
    """Outcome of one key in a batch call."""

    OK = "ok"
    MISSING = "missing"  # never written, evicted, removed, or lost with its owner
    POOL_FULL = "pool_full"  # no room even after the bounded retries
    NOT_READY = "not_ready"  # another writer is still putting it
    LEASE_HELD = "lease_held"  # remove refused: a reader holds a lease on it
    TRANSFER_FAILED = "transfer_failed"  # the owner of the bytes is dead or hung
    MASTER_UNREACHABLE = "master_unreachable"
    BAD_PARAMS = "bad_params"  # buffer too small, unregistered buffer, bad key
    TIMEOUT = "timeout"  # our own time bound ran out before Mooncake answered
    UNAVAILABLE = "pool_unavailable"  # the client is degraded (or reconnected): no call made
    CORRUPT = "corrupt"  # read, but its header did not prove its content: removed, a miss
    ERROR = "error"  # any other Mooncake code (kept in BatchResult.codes)


# Mooncake ErrorCode values (mooncake-store types.h) we act on; the rest map to ERROR.
_CODE_TO_STATUS: dict[int, KeyStatus] = {
    -101: KeyStatus.POOL_FULL,  # AVAILABLE_SEGMENT_EMPTY: no owner has memory mounted
    -200: KeyStatus.POOL_FULL,  # NO_AVAILABLE_HANDLE
    -600: KeyStatus.BAD_PARAMS,  # INVALID_PARAMS (too small or unregistered buffer too)
    -700: KeyStatus.BAD_PARAMS,  # INVALID_WRITE
    -701: KeyStatus.BAD_PARAMS,  # INVALID_READ
    -703: KeyStatus.NOT_READY,  # REPLICA_IS_NOT_READY
    -704: KeyStatus.MISSING,  # OBJECT_NOT_FOUND
    -706: KeyStatus.LEASE_HELD,  # OBJECT_HAS_LEASE
    -707: KeyStatus.NOT_READY,  # LEASE_EXPIRED: bytes arrived but the check after failed
    -710: KeyStatus.MISSING,  # REPLICA_NOT_FOUND
    -712: KeyStatus.MISSING,  # REPLICA_IS_GONE
    -800: KeyStatus.TRANSFER_FAILED,  # TRANSFER_FAIL
    -900: KeyStatus.MASTER_UNREACHABLE,  # RPC_FAIL
}

# A put of a key the pool already holds keeps the old value; we count it as success.
OBJECT_ALREADY_EXISTS = -705

# Our own codes for outcomes that never came from Mooncake (kept apart from its range).
TIMEOUT_CODE = -100_001
# The client is degraded, or the caller's staging is a generation the client reconnected away
# from: the call failed fast, without reaching Mooncake (workers/pool/pool_health.py).
UNAVAILABLE_CODE = -100_002
# The object was read but failed its header check (workers/pool/checked_pool.py): a miss.
CORRUPT_CODE = -100_003


def status_for_code(code: int) -> KeyStatus:
    """KeyStatus for one Mooncake per-key return value (>= 0 means success)."""
    if code >= 0:
        return KeyStatus.OK
    if code == TIMEOUT_CODE:
        return KeyStatus.TIMEOUT
    if code == UNAVAILABLE_CODE:
        return KeyStatus.UNAVAILABLE
    if code == CORRUPT_CODE:
        return KeyStatus.CORRUPT
    return _CODE_TO_STATUS.get(code, KeyStatus.ERROR)


class PoolError(Exception):
    """Base of every error the pool client raises."""


class PoolFullError(PoolError):
    """The pool had no room for some keys even after the bounded retries."""


class KeyMissingError(PoolError):
    """Some keys are not in the pool (never written, evicted, or lost with the owner)."""


class NotReadyError(PoolError):
    """Some keys are still being written by another client."""


class LeaseHeldError(PoolError):
    """Remove refused: a reader holds a lease on the key (it expires by itself)."""


class TransferFailedError(PoolError):
    """Bytes could not be moved: the pool owner died or hangs."""


class MasterUnreachableError(PoolError):
    """The Mooncake master does not answer (dead, restarting, or wrong address)."""


class BadParamsError(PoolError):
    """Mooncake refused the arguments (buffer too small, unregistered buffer, bad key)."""


class PoolTimeoutError(PoolError):
    """A call ran past its time bound; Mooncake may still be working on it."""


class PoolDegradedError(PoolError):
    """The client lost the pool and is reconnecting: the call failed fast, nothing was moved
    (a decode worker recomputes; KVPoolClient.health() says why)."""


class CorruptObjectError(PoolError):
    """An object read back did not match its header (workers/pool/object_header.py)."""


class PoolClosedError(PoolError):
    """The client is closed (or never connected): no Mooncake call is made."""


class PoolSetupError(PoolError):
    """Connecting to the pool failed; the message names the flag or process to fix."""


_STATUS_TO_ERROR: dict[KeyStatus, type[PoolError]] = {
    KeyStatus.POOL_FULL: PoolFullError,
    KeyStatus.MISSING: KeyMissingError,
    KeyStatus.NOT_READY: NotReadyError,
    KeyStatus.LEASE_HELD: LeaseHeldError,
    KeyStatus.TRANSFER_FAILED: TransferFailedError,
    KeyStatus.MASTER_UNREACHABLE: MasterUnreachableError,
    KeyStatus.BAD_PARAMS: BadParamsError,
    KeyStatus.TIMEOUT: PoolTimeoutError,
    KeyStatus.UNAVAILABLE: PoolDegradedError,
    KeyStatus.ERROR: PoolError,
    KeyStatus.CORRUPT: CorruptObjectError,
}

# When a batch fails in several ways, the error raised names the most fundamental one:
# a dead master explains missing keys, not the other way round.
_SEVERITY = [
    KeyStatus.UNAVAILABLE,
    KeyStatus.MASTER_UNREACHABLE,
    KeyStatus.TIMEOUT,
    KeyStatus.TRANSFER_FAILED,
    KeyStatus.BAD_PARAMS,
    KeyStatus.ERROR,
    KeyStatus.POOL_FULL,
    KeyStatus.NOT_READY,
    KeyStatus.LEASE_HELD,
    KeyStatus.CORRUPT,
    KeyStatus.MISSING,
]


def error_class(status: KeyStatus) -> type[PoolError]:
    """The PoolError subclass for a failed status (raises ValueError for OK)."""
    if status is KeyStatus.OK:
        raise ValueError("KeyStatus.OK is not an error")
    return _STATUS_TO_ERROR[status]


@dataclass(frozen=True)
class BatchResult:
    """Per-key outcome of one batch call, in the order of the keys given.

    codes holds Mooncake's raw values (bytes read for a get, 0 for a put, negative on error)
    so that metrics and logs can show them; statuses is what callers branch on.
    """

    keys: tuple[str, ...]
    codes: tuple[int, ...]

    @classmethod
    def from_codes(cls, keys: Sequence[str], codes: Sequence[int]) -> BatchResult:
        assert len(keys) == len(codes), f"{len(keys)} keys but {len(codes)} codes"
        return cls(tuple(keys), tuple(map(int, codes)))

    @functools.cached_property
    def statuses(self) -> tuple[KeyStatus, ...]:
        if self.ok:
            return (KeyStatus.OK,) * len(self.codes)
        return tuple(status_for_code(c) for c in self.codes)

    @functools.cached_property
    def ok(self) -> bool:
        return not self.codes or min(self.codes) >= 0

    @property
    def ok_keys(self) -> list[str]:
        return [k for k, c in zip(self.keys, self.codes, strict=True) if c >= 0]

    @property
    def missing_keys(self) -> list[str]:
        return self.keys_with(KeyStatus.MISSING)

    @property
    def failed_keys(self) -> list[str]:
        """Keys that did not succeed, whatever the reason (missing included)."""
        return [k for k, c in zip(self.keys, self.codes, strict=True) if c < 0]

    def keys_with(self, status: KeyStatus) -> list[str]:
        return [k for k, s in zip(self.keys, self.statuses, strict=True) if s is status]

    def error(self) -> PoolError | None:
        """The typed error for the most fundamental failure in the batch, or None if all OK."""
        if self.ok:
            return None
        failed = set(self.statuses) - {KeyStatus.OK}
        if not failed:
            return None
        worst = min(failed, key=_SEVERITY.index)
        keys = self.keys_with(worst)
        shown = ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
        code = self.codes[self.keys.index(keys[0])]
        return error_class(worst)(
            f"{len(keys)}/{len(self.keys)} keys {worst.value} (code {code}): {shown}"
        )

    def raise_for_error(self) -> None:
        """Raise error() when any key failed."""
        err = self.error()
        if err is not None:
            raise err
