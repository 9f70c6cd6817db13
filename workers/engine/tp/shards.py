"""Which KV heads each rank holds, and which pool shards a reader of any TP size needs.

A worker of TP size t splits the model's H KV heads into t equal ranges; rank r holds
[r * H / t, (r + 1) * H / t) and writes each block's heads under the shard key naming that
range (workers.pool.keys.shard_key). A reader of TP size d needs the heads of its own range;
the shards of a writer of size t that cover it are:

    t >= d   t / d whole shards, each scattered into its part of the reader's heads
    t <  d   one shard holding H / t heads, of which the reader takes its H / d

Any t and d that divide H pair (the heads of every range exist as whole shards or slices of
one); a size that does not divide the heads, the query heads or the MLP width cannot run at
all, and tp_problem says why.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HeadRange:
    """KV heads [start, end) of total."""

    start: int
    end: int
    total: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end <= self.total:
            raise ValueError(f"bad head range [{self.start}, {self.end}) of {self.total}")

    @property
    def count(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class ShardPiece:
    """Heads [src_head, src_head + count) of the pool shard `shard` (indices within the
    shard) go to heads [dst_head, dst_head + count) of the reader's own range."""

    shard: HeadRange
    src_head: int
    dst_head: int
    count: int

    @property
    def whole(self) -> bool:
        """The reader takes the whole shard (a plain copy, no slicing of the object)."""
        return self.src_head == 0 and self.count == self.shard.count


def rank_heads(total: int, tp_size: int, rank: int) -> HeadRange:
    """The KV heads rank `rank` of a TP-size worker holds."""
    if tp_size < 1 or total % tp_size or not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} of TP size {tp_size} cannot split {total} KV heads")
    per_rank = total // tp_size
    return HeadRange(rank * per_rank, (rank + 1) * per_rank, total)


def tp_problem(
    num_heads: int, num_kv_heads: int, intermediate_size: int, tp_size: int
) -> str | None:
    """Why a model cannot run at this TP size (None: it can)."""
    if tp_size < 1:
        return f"the tensor-parallel size must be >= 1, got {tp_size}"
    # The query heads are a multiple of the KV heads (ModelConfig checks it): they split too.
    for what, count in (
        ("KV heads", num_kv_heads),
        ("MLP columns (intermediate_size)", intermediate_size),
    ):
        if count % tp_size:
            return (
                f"tensor-parallel size {tp_size} does not divide the model's {count} {what}: "
                "each rank must hold an equal share"
            )
    return None


def pairing_problem(num_kv_heads: int, writer_tp: int, reader_tp: int) -> str | None:
    """Why a worker of TP size writer_tp cannot hand KV to one of size reader_tp (None: it
    can). Both sizes must divide the KV heads: then every reader range is made of whole
    writer shards or lies inside one."""
    for role, size in (("prefill", writer_tp), ("decode", reader_tp)):
        if size < 1 or num_kv_heads % size:
            return (
                f"the {role} side's TP size {size} does not divide the model's {num_kv_heads} "
                "KV heads: its pool shards cannot be named by whole head ranges"
            )
    return None


def covering(reader: HeadRange, writer_tp: int) -> list[ShardPiece]:
    """The shards of a writer of TP size writer_tp that hold the reader's heads, in order."""
    shard_heads = reader.total // writer_tp
    if reader.total % writer_tp:
        raise ValueError(pairing_problem(reader.total, writer_tp, 1) or "")
    pieces = []
    head = reader.start
    while head < reader.end:
        index = head // shard_heads
        shard = HeadRange(index * shard_heads, (index + 1) * shard_heads, reader.total)
        end = min(shard.end, reader.end)
        pieces.append(ShardPiece(shard, head - shard.start, head - reader.start, end - head))
        head = end
    return pieces


def layouts(total: int, own_tp: int) -> tuple[int, ...]:
    """The writer TP sizes a reader may find a block in, its own first: every size that
    divides the heads (a block of the pool may come from a worker of any of them; a reader
    of any size reads any of them, cutting its heads out of a larger shard if need be)."""
    return (own_tp, *(t for t in range(1, total + 1) if total % t == 0 and t != own_tp))
