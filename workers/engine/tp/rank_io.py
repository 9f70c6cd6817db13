"""One rank's pool I/O: its own heads of each block out, the shards covering its heads in.

Every P/D worker's staging slot holds a block of all H KV heads (any shard fits one slot);
a shard of c heads is a smaller object at the slot's start. The pipeline
(workers/handoff/pipeline.py) moves whole "blocks" between a cache and slots, so a shard is
given to it as a block of a view:

    cache [num_blocks, own, bs, d] viewed as [num_blocks * own / c, c, bs, d]   (no copy)
    block b, heads [h, h + c) of the rank's own   ->  view block b * own / c + h / c
    staging slot s (H heads)                      ->  view slot s * H / c

A reader whose heads lie inside one larger shard (P of a smaller TP size than D) reads the
whole shard into a slot and copies only its heads out of it (swap_cache_layout's host_heads:
the same pipeline and kernel, CPU or GPU):

    staging slot s (H heads), shard of S heads   ->  view slot s * H / S
    heads [src, src + own) of each shard chunk   ->  block b of the cache
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from kernels.layout import HostHeads
from kernels.tensor_refs import describe_cache
from workers.engine.tp.shards import HeadRange, ShardPiece, covering
from workers.handoff.pipeline import GetOutcome, PutOutcome, get_blocks, put_blocks
from workers.handoff.timings import ReadTimings
from workers.pool.keys import shard_key


class ScaledSlots:
    """Staging slots counted in objects of 1/ratio of a slot (the view's slot indices)."""

    def __init__(self, inner: Any, ratio: int) -> None:
        self.inner, self.ratio = inner, ratio

    def _out(self, slots: list[int] | None) -> list[int] | None:
        return None if slots is None else [s * self.ratio for s in slots]

    def allocate(self, num_slots: int) -> list[int] | None:
        return self._out(self.inner.allocate(num_slots))

    def allocate_within(self, num_slots: int, timeout_s: float) -> list[int] | None:
        return self._out(self.inner.allocate_within(num_slots, timeout_s))

    def free(self, slots: Iterable[int]) -> None:
        self.inner.free([s // self.ratio for s in slots])


class HeadsView:
    """The pool as the pipeline sees it for shards of `heads` of `total` KV heads."""

    def __init__(self, inner: Any, heads: int, total: int, object_bytes: int) -> None:
        self.inner, self.ratio, self.object_bytes = inner, total // heads, object_bytes
        self.slots = ScaledSlots(inner.slots, self.ratio)

    @property
    def buffer(self) -> Any:
        return self.inner.buffer

    @property
    def config(self) -> Any:
        return self.inner.config

    def _pool_slots(self, slots: Sequence[int]) -> list[int]:
        return [s // self.ratio for s in slots]

    def put_from(self, keys: Sequence[str], slots: Sequence[int], staging: Any = None) -> Any:
        sizes = [self.object_bytes] * len(keys)
        return self.inner.put_from(keys, self._pool_slots(slots), sizes, staging=staging)

    def get_into(self, keys: Sequence[str], slots: Sequence[int], staging: Any = None) -> Any:
        return self.inner.get_into(keys, self._pool_slots(slots), staging=staging)

    sharded = None  # this rank's part of a sharded call, moved by the pipeline

    @property
    def headers_later(self) -> Any:
        """The wrapped pool's (workers/pool/checked_pool.py): a checked pool's header puts run
        behind the next group's payload, as put_blocks runs them over the pool itself."""
        return self.inner.headers_later


def head_bytes(caches: Sequence[object], own: HeadRange) -> int:
    """Bytes of one KV head of one block across every layer, K and V."""
    return describe_cache(caches).geometry.slot_bytes // own.count


def view_caches(caches: Sequence[object], heads: int) -> list[Any]:
    """Each layer tensor as blocks of `heads` heads (a view: the same memory); the tensors
    themselves when a block already has that many (equal TP sizes: the plain path)."""
    refs = describe_cache(caches).tensors
    if refs[0].shape[1] == heads:
        return list(caches)
    out = []
    for tensor, ref in zip(caches, refs, strict=True):
        nb, own, rows, dim = ref.shape
        shape = [nb * own // heads, heads, rows]
        if ref.host_bytes is not None:  # CPU (numpy, Paddle): a byte view
            out.append(ref.host_bytes.reshape(*shape, dim * ref.elem_bytes))
        else:  # GPU arrays (CuPy, PyTorch, Paddle): a reshape of a contiguous one is a view
            out.append(tensor.reshape([*shape, dim]))
    return out


def write_rank(
    pool: Any,
    caches: Sequence[object],
    own: HeadRange,
    block_ids: Sequence[int],
    keys: Sequence[str],
    group: int,
    slots_by_s: float,
    overlap: bool = True,
) -> PutOutcome:
    """Put this rank's heads of block_ids[j] under the shard key of keys[j] (logical); staging
    slots waited for until slots_by_s (time.monotonic: the caller's bound, every rank's)."""
    view = HeadsView(pool, own.count, own.total, head_bytes(caches, own) * own.count)
    return put_blocks(
        view,
        caches,
        list(block_ids),
        [shard_key(k, own.start, own.end, own.total) for k in keys],
        group,
        slots_by_s,
        overlap,
    )


def read_rank(
    pool: Any,
    caches: Sequence[object],
    own: HeadRange,
    writer_tp: int,
    block_ids: Sequence[int],
    keys: Sequence[str],
    group: int,
    slots_by_s: float,
    overlap: bool = True,
    stop_at_s: float | None = None,
) -> GetOutcome:
    """Read the shards a writer of TP size writer_tp left for keys[j] (logical) into this
    rank's heads of block_ids[j], in order, up to the first block some shard is missing;
    staging slots waited for until slots_by_s (time.monotonic: the caller's bound)."""
    loaded, missing, timings = len(keys), (), ReadTimings()
    for piece in covering(own, writer_tp):
        n = min(loaded, len(keys))
        if n == 0:
            break
        shard = piece.shard
        skeys = [shard_key(k, shard.start, shard.end, shard.total) for k in keys[:n]]
        outcome = _read_piece(
            pool, caches, own, piece, block_ids[:n], skeys, group, slots_by_s, overlap, stop_at_s
        )
        if outcome.num_loaded < loaded:
            loaded, missing = outcome.num_loaded, outcome.missing_keys
        timings = timings + outcome.timings
    return GetOutcome(min(loaded, len(keys)), missing, timings)


def _read_piece(
    pool: Any,
    caches: Sequence[object],
    own: HeadRange,
    piece: ShardPiece,
    block_ids: Sequence[int],
    skeys: list[str],
    group: int,
    slots_by_s: float,
    overlap: bool,
    stop_at_s: float | None,
) -> GetOutcome:
    """One piece through the pipeline: the shard's objects into slots, then its heads into
    view blocks of the cache. A piece that is part of its shard (a writer of fewer ranks)
    copies only its heads out of each slot (host_heads: kernels/layout.py)."""
    c, shard = piece.count, piece.shard
    view = HeadsView(pool, shard.count, own.total, head_bytes(caches, own) * shard.count)
    ids = [b * (own.count // c) + piece.dst_head // c for b in block_ids]
    cut = None if piece.whole else HostHeads(piece.src_head, shard.count)
    return get_blocks(
        view,
        view_caches(caches, c),
        ids,
        skeys,
        group,
        slots_by_s,
        overlap,
        stop_at_s,
        host_heads=cut,
    )
