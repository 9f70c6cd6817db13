"""Ways to hand a prompt's KV blocks from P to D through the pool, one write and one read each.

    P (write):  for each group of `group` blocks:  D2H (swap_cache_layout mode 0) -> put_from
    D (read):   for each group of `group` blocks:  get_into -> H2D (swap_cache_layout mode 1)

`serialized` is what the workers did before the pipeline: every step waits for the one
before it, so a handoff costs D2H + put + get + H2D. `pipelined` is what they do now
(workers/handoff/pipeline.py, the functions workers/handoff/writer.py and
workers/handoff/reader.py call): the D2H of group i+1 overlaps the put of group i and
the get of group i+1 overlaps the H2D of group i. Both report the summed seconds of each stage
(for `pipelined`, the time the side waited on it: the overlapped part is hidden) plus the wall
time of the whole side, so the report compares modes row for row.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kernels.swap_cache_layout import swap_cache_layout


@dataclass(frozen=True)
class WriteTimes:
    """P's side: device -> staging copies, staging -> pool puts, and the whole write."""

    d2h_s: float
    put_s: float
    wall_s: float


@dataclass(frozen=True)
class ReadTimes:
    """D's side: pool -> staging gets, staging -> device copies, and the whole read."""

    get_s: float
    h2d_s: float
    wall_s: float


# write(pool, cache tensors, block ids, keys, group) / read(pool, cache tensors, block ids,
# keys, group): pool is a connected KVPoolClient whose staging the GPU can reach.
WriteFn = Callable[[Any, Sequence[object], Sequence[int], Sequence[str], int], WriteTimes]
ReadFn = Callable[[Any, Sequence[object], Sequence[int], Sequence[str], int], ReadTimes]


def _groups(n: int, group: int) -> list[slice]:
    return [slice(start, min(start + group, n)) for start in range(0, n, group)]


def write_serialized(
    pool: Any, tensors: Sequence[object], block_ids: Sequence[int], keys: Sequence[str], group: int
) -> WriteTimes:
    """Copy each group of blocks to staging slots, wait, put them, wait; then the next group."""
    d2h_s = put_s = 0.0
    start = time.perf_counter()
    for part in _groups(len(keys), group):
        ids = list(block_ids[part])
        slots = pool.slots.allocate(len(ids))
        assert slots is not None, f"{len(ids)} staging slots are not free"
        try:
            t0 = time.perf_counter()
            swap_cache_layout(tensors, pool.buffer.view, ids, slots, 0).wait()
            t1 = time.perf_counter()
            result = pool.put_from(list(keys[part]), slots)
            t2 = time.perf_counter()
        finally:
            pool.slots.free(slots)
        result.raise_for_error()
        d2h_s += t1 - t0
        put_s += t2 - t1
    return WriteTimes(d2h_s, put_s, time.perf_counter() - start)


def read_serialized(
    pool: Any, tensors: Sequence[object], block_ids: Sequence[int], keys: Sequence[str], group: int
) -> ReadTimes:
    """Get each group of blocks into staging slots, wait, copy them to the device, wait."""
    get_s = h2d_s = 0.0
    start = time.perf_counter()
    for part in _groups(len(keys), group):
        ids = list(block_ids[part])
        slots = pool.slots.allocate(len(ids))
        assert slots is not None, f"{len(ids)} staging slots are not free"
        try:
            t0 = time.perf_counter()
            result = pool.get_into(list(keys[part]), slots)
            t1 = time.perf_counter()
            result.raise_for_error()
            swap_cache_layout(tensors, pool.buffer.view, ids, slots, 1).wait()
            t2 = time.perf_counter()
        finally:
            pool.slots.free(slots)
        get_s += t1 - t0
        h2d_s += t2 - t1
    return ReadTimes(get_s, h2d_s, time.perf_counter() - start)


@dataclass(frozen=True)
class HandoffMode:
    name: str
    write: WriteFn
    read: ReadFn


def _timed(
    run: Callable[..., Any],
    pool: Any,
    tensors: Sequence[object],
    block_ids: Sequence[int],
    keys: Sequence[str],
    group: int,
) -> tuple[Any, float]:
    """run (put_blocks or get_blocks) once: what it returned (with its waits), its wall time."""
    start = time.perf_counter()
    # A slot bound already reached: the staging slots must be free at once (else 503).
    result = run(pool, tensors, block_ids, keys, group, time.monotonic())
    return result, time.perf_counter() - start


def write_pipelined(
    pool: Any, tensors: Sequence[object], block_ids: Sequence[int], keys: Sequence[str], group: int
) -> WriteTimes:
    """The workers' put_blocks: the D2H of group i+1 runs while group i is put."""
    from workers.handoff.pipeline import put_blocks

    outcome, wall_s = _timed(put_blocks, pool, tensors, block_ids, keys, group)
    for result in outcome.results:
        result.raise_for_error()
    return WriteTimes(outcome.timings.d2h_s, outcome.timings.put_s, wall_s)


def read_pipelined(
    pool: Any, tensors: Sequence[object], block_ids: Sequence[int], keys: Sequence[str], group: int
) -> ReadTimes:
    """The workers' get_blocks: the get of group i+1 runs while group i is copied in."""
    from workers.handoff.pipeline import get_blocks

    outcome, wall_s = _timed(get_blocks, pool, tensors, block_ids, keys, group)
    assert outcome.num_loaded == len(keys), f"missing keys: {outcome.missing_keys[:4]}"
    return ReadTimes(outcome.timings.get_s, outcome.timings.h2d_s, wall_s)


MODES = {
    "serialized": HandoffMode("serialized", write_serialized, read_serialized),
    "pipelined": HandoffMode("pipelined", write_pipelined, read_pipelined),
}
