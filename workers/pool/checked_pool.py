"""CheckedPool: the handoff's pool with blocks that prove their content.

A block is two pool objects: its payload under its key (the staging slot, host or device, as
without the check) and its header (workers/pool/object_header.py: format, fingerprint, key,
tokens, length, payload checksum) under header_key(key), from the host staging's header bytes
of the same slot number (workers/pool/staging.py):

    put_from(keys, slots)   put the payloads while checksumming them (xxh3 on host staging,
                            the GPU word sum on device staging), seal the headers, then put
                            the headers of the payloads put: a header in the pool means its
                            payload was complete before it (exists() asks for the headers).
                            Inside headers_later() (the pipeline's put_blocks) the header put
                            runs on while the next group is copied and put
                            (workers/pool/header_calls.py)
    get_into(keys, slots)   get the payloads and the headers (at once; on host staging in
                            READ_PARTS concurrent parts, each checked while the others still
                            transfer), check each block read: the header against what the
                            key says, the payload against the header's checksum. A block
                            that fails becomes CORRUPT_CODE (a miss: the request recomputes
                            from there, as for any key the pool lacks), is counted by reason
                            and both its objects are removed (forced: our own read holds a
                            lease), so the next writer puts it again

Why two objects and not one: Mooncake's CUDA wheel refuses device pointers in its
multi-buffer calls (-600, measured on an H200), and the copy kernel addresses slot s at
s * slot_bytes, leaving no room before or after a payload for its header. One half missing
(evicted alone, or a writer that died between the two puts) is a plain miss, not a failure:
the other half is removed so that exists() stops claiming the block.

It wraps either pool object the handoff takes (the client, or a DevicePool over it) and
exposes the same calls, so the pipeline, the writer, the reader, the follower and the prefix
reads do not change. Costs, measured: docs/benchmarks/handoff.md, "Integrity".
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from workers.pool.errors import CORRUPT_CODE, BatchResult, KeyStatus, PoolError
from workers.pool.header_calls import HEADER_CALLS, HeaderCalls, LateHeaders, fold, parts
from workers.pool.keys import header_key
from workers.pool.object_header import (
    CHECKSUM_WORDSUM,
    CHECKSUM_XXH3,
    HEADER_BYTES,
    ExpectedObject,
    FailureReason,
    check_fields,
    checksum_fields,
    decode,
    expected_headers,
    rows_off_key,
    seal,
)

log = logging.getLogger(__name__)

OnIntegrityFailure = Callable[[str], None]  # reason: one of object_header.FAILURE_REASONS
READ_PARTS = 4  # concurrent gets a host-staging batch is split over (see get_into)
READ_THREADS = 16  # the parts of concurrent requests' gets


class CheckedPool:
    """A pool (KVPoolClient or DevicePool) whose blocks carry a checked header."""

    sharded = None  # (workers/handoff/slots.py HandoffPool; headers_later is a method here)

    def __init__(
        self,
        inner: Any,
        block_size: int,
        on_failure: OnIntegrityFailure | None = None,
        read_parts: int = READ_PARTS,
        header_calls: int = HEADER_CALLS,
    ) -> None:
        """read_parts, header_calls: how many concurrent calls a batch's payload get (host
        staging) and its header calls are split over (benchmarks.handoff.integrity compares)."""
        if read_parts < 1 or header_calls < 1:
            raise ValueError(
                f"need read_parts, header_calls >= 1, got {read_parts}, {header_calls}"
            )
        self.read_parts, self.header_calls = read_parts, header_calls
        self.inner = inner
        self.client = getattr(inner, "client", inner)  # the host staging's client
        self.block_size = block_size
        self._on_failure = on_failure
        self._calls = HeaderCalls(self.client)  # the header objects' puts and gets
        self._reads = concurrent.futures.ThreadPoolExecutor(READ_THREADS, "pool-reads")

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
        """Whether each block is in the pool whole: its header (put after its payload) is."""
        return self.inner.exists([header_key(k) for k in keys])

    def remove(self, keys: Sequence[str], force: bool = False) -> BatchResult:
        """Remove blocks: their headers first (exists() stops claiming them), then payloads."""
        self.inner.remove([header_key(k) for k in keys], force)
        return self.inner.remove(keys, force)

    def health(self) -> Any:
        return self.inner.health()

    def stats(self) -> Any:
        return self.inner.stats()

    def close(self) -> bool:
        self._reads.shutdown(wait=True)
        self._calls.close()
        return self.inner.close()

    # ---- the two data calls ----------------------------------------------------------------
    def put_from(
        self,
        keys: Sequence[str],
        slots: Sequence[int],
        sizes: Sequence[int] | None = None,
        staging: Any = None,
    ) -> BatchResult:
        """Seal and put each slot's block: payload, then header. A key is OK when both are;
        inside headers_later() the header put is left running (its codes: settle()).
        Objects are whole slots (sizes, when given, must say so: a TP shard of part of a
        slot is not covered, and WorkerConfig refuses that pairing)."""
        if sizes is not None and any(n != self.config.slot_bytes for n in sizes):
            raise ValueError("the integrity check covers whole-slot objects only")
        staging = self.inner.buffer if staging is None else staging
        kind = staging.checksum_kind
        # The checksums run beside the payload put: both only read the slots.
        sums = self._calls.submit(staging.checksums, list(slots), kind)
        try:
            result = self.inner.put_from(keys, slots, staging=staging)
        finally:
            concurrent.futures.wait([sums])  # never a slot freed while it is being read
        checksums = sums.result()
        done = [i for i, status in enumerate(result.statuses) if status is KeyStatus.OK]
        if not done:
            return result
        self.client.buffer.write_headers(slots, seal(self._expected(keys), checksums, kind))
        header_keys, header_slots = [header_key(keys[i]) for i in done], [slots[i] for i in done]
        late = self._calls.late
        calls = self._calls.start(
            "put",
            header_keys,
            header_slots,
            pin=None if late is None else self.inner.slots,
            calls=self.header_calls,
        )
        if late is not None:
            late.pending.append((result, done, calls))
            return result
        return fold(result, done, self._calls.join(calls))

    def headers_later(self) -> contextlib.AbstractContextManager[LateHeaders]:
        """A block in which this thread's header puts run behind its next payload puts
        (workers/pool/header_calls.py); settle() the block's put results before it ends."""
        return self._calls.later()

    def get_into(
        self, keys: Sequence[str], slots: Sequence[int], staging: Any = None
    ) -> BatchResult:
        """Get each block's payload into its slot and its header, and check them; a block
        that fails answers CORRUPT_CODE, is counted and removed."""
        staging = self.inner.buffer if staging is None else staging
        if staging is not self.client.buffer:  # device staging: DevicePool splits the get
            result, header_result, reasons = self._read(keys, slots, staging, self.header_calls)
        else:  # host staging: each part's checksums run while the other parts are read
            result, header_result, reasons = _merge(
                self._reads.map(
                    self._read_part,
                    [(keys, slots, staging, part) for part in parts(len(keys), self.read_parts)],
                )
            )
        reasons.update(self._wrong_lengths(result, header_result))
        torn = self._torn(result, header_result, reasons)
        codes = list(result.codes)
        for i, header_code in enumerate(header_result.codes):
            if codes[i] >= 0 and header_code < 0:  # no header read: never KV unchecked
                codes[i] = header_code
        for i, reason in sorted(reasons.items()):
            codes[i] = CORRUPT_CODE
            log.warning("pool block %s failed its %s check: removed, a miss", keys[i], reason)
            if self._on_failure is not None:
                self._on_failure(reason)
        gone = sorted(set(reasons) | set(torn))
        if gone:  # forced: our own read holds a lease; a reader still copying fails its check
            with contextlib.suppress(PoolError):
                self.remove([keys[i] for i in gone], force=True)
        return BatchResult.from_codes(list(keys), codes)

    def _read(
        self, keys: Sequence[str], slots: Sequence[int], staging: Any, header_calls: int
    ) -> tuple[BatchResult, BatchResult, dict[int, FailureReason]]:
        """Get keys' payloads and (beside them) headers, and check what was read."""
        headers = self._calls.start(
            "get", [header_key(k) for k in keys], slots, pin=None, calls=header_calls
        )
        result = self.inner.get_into(keys, slots, staging=staging)
        header_result = self._calls.join(headers)
        return result, header_result, self._verify(result, header_result, slots, staging)

    def _read_part(self, job: tuple[Sequence[str], Sequence[int], Any, range]) -> Any:
        keys, slots, staging, part = job
        return self._read([keys[i] for i in part], [slots[i] for i in part], staging, 1)

    def _expected(self, keys: Sequence[str]) -> Any:
        return expected_headers(keys, self.block_size, self.inner.config.slot_bytes)

    def _verify(
        self,
        result: BatchResult,
        header_result: BatchResult,
        slots: Sequence[int],
        staging: Any,
    ) -> dict[int, FailureReason]:
        """Index -> reason for each block read whole whose header or payload is wrong."""
        ok = KeyStatus.OK
        read = _both(result, header_result, lambda payload, header: payload is header is ok)
        if not read:
            return {}
        raw = self.client.buffer.read_headers([slots[i] for i in read])  # [len(read), HEADER_BYTES]
        keys = [result.keys[i] for i in read]
        reasons: dict[int, FailureReason] = {}
        for row in rows_off_key(raw, self._expected(keys)):  # the rare path: name the field
            expected = ExpectedObject.for_key(keys[row], self.block_size, self.config.slot_bytes)
            reasons[read[row]] = check_fields(decode(raw[row].tobytes()), expected) or "version"
        to_sum: dict[int, list[tuple[int, int]]] = {}  # checksum kind -> (index, expected)
        for i, kind, checksum in zip(read, *checksum_fields(raw), strict=True):
            if i in reasons:
                continue
            if kind not in (CHECKSUM_XXH3, CHECKSUM_WORDSUM):
                reasons[i] = "version"
            elif header_result.codes[i] != HEADER_BYTES:
                reasons[i] = "version"  # a shorter header object
            elif result.codes[i] != self.config.slot_bytes:
                reasons[i] = "length"  # a shorter payload
            else:
                to_sum.setdefault(kind, []).append((i, checksum))
        for kind, wanted in to_sum.items():
            got = staging.checksums([slots[i] for i, _ in wanted], kind)
            for (i, checksum), actual in zip(wanted, got, strict=True):
                if actual != checksum:
                    reasons[i] = "checksum"
        return reasons

    def _wrong_lengths(
        self, result: BatchResult, header_result: BatchResult
    ) -> dict[int, FailureReason]:
        """Index -> reason for each block whose payload (length) or header (version) is too
        long to read: asked of the pool only after a get failed as that does (-600)."""
        reasons: dict[int, FailureReason] = {}
        for res, want, reason in (
            (result, self.config.slot_bytes, "length"),
            (header_result, HEADER_BYTES, "version"),
        ):
            suspects = [i for i, s in enumerate(res.statuses) if s is KeyStatus.BAD_PARAMS]
            if not suspects:
                continue
            try:
                sizes = self.client.object_sizes([res.keys[i] for i in suspects])
            except PoolError:
                continue
            reasons.update({i: reason for i, n in zip(suspects, sizes, strict=True) if n > want})
        return reasons

    def _torn(
        self, result: BatchResult, header_result: BatchResult, reasons: dict[int, FailureReason]
    ) -> list[int]:
        """Blocks of which exactly one object is missing: plain misses whose other half is
        removed (neither exists() nor a later read may take the half for the block)."""
        missing = KeyStatus.MISSING
        one_missing = _both(result, header_result, lambda a, b: (a is missing) != (b is missing))
        return [i for i in one_missing if i not in reasons]


def _merge(
    reads: Iterable[tuple[BatchResult, BatchResult, dict[int, FailureReason]]],
) -> tuple[BatchResult, BatchResult, dict[int, FailureReason]]:
    """One batch's (payloads, headers, reasons) from its parts', in order."""
    keys, codes, header_keys, header_codes = [], [], [], []
    reasons: dict[int, FailureReason] = {}
    for result, header_result, part_reasons in reads:
        reasons.update({len(keys) + i: reason for i, reason in part_reasons.items()})
        keys += result.keys
        codes += result.codes
        header_keys += header_result.keys
        header_codes += header_result.codes
    return (
        BatchResult(tuple(keys), tuple(codes)),
        BatchResult(tuple(header_keys), tuple(header_codes)),
        reasons,
    )


def _both(payloads: BatchResult, headers: BatchResult, pick: Callable[..., bool]) -> list[int]:
    """Indexes of the blocks whose (payload status, header status) pick accepts."""
    pairs = zip(payloads.statuses, headers.statuses, strict=True)
    return [i for i, (payload, header) in enumerate(pairs) if pick(payload, header)]
