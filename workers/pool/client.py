"""KVPoolClient: the one class workers use to move KV blocks in and out of the Mooncake pool.

    prefill: fill slots (device -> host) ─► put_from(keys, slots) ─► pool
    decode:  pool ─► get_into(keys, slots) ─► copy slots host -> device

The client owns one staging buffer (StagingBuffer, registered with Mooncake once, and
page-locked for the GPU when config.page_lock: workers/pool/page_lock.py) and a SlotAllocator
over it. Workers mount no pool memory: a worker that dies loses no block.

Two ways to reach the pool owner (`pdworker pool`), picked by PoolClientConfig.owner_addr:
- None: TCP through the transfer engine (works across hosts; setup(global_segment_size=0)).
- "HOST:PORT" of the owner's mooncake_client: same-host shared memory (setup_dummy); the
  staging buffer then comes from the owner's shared pool (alloc_from_mem_pool).

Every call returns per-key results (BatchResult) and is bounded three ways:
- our own bound: each native call runs on a BoundedCaller worker and the caller waits at most
  call_timeout_s (retries included); keys still unanswered get TIMEOUT, and the slots they
  used stay pinned until the native call really returns;
- Mooncake's: MC_TCP_STATUS_TIMEOUT_SEC = transfer_timeout_s ends a transfer from a hung
  owner inside Mooncake, and its master RPCs give up after about 4 s (-900);
- setup: a preflight probe of every address first, then MC_STORE_CLIENT_SETUP_RETRIES=1.
What a dead process reads as: the master dead -> MASTER_UNREACHABLE. The pool owner dead ->
TRANSFER_FAILED: over TCP for each key it held, until the master drops its segment (client_ttl)
and they read MISSING; over shared memory for every call until it is back. Over shared
memory Mooncake answers a dead owner with -800 or -900 (the owner also relays the master, so
-900 means either): explain_failures then asks the master's port, never the dead owner's,
which accepts connections until the last of its threads has exited.
Known limit: setup holds the GIL, so a connect() while the owner is hung (stopped, not dead)
blocks until it resumes (the reconnect waits for an answering pool for this reason).

Nothing here lets a Mooncake call run before setup or after close (that crashes the
process): calls on a client that is not open raise PoolClosedError, and close() leaves the
store to process exit rather than closing it under a call still running.

Device staging (workers/pool/device_staging.py, device_pool.py): after use_device_staging(),
staging= may name it, and its slots' device pointers go to Mooncake (the owner copies over
CUDA IPC; config.cuda_device makes the GPU current on the call threads). headers=True moves
each slot's 64-byte header of the host staging instead (workers/pool/checked_pool.py).

It heals itself (workers/pool/pool_health.py, client_heal.py): while degraded, health() says
why and calls fail fast (UNAVAILABLE keys, PoolDegradedError) so that requests recompute; it
reconnects with a new staging (pool_link.py): callers pass the `buffer` they copied through
as `staging=`, and a call on a stale one fails fast rather than move another buffer's bytes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from workers.pool.bounded_call import BoundedCaller
from workers.pool.client_config import PoolClientConfig, PoolCounters, PoolStats
from workers.pool.client_heal import SelfHealing
from workers.pool.connect import explain_failures
from workers.pool.device_staging import DeviceStaging as DeviceSlots
from workers.pool.device_staging import device_hook
from workers.pool.errors import (
    TIMEOUT_CODE,
    UNAVAILABLE_CODE,
    BatchResult,
    PoolClosedError,
    PoolDegradedError,
    PoolError,
    PoolSetupError,
    PoolTimeoutError,
)
from workers.pool.object_header import HEADER_BYTES
from workers.pool.page_lock import Register, cuda_register
from workers.pool.pool_health import HealthMonitor
from workers.pool.pool_link import Link, close_link, open_link
from workers.pool.retry import answered, retry_failed_keys
from workers.pool.staging import SlotAllocator, StagingBuffer, Target, batch_sizes

log = logging.getLogger(__name__)

POOL_FULL_CODES = frozenset({-200, -101})
NOT_READY_CODES = frozenset({-703, -707})
LEASE_HELD_CODES = frozenset({-706})


class KVPoolClient(SelfHealing):
    """Batch put/get of fixed-size slots of one registered staging buffer, by key."""

    headers_later = sharded = None  # neither optional capability (handoff/slots.py HandoffPool)

    def __init__(
        self, config: PoolClientConfig, register: Register = cuda_register, registry: Any = None
    ) -> None:
        """register page-locks the staging when config.page_lock (a fake only in tests);
        registry (prometheus) gets pdworker_pool_degraded and pdworker_pool_reconnects."""
        self.config = config
        self._register = register
        self._link: Link | None = None
        self._retired: list[Link] = []  # swapped out by reconnects: kept (pool_link.py)
        self.slots = SlotAllocator(config.num_slots)
        self._monitor = HealthMonitor(
            self._probe, self._reconnect, config.probe_interval_s, config.max_reconnects, registry
        )
        self._probing = False  # a probe's native call is running (never two at once)
        self._caller = BoundedCaller("kvpool-call", thread_init=device_hook(config.cuda_device))
        self._device: DeviceSlots | None = None  # use_device_staging()
        self._probe_caller = BoundedCaller("kvpool-probe")  # apart: stats count data calls
        self._lock = threading.Lock()  # state, active calls, counters
        self._cond = threading.Condition(self._lock)  # close() waits on it for active calls
        self._state = "new"  # new -> open -> closed
        self._active = 0  # API calls between their state check and their last native call
        self._counts = PoolCounters()

    def connect(self) -> KVPoolClient:
        """Set up Mooncake and register the staging buffer; PoolSetupError says what to fix."""
        with self._cond:
            if self._state != "new":
                raise PoolSetupError(f"connect() on a client that is {self._state}")
            self._state = "connecting"
        try:
            link = open_link(self.config, self._caller, self._register, 0)
        except BaseException:
            with self._cond:
                self._state = "closed"
            raise
        with self._cond:
            opened = self._state == "connecting"
            self._link, self._state = (link, "open") if opened else (None, self._state)
        if not opened:  # close() ran while we were connecting: nothing uses the store yet
            close_link(link)
            raise PoolClosedError("pool client was closed while connecting")
        self._warm()
        if self.config.probe_interval_s > 0:
            self._monitor.start()
        return self

    def close(self) -> bool:
        """Stop new calls, wait (bounded) for running ones, then release Mooncake.

        If a native call is still running after close_timeout_s, the store is left to process
        exit rather than closed under it (closing it then would crash the process), and
        False is returned: memory that call may still touch must not be freed either.
        """
        self._monitor.stop()
        with self._cond:
            if self._state in ("new", "closed"):
                self._state = "closed"
                return True
            self._state = "closed"
            deadline = time.monotonic() + self.config.close_timeout_s
            while self._active and time.monotonic() < deadline:
                self._cond.wait(deadline - time.monotonic())
        callers = (self._caller, self._probe_caller)
        idle = not self._active and all(c.wait_idle(deadline - time.monotonic()) for c in callers)
        link = self._link
        if not idle:
            log.warning("pool client closed with a Mooncake call still running; store left open")
            return False
        assert link is not None
        close_link(link)  # no pool call runs; the caller waited for its own copies
        self._link = None
        return True

    @property
    def is_open(self) -> bool:
        with self._cond:
            return self._state == "open"

    def __enter__(self) -> KVPoolClient:
        return self.connect() if self._state == "new" else self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def buffer(self) -> StagingBuffer:
        """The staging buffer (numpy view: .view, raw pointer: .ptr); valid once connected.
        A reconnect replaces it: pass the one copied through as `staging=` to put/get."""
        link = self._link
        if link is None:
            raise PoolClosedError("the pool client is not connected")
        return link.buffer

    def use_device_staging(self, staging: DeviceSlots) -> None:
        """Accept staging= this device staging in put_from/get_into from now on: its slots'
        device pointers are passed to Mooncake (workers/pool/device_pool.py decides when)."""
        self._device = staging

    def put_from(
        self,
        keys: Sequence[str],
        slots: Sequence[int],
        sizes_bytes: Sequence[int] | None = None,
        staging: StagingBuffer | DeviceSlots | None = None,
        headers: bool = False,
    ) -> BatchResult:
        """Store each slot under its key (present: success); pool-full keys retried within
        retry_budget_s. sizes_bytes: default the whole slot. staging: the buffer the slots were
        filled in (all UNAVAILABLE if a reconnect replaced it). headers: see the module."""
        sizes = batch_sizes(keys, slots, sizes_bytes, self.config.slot_bytes)
        return self._move("put", keys, slots, sizes, staging, headers)

    def get_into(
        self,
        keys: Sequence[str],
        slots: Sequence[int],
        staging: StagingBuffer | DeviceSlots | None = None,
        headers: bool = False,
    ) -> BatchResult:
        """Read each key into its slot; codes hold the bytes read, statuses say what failed.
        staging, headers: as for put_from (a longer object than the buffer fails to read)."""
        size = HEADER_BYTES if headers else self.config.slot_bytes
        sizes = batch_sizes(keys, slots, [size] * len(keys), self.config.slot_bytes)
        return self._move("get", keys, slots, sizes, staging, headers)

    def object_sizes(self, keys: Sequence[str]) -> list[int]:
        """Each key's object length in bytes (< 0: Mooncake's code, -704 for none)."""
        get_size = self._enter(fail_fast=True).store.get_size  # type: ignore[attr-defined]
        try:
            timeout_s = self.config.call_timeout_s
            return self._bounded(lambda: [get_size(k) for k in keys], "size", timeout_s)
        finally:
            self._exit()

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is in the pool; raises the typed error if the pool cannot say."""
        if not keys:
            return []
        is_exist = self._enter(fail_fast=True).store.batch_is_exist  # type: ignore[attr-defined]
        try:
            timeout_s = self.config.call_timeout_s
            codes = self._bounded(lambda: is_exist(list(keys)), "exists", timeout_s)
        finally:
            self._exit()
        if any(c < 0 for c in codes):
            # batch_is_exist answers -1 for "could not tell"; report the reason it gives.
            worst = min(codes)
            result = self._explain(
                BatchResult.from_codes(keys, [worst if c < 0 else 0 for c in codes])
            )
            self._counts.add_errors(result)
            self._notice(result)
            result.raise_for_error()
            raise PoolError(f"exists failed with code {worst}")
        return [c == 1 for c in codes]

    def remove(self, keys: Sequence[str], force: bool = False) -> BatchResult:
        """Remove keys; keys a reader holds a lease on are retried within retry_budget_s.

        MISSING for keys that were not there, LEASE_HELD if the lease outlived the budget.
        force: despite leases (an object that failed its check: a reader's check fails too).
        """
        if not keys:
            return BatchResult((), ())
        keys = tuple(keys)
        store = self._enter(fail_fast=True).store
        try:
            start = time.monotonic()

            def attempt(idx: list[int], timeout_s: float) -> list[int]:
                sub_keys = [keys[i] for i in idx]
                return self._bounded(
                    lambda: store.batch_remove(sub_keys, force),  # type: ignore[union-attr]
                    "remove",
                    timeout_s,
                )

            every = list(range(len(keys)))
            first = answered(attempt, every, self.config.call_timeout_s)
            return retry_failed_keys(
                keys, first, attempt, "remove", LEASE_HELD_CODES, start, self.config
            )
        finally:
            self._exit()

    def stats(self) -> PoolStats:
        """A snapshot of the counters (bytes and keys moved, hits, misses, errors by kind)."""
        return self._counts.stats(self._caller.num_timeouts)

    def _enter(self, fail_fast: bool = False) -> Link:
        """An API call starts on the current link: refuse it unless open (and, with fail_fast,
        unless healthy); close() waits for it to _exit()."""
        with self._lock:
            if self._state != "open":
                raise PoolClosedError(f"pool client is {self._state}: no call is made")
            if fail_fast and self._monitor.degraded:
                raise PoolDegradedError(f"pool client degraded: {self._monitor.health().reason}")
            self._active += 1
            assert self._link is not None
            return self._link

    def _exit(self) -> None:
        with self._lock:
            self._active -= 1
            if self._state == "closed" and not self._active:
                self._cond.notify_all()  # close() is waiting for the last call

    def _move(
        self,
        op: str,
        keys: Sequence[str],
        slots: Sequence[int],
        sizes: list[int],
        staging: StagingBuffer | DeviceSlots | None,
        headers: bool,
    ) -> BatchResult:
        """put_from / get_into. Every batch pays this path, so an all-OK batch (the common
        case) does no per-key Python work: one native call, one BatchResult, two counters."""
        keys, slots = tuple(keys), tuple(slots)
        link = self._enter()
        try:
            if not keys:
                return BatchResult((), ())
            target = self._target(link, staging, headers)
            if self._monitor.degraded or target is None:
                result = BatchResult(keys, (UNAVAILABLE_CODE,) * len(keys))
                self._counts.add_errors(result)
                return result
            store = link.store
            method = store.batch_put_from if op == "put" else store.batch_get_into  # type: ignore[union-attr]
            start = time.monotonic()
            try:
                codes = self._transfer(
                    method, keys, slots, target, sizes, op, self.config.call_timeout_s
                )
            except PoolTimeoutError:
                codes = [TIMEOUT_CODE] * len(keys)
            if len(codes) == len(keys) and min(codes) >= 0:
                if op == "put":
                    self._counts.add(bytes_put=sum(sizes), keys_put=len(keys))
                else:
                    self._counts.add(bytes_got=sum(codes), hits=len(keys))
                return BatchResult(keys, tuple(codes))

            def attempt(idx: list[int], timeout_s: float) -> list[int]:
                sub_slots = tuple(slots[i] for i in idx)
                sub_sizes = [sizes[i] for i in idx]
                return self._transfer(
                    method, [keys[i] for i in idx], sub_slots, target, sub_sizes, op, timeout_s
                )

            retry_codes = POOL_FULL_CODES if op == "put" else NOT_READY_CODES
            result = retry_failed_keys(keys, codes, attempt, op, retry_codes, start, self.config)
        finally:
            self._exit()
        result = self._explain(result)
        if op == "put":
            ok_bytes = sum(s for s, c in zip(sizes, result.codes, strict=True) if c >= 0)
            self._counts.add(bytes_put=ok_bytes, keys_put=len(result.ok_keys))
        else:
            got = sum(c for c in result.codes if c >= 0)
            self._counts.add(
                bytes_got=got, hits=len(result.ok_keys), misses=len(result.missing_keys)
            )
        self._counts.add_errors(result)
        self._notice(result)
        return result

    def _transfer(
        self,
        method: Callable[[Sequence[str], list[int], list[int]], list[int]],
        keys: Sequence[str],
        slots: tuple[int, ...],
        target: Target,
        sizes: list[int],
        what: str,
        timeout_s: float,
    ) -> list[int]:
        """One native batch put/get of slots, bounded, with the slots pinned until it really
        returns (on the worker thread if the caller gave up on it first)."""
        pool_slots = target.slots
        if pool_slots is not None:  # raises ValueError for a slot not allocated
            pool_slots.pin(slots)
        ptrs, lens = target.args(slots, sizes)
        return self._caller.call(
            lambda: method(keys, ptrs, lens),
            max(0.0, timeout_s),
            on_done=None if pool_slots is None else lambda: pool_slots.unpin(slots),
            what=what,
        )

    def _target(self, link: Link, staging: object, headers: bool) -> Target | None:
        """The slots of the staging a call names: the link's host staging (the default; its
        header bytes), the device staging, or None for a staging a reconnect replaced."""
        if staging is None or staging is link.buffer:
            buffer = link.buffer
            return (
                Target(buffer.header_ptrs, None)
                if headers
                else Target(buffer.slot_ptrs, self.slots)
            )
        device = self._device
        if device is not None and staging is device and not headers:
            return Target(device.slot_ptrs, device.slots)
        return None

    def _bounded(self, fn: Callable[[], list[int]], what: str, timeout_s: float) -> list[int]:
        """A native call that uses no slots, bounded."""
        return self._caller.call(fn, max(0.0, timeout_s), what=what)

    def _explain(self, result: BatchResult) -> BatchResult:
        return explain_failures(result, self.config.master_addr, self.config.owner_addr)
