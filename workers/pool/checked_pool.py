"""CheckedPool: the handoff's pool with objects that prove their content.

    put_from(keys, slots)   seal: each slot's header (workers/pool/object_header.py: format,
                            fingerprint, key, tokens, length, payload checksum) is written
                            into the staging's header bytes, then header + payload are put
                            as one object
    get_into(keys, slots)   header + payload read as one object; each read key is checked
                            (fields, then the payload's checksum); a key that fails becomes
                            CORRUPT_CODE (a miss: the request recomputes the block and what
                            follows, as for any key the pool lacks), is counted by reason
                            and removed from the pool, so the next writer puts it again

An object of another length (truncated, or headerless from a worker with the check off)
cannot be read into header + slot at all: Mooncake fails that get (-800 over shared memory),
so for a key whose get failed the pool is asked the object's length, and a length other than
HEADER_BYTES + slot_bytes counts as "length" (and is removed) too.

It wraps either pool object the handoff takes (the client on the host path, a DevicePool on
the device path: the checksum is then the GPU word sum over device staging), and exposes the
same calls, so the pipeline, the writer, the reader and the prefix reads do not change. The
costs, measured: docs/benchmarks/handoff.md, "Integrity".
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

from workers.pool.errors import CORRUPT_CODE, BatchResult, KeyStatus, PoolError
from workers.pool.object_header import (
    HEADER_BYTES,
    ExpectedObject,
    FailureReason,
    check_fields,
    decode,
)

log = logging.getLogger(__name__)

OnIntegrityFailure = Callable[[str], None]  # reason: one of object_header.FAILURE_REASONS
# A get that failed this way may have met an object of another length (checked by asking).
_LENGTH_SUSPECT = frozenset({KeyStatus.TRANSFER_FAILED, KeyStatus.BAD_PARAMS, KeyStatus.ERROR})


class CheckedPool:
    """A pool (KVPoolClient or DevicePool) whose objects carry a checked header."""

    def __init__(
        self,
        inner: Any,
        block_size: int,
        on_failure: OnIntegrityFailure | None = None,
    ) -> None:
        self.inner = inner
        self.block_size = block_size
        self._on_failure = on_failure

    # ---- what the handoff reads off a pool (workers/handoff/slots.py HandoffPool) -----------
    @property
    def is_open(self) -> bool:
        return self.inner.is_open

    @property
    def config(self) -> Any:
        return self.inner.config

    @property
    def slots(self) -> Any:
        return self.inner.slots

    @property
    def buffer(self) -> Any:
        return self.inner.buffer

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return self.inner.exists(keys)

    def remove(self, keys: Sequence[str], force: bool = False) -> BatchResult:
        return self.inner.remove(keys, force)

    def health(self) -> Any:
        return self.inner.health()

    def stats(self) -> Any:
        return self.inner.stats()

    def close(self) -> bool:
        return self.inner.close()

    # ---- the two data calls ----------------------------------------------------------------
    def put_from(
        self, keys: Sequence[str], slots: Sequence[int], staging: Any = None
    ) -> BatchResult:
        """Seal each slot (header into the staging's header bytes), then put header + payload
        under its key. staging: the buffer the slots were filled in (default: the pool's)."""
        staging = self.inner.buffer if staging is None else staging
        kind = staging.checksum_kind
        sums = staging.checksums(slots, kind)
        headers = [
            self._expected(key).header(checksum, kind).encode()
            for key, checksum in zip(keys, sums, strict=True)
        ]
        staging.write_headers(slots, headers)
        return self.inner.put_from(keys, slots, None, staging, with_header=True)

    def get_into(
        self, keys: Sequence[str], slots: Sequence[int], staging: Any = None
    ) -> BatchResult:
        """Read header + payload of each key into its slot and check it; a key that fails
        the check answers CORRUPT_CODE, is counted and removed."""
        staging = self.inner.buffer if staging is None else staging
        result = self.inner.get_into(keys, slots, staging, with_header=True)
        reasons = self._verify(result, slots, staging)
        reasons.update(self._wrong_lengths(result))
        if not reasons:
            return result
        codes = list(result.codes)
        for i, reason in sorted(reasons.items()):
            codes[i] = CORRUPT_CODE
            log.warning(
                "pool object %s failed its %s check: removed, read as a miss", keys[i], reason
            )
            if self._on_failure is not None:
                self._on_failure(reason)
        # Despite our own read's lease (5 s): a reader that still copies it fails its check.
        with contextlib.suppress(PoolError):
            self.inner.remove([keys[i] for i in sorted(reasons)], force=True)
        return BatchResult.from_codes(list(keys), codes)

    def _expected(self, key: str) -> ExpectedObject:
        return ExpectedObject.for_key(key, self.block_size, self.inner.config.slot_bytes)

    def _verify(
        self, result: BatchResult, slots: Sequence[int], staging: Any
    ) -> dict[int, FailureReason]:
        """Index -> reason for each key read whose header or checksum is wrong."""
        read = [i for i, status in enumerate(result.statuses) if status is KeyStatus.OK]
        if not read:
            return {}
        raws = staging.read_headers([slots[i] for i in read])
        reasons: dict[int, FailureReason] = {}
        to_sum: dict[int, list[tuple[int, int]]] = {}  # checksum kind -> (index, expected)
        for i, raw in zip(read, raws, strict=True):
            header = decode(raw)
            why = check_fields(header, self._expected(result.keys[i]))
            if why is None and result.codes[i] != HEADER_BYTES + header.payload_bytes:  # type: ignore[union-attr]
                why = "length"
            if why is not None:
                reasons[i] = why
            else:
                assert header is not None
                to_sum.setdefault(header.checksum_kind, []).append((i, header.checksum))
        for kind, wanted in to_sum.items():
            got = staging.checksums([slots[i] for i, _ in wanted], kind)
            for (i, checksum), actual in zip(wanted, got, strict=True):
                if actual != checksum:
                    reasons[i] = "checksum"
        return reasons

    def _wrong_lengths(self, result: BatchResult) -> dict[int, FailureReason]:
        """Index -> "length" for each key whose get failed because its object is of another
        length than header + slot (asked of the pool only after such a failure)."""
        suspects = [i for i, s in enumerate(result.statuses) if s in _LENGTH_SUSPECT]
        if not suspects:
            return {}
        try:
            sizes = self.inner.object_sizes([result.keys[i] for i in suspects])
        except PoolError:
            return {}
        want = HEADER_BYTES + self.inner.config.slot_bytes
        return {i: "length" for i, n in zip(suspects, sizes, strict=True) if n >= 0 and n != want}
