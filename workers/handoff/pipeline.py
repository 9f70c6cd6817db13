"""The handoff's copies and pool calls, overlapped group by group.

    P  put_blocks:  D2H g0 | D2H g1            | D2H g2           |
                           | put g0            | put g1           | put g2
    D  get_blocks:  get g0 | get g1            | get g2           |
                           | H2D g0            | H2D g1           | H2D g2

A group is up to `group` blocks: one swap_cache_layout call and one pool batch call. P starts
the device -> host copy of group i+1, then puts group i while it runs; D starts the host ->
device copy of group i, then gets group i+1 while it runs. On a GPU the copy is the kernel
queued on the stream (it returns at once, its small grid leaves the model's compute alone);
on the CPU it runs on a helper thread, so the same pipeline overlaps there too. The pool is
the client (host staging) or, on a GPU worker's device-pointer path, a DevicePool
(workers/pool/device_pool.py): the same code then gathers into and scatters out of GPU
staging whose device pointers go to the pool; the worker chose which once, at start.

Correctness before speed:
- a group's slots go back only after its copy completed (P: before the put reads them; D:
  before the next use of the slots) and its pool call returned (SlotAllocator keeps slots of
  a call still running past its time bound pinned);
- on any error the functions wait for every copy they started before they raise, so the
  caller may free or reuse the engine's blocks as soon as they return (workers await them to
  the end even when the request is cancelled: workers/handoff/tasks.py);
- D stops at the first block the pool lacks: no get is issued past a group with a miss, and
  only the blocks before the miss are copied.
- Slots for the next group are taken only if free at once; otherwise the pipeline finishes
  the group in hand first (serialized), so two requests can never hold half the staging each
  and wait on one another.

Timings (workers/handoff/timings.py): put_blocks returns WriteTimings (d2h_s, put_s),
get_blocks ReadTimings (get_s, h2d_s): the time the calling thread waited on each stage, so
with overlap they sum to about the wall time and the hidden part is gone.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from time import perf_counter
from typing import Any

from kernels.cuda_swap import side_stream
from kernels.layout import HostHeads
from kernels.swap_cache_layout import swap_cache_layout
from kernels.tensor_refs import describe_cache
from workers.handoff.outcomes import GetOutcome, PutOutcome
from workers.handoff.slots import HandoffPool, wait_for_slots
from workers.handoff.timings import ReadTimings, WriteTimings
from workers.pool.errors import BatchResult, KeyStatus, PoolError

log = logging.getLogger(__name__)
MODE_D2H, MODE_H2D = 0, 1


@dataclass
class _Waits:
    """Seconds the calling thread waited on the copies and on the pool calls, summed."""

    copy_s: float = 0.0
    pool_s: float = 0.0


class _Copier:
    """Starts copies between the cache and staging slots; `wait()` on what start returns.

    GPU: the copies go on a stream of their own (kernels.cuda_swap.side_stream), so that they
    run while the model computes on its stream; the callers order them after the compute
    that wrote the blocks (the engine's step has returned) and wait for them before the blocks
    are used again. CPU: one helper thread runs the (synchronous) numpy copies, in order.
    """

    def __init__(
        self, tensors: Sequence[object], host: object, host_heads: HostHeads | None = None
    ) -> None:
        self._tensors, self._host, self._host_heads = tensors, host, host_heads
        cache = describe_cache(tensors)
        self._stream = side_stream(cache) if cache.on_gpu else None
        self._thread = None if cache.on_gpu else concurrent.futures.ThreadPoolExecutor(1)

    def start(self, block_ids: list[int], slots: list[int], mode: int) -> Any:
        copy = functools.partial(
            swap_cache_layout,
            self._tensors,
            self._host,
            block_ids,
            slots,
            mode,
            host_heads=self._host_heads,
        )
        if self._thread is None:
            return copy(stream=self._stream)
        return _FutureHandle(self._thread.submit(copy))

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)


@dataclass
class _Copy:
    """One group whose slots are held: its positions in the request, slots, copy handle."""

    part: range
    slots: list[int]
    handle: Any


class _FutureHandle:
    def __init__(self, future: concurrent.futures.Future) -> None:
        self._future = future

    def wait(self) -> None:
        self._future.result()


def _groups(n: int, group: int) -> list[range]:
    if group < 1:
        raise ValueError(f"group must be >= 1, got {group}")
    return [range(start, min(start + group, n)) for start in range(0, n, group)]


def _settle(
    pool: Any, in_flight: deque[_Copy], waits: _Waits | None = None
) -> BaseException | None:
    """Wait for every copy in flight, oldest first, and give its slots back; the first
    error a copy raised is returned (every copy is still waited for and every slot freed)."""
    error = None
    while in_flight:
        copy = in_flight.popleft()
        t0 = perf_counter()
        try:
            if copy.handle is not None:
                copy.handle.wait()
        except BaseException as exc:  # the rest are waited for, then it is raised
            error = error or exc
        finally:
            pool.slots.free(copy.slots)
        if waits is not None:
            waits.copy_s += perf_counter() - t0
    return error


def put_blocks(
    pool: HandoffPool,
    tensors: Sequence[object],
    block_ids: Sequence[int],
    keys: Sequence[str],
    group: int,
    slots_by_s: float,
    overlap: bool = True,
) -> PutOutcome:
    """Copy block_ids[j] out of the cache and put it under keys[j], overlapped by group.

    pool is a connected KVPoolClient (staging the copy can reach). Staging slots are waited
    for until slots_by_s (time.monotonic), then 503 staging_full: a value, not a closure, so
    a sharded pool hands the caller's own bound to every rank. Returns one BatchResult per
    group (a failed put does not stop the next groups) and the stage timings. overlap=False:
    one group at a time (the serialized baseline). Raises what a copy, a slot wait or the
    client raised, after every copy started has completed. A pool whose blocks carry headers
    (workers/pool/checked_pool.py headers_later) puts a group's headers while the next group
    is copied and put; they are all in before this returns.
    """
    later = pool.headers_later
    if later is None:
        return _put_groups(pool, tensors, block_ids, keys, group, slots_by_s, overlap)
    with later() as late:
        outcome = _put_groups(pool, tensors, block_ids, keys, group, slots_by_s, overlap)
        t0 = perf_counter()
        results = tuple(late.settle(outcome.results))
    timings = WriteTimings(outcome.timings.d2h_s, outcome.timings.put_s + perf_counter() - t0)
    return PutOutcome(results, timings)


def _put_groups(
    pool: HandoffPool,
    tensors: Sequence[object],
    block_ids: Sequence[int],
    keys: Sequence[str],
    group: int,
    slots_by_s: float,
    overlap: bool,
) -> PutOutcome:
    """put_blocks' groups (their header puts, if any, may still run)."""
    if len(block_ids) != len(keys):
        raise ValueError(f"{len(block_ids)} block ids but {len(keys)} keys")
    if pool.sharded is not None:  # each rank writes its heads (workers/engine/tp/)
        return pool.sharded.put_sharded(tensors, block_ids, keys, group, overlap, slots_by_s)
    groups = _groups(len(keys), group)
    staging = pool.buffer  # a reconnect may replace it: the puts name the one copied into
    copier = _Copier(tensors, staging.view)
    in_flight: deque[_Copy] = deque()  # D2H copies started, their groups not yet put
    results: list[BatchResult] = []
    waits = _Waits()

    def wait_slots(num_slots: int) -> list[int]:
        return wait_for_slots(pool, num_slots, slots_by_s)

    def launch(part: range, slots: list[int]) -> None:
        in_flight.append(_Copy(part, slots, None))  # slots freed by _settle even if start fails
        in_flight[-1].handle = copier.start([block_ids[j] for j in part], slots, MODE_D2H)

    try:
        if groups:
            launch(groups[0], wait_slots(len(groups[0])))
        nxt = 1
        while in_flight:
            if overlap and nxt < len(groups):  # the D2H of group nxt runs while one is put
                free_now = pool.slots.allocate(len(groups[nxt]))
                if free_now is not None:
                    launch(groups[nxt], free_now)
                    nxt += 1
            copy = in_flight[0]
            t0 = perf_counter()
            copy.handle.wait()
            t1 = perf_counter()
            in_flight.popleft()
            try:
                results.append(
                    pool.put_from([keys[j] for j in copy.part], copy.slots, staging=staging)
                )
            finally:
                pool.slots.free(copy.slots)  # deferred while a timed-out put still runs
            waits.copy_s += t1 - t0
            waits.pool_s += perf_counter() - t1
            if nxt < len(groups) and not in_flight:  # no slots were free: one at a time
                launch(groups[nxt], wait_slots(len(groups[nxt])))
                nxt += 1
    finally:
        _settle(pool, in_flight)
        copier.close()
    return PutOutcome(tuple(results), WriteTimings(d2h_s=waits.copy_s, put_s=waits.pool_s))


def get_blocks(
    pool: HandoffPool,
    tensors: Sequence[object],
    block_ids: Sequence[int],
    keys: Sequence[str],
    group: int,
    slots_by_s: float,
    overlap: bool = True,
    stop_at_s: float | None = None,
    host_heads: HostHeads | None = None,
) -> GetOutcome:
    """Get keys[j] and copy it into block_ids[j], in order, up to the first key not read.

    host_heads: the pool objects hold more KV heads than the cache (a larger TP shard); only
    the cache's heads of each are copied in (kernels/layout.py).

    A pool error on a group counts as every key of it missing. overlap=False: one group at a
    time (the serialized baseline). Staging slots are waited for until slots_by_s
    (time.monotonic), then 503 staging_full. With stop_at_s (time.monotonic), no group's get
    starts after it: its keys and every later one count as missing. Raises what a copy, a slot
    wait or the client raised (other than PoolError), after every copy started completed.
    """
    if len(block_ids) != len(keys):
        raise ValueError(f"{len(block_ids)} block ids but {len(keys)} keys")
    if (sharded := pool.sharded) is not None:  # each rank reads the shards of its heads
        return sharded.get_sharded(tensors, block_ids, keys, group, overlap, stop_at_s, slots_by_s)
    groups = _groups(len(keys), group)
    staging = pool.buffer  # a reconnect may replace it: the gets name the one copied out of
    copier = _Copier(tensors, staging.view, host_heads)
    in_flight: deque[_Copy] = deque()  # the H2D copy of the previous group, if any
    held: list[int] | None = None  # slots taken for the next group, not yet read into
    loaded = 0
    missing: tuple[str, ...] = ()
    waits = _Waits()
    try:
        for index, part in enumerate(groups):
            if stop_at_s is not None and time.monotonic() >= stop_at_s:
                missing = tuple(keys[part[0] :])
                break
            slots = held if held is not None else wait_for_slots(pool, len(part), slots_by_s)
            held = None
            in_flight.append(_Copy(part, slots, None))  # freed by _settle from here on
            group_keys = [keys[j] for j in part]
            t0 = perf_counter()
            try:  # runs while the previous group's H2D copy is in flight
                statuses = list(pool.get_into(group_keys, slots, staging=staging).statuses)
            except PoolError as exc:
                log.warning("pool get failed (%s): %d keys count as missing", exc, len(part))
                statuses = [KeyStatus.ERROR] * len(group_keys)
            waits.pool_s += perf_counter() - t0
            num_ok = next((i for i, s in enumerate(statuses) if s is not KeyStatus.OK), len(part))
            this = in_flight.pop()
            error = _settle(pool, in_flight, waits)  # the previous group is in, slots back
            in_flight.append(this)
            if error is not None:
                raise error
            if num_ok:
                ids = [block_ids[j] for j in part[:num_ok]]
                this.handle = copier.start(ids, slots[:num_ok], MODE_H2D)
            loaded += num_ok
            if num_ok < len(part):
                missing = tuple(
                    k for k, s in zip(group_keys, statuses, strict=True) if s is not KeyStatus.OK
                )
                break
            if index + 1 < len(groups):  # the next get overlaps this group's copy
                held = pool.slots.allocate(len(groups[index + 1])) if overlap else None
                if held is None:  # none free at once: finish this group first
                    error = _settle(pool, in_flight, waits)
                    if error is not None:
                        raise error
        error = _settle(pool, in_flight, waits)
        if error is not None:
            raise error
        return GetOutcome(loaded, missing, ReadTimings(get_s=waits.pool_s, h2d_s=waits.copy_s))
    finally:
        if held is not None:
            pool.slots.free(held)
        _settle(pool, in_flight)
        copier.close()
