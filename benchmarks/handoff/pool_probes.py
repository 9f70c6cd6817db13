"""Why is a put slower than a memcpy? One question per probe, each on fresh pools.

    value_batch   cold vs warm, value size (block 16 vs 64), keys per batch_put_from
    streams       concurrent writers (processes), owner service threads, a put beside a get
    prefault      can the owner fault its memory in at start: glibc THP, Mooncake hugepages
                  (MC_STORE_USE_HUGEPAGE + reserved HugeTLB pages), Mooncake's mmap arena,
                  a fill-and-remove at start; and MC_STORE_MEMCPY=0 (transfer engine
                  instead of memcpy)

Every measurement is a dict row (see rate()); GB/s = bytes / wall time of the operation over
all its streams. `cold` = the first write into a fresh pool's segment.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.handoff.pool_lab import PoolHandle, PoolLab

MIB, GIB = 1 << 20, 1 << 30
Emit = Callable[[dict[str, Any]], None]


@dataclass(frozen=True)
class ProbeSizes:
    small_value: int  # a block of 16 tokens (Llama-3-8B: 2 MiB)
    big_value: int  # a block of 64 tokens (8 MiB)
    total: int  # bytes a measurement moves, one stream
    batches: tuple[int, ...]  # keys per call
    streams: tuple[int, ...]  # concurrent writers
    prefault_total: int  # bytes of the first put in the prefault probe


GPU_SIZES = ProbeSizes(2 * MIB, 8 * MIB, GIB, (1, 8, 64, 256), (1, 2, 4, 8), 2 * GIB)
CPU_SIZES = ProbeSizes(64 << 10, 256 << 10, 8 * MIB, (1, 8, 64), (1, 2), 16 * MIB)


def pool_bytes(moved: int) -> int:
    """Room for `moved` bytes under the master's 90% eviction mark, and little more (memory
    beyond what the cold put touched could make a later 'warm' put partly cold)."""
    return moved + moved // 7 + 32 * MIB


def keys(tag: str, count: int) -> list[str]:
    return [f"probe/{tag}/{i}" for i in range(count)]


def rate(result: dict[str, Any], nbytes: int, **fields: Any) -> dict[str, Any]:
    """One row: what was measured (fields) and how fast, with the owner's share of the work."""
    wall = max(result["wall_s"], 1e-9)
    row = {**fields, "bytes": nbytes, "gbps": nbytes / wall / 1e9, "wall_s": wall}
    for key in ("owner_faults", "owner_thp_kib"):
        if key in result:
            row[key] = result[key]
    if "owner_busiest_s" in result:
        row["busiest_share"] = result["owner_busiest_s"] / wall
        row["owner_cpu_share"] = result["owner_cpu_s"] / wall
    if len(result.get("each_s", ())) > 1:
        row["each_gbps"] = [round(nbytes / len(result["each_s"]) / s / 1e9, 2)
                            for s in result["each_s"]]  # fmt: skip
    return row


def _put_get_remove(
    lab: PoolLab, pool: PoolHandle, per_worker: list[list[str]], value: int, batch: int,
    emit: Emit, **fields: Any,
) -> None:  # fmt: skip
    nbytes = sum(len(k) for k in per_worker) * value
    common = {"value": value, "batch": batch, "streams": len(per_worker), **fields}
    emit(rate(lab.op(pool, "put", per_worker, batch), nbytes, op="put", **common))
    emit(rate(lab.op(pool, "get", per_worker, batch), nbytes, op="get", **common))
    lab.remove(per_worker)


def _guarded(emit: Emit, probe: str, variant: str, body: Callable[[], None]) -> None:
    """Run one variant; a failure becomes a row, and the probe goes on with the next."""
    try:
        body()
    except Exception as exc:
        emit({"probe": probe, "variant": variant, "note": f"failed: {exc!r}"[:1500]})


def value_batch(lab: PoolLab, sizes: ProbeSizes, emit: Emit) -> None:
    for value in (sizes.small_value, sizes.big_value):
        _guarded(emit, "value_batch", f"{value} B", lambda v=value: _one_value(lab, sizes, emit, v))


def _one_value(lab: PoolLab, sizes: ProbeSizes, emit: Emit, value: int) -> None:
    count = sizes.total // value
    batches = [b for b in sizes.batches if b <= count]
    cold_batch = min(64, count)
    with lab.pool(pool_bytes(sizes.total)) as pool:
        lab.connect(pool, 1, value, num_slots=max(*batches, cold_batch))
        _put_get_remove(lab, pool, [keys(f"vb{value}/cold", count)], value, cold_batch,
                        emit, probe="value_batch", temp="cold")  # fmt: skip
        for batch in batches:
            _put_get_remove(lab, pool, [keys(f"vb{value}/b{batch}", count)], value, batch,
                            emit, probe="value_batch", temp="warm")  # fmt: skip


def streams(lab: PoolLab, sizes: ProbeSizes, emit: Emit, threads: tuple[int, ...]) -> None:
    for owner_threads in threads:
        _guarded(emit, "streams", f"{owner_threads} owner threads",
                 lambda t=owner_threads: _one_owner(lab, sizes, emit, t))  # fmt: skip


def _one_owner(lab: PoolLab, sizes: ProbeSizes, emit: Emit, owner_threads: int) -> None:
    value = sizes.small_value
    count = sizes.total // value
    cold_streams = min(4, max(sizes.streams))
    with lab.pool(pool_bytes(cold_streams * sizes.total), threads=owner_threads) as pool:
        lab.connect(pool, max(sizes.streams), value, num_slots=64)
        fields = {"probe": "streams", "owner_threads": owner_threads}
        per = [keys(f"cold/{w}", count) for w in range(cold_streams)]
        _put_get_remove(lab, pool, per, value, 64, emit, temp="cold", **fields)
        for n in sizes.streams:
            half = count // 2  # n * total / 2 <= what the cold put touched
            per = [keys(f"n{n}/{w}", half) for w in range(n)]
            _put_get_remove(lab, pool, per, value, 64, emit, temp="warm", **fields)
        # A put beside a get, as overlapped P and D would run on one owner.
        old, new = keys("mixed-old", count), keys("mixed-new", count)
        lab.op(pool, "put", [old], 64)
        both = lab.ops(pool, [("get", old), ("put", new)], 64)
        emit(rate(both, 2 * count * value, op="get + put", value=value, batch=64, streams=2,
                  temp="warm", **fields))  # fmt: skip
        lab.remove([old, new])


def _hugetlb_reserve(pages: int) -> tuple[int, str]:
    """Reserve HugeTLB pages (root); the number granted, and the value to restore."""
    path = Path("/proc/sys/vm/nr_hugepages")
    old = path.read_text().strip()
    path.write_text(str(pages))
    return int(path.read_text().strip()), old


def prefault(lab: PoolLab, sizes: ProbeSizes, emit: Emit, allow_sysctl: bool, thp: bool) -> None:
    variants: list[tuple[str, dict[str, str]]] = [("default", {})]
    if thp:
        variants.append(("glibc THP (GLIBC_TUNABLES=glibc.malloc.hugetlb=1)",
                         {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}))  # fmt: skip
    if allow_sysctl:
        variants.append(("MC_STORE_USE_HUGEPAGE=1 (+ HugeTLB pages)",
                         {"MC_STORE_USE_HUGEPAGE": "1"}))  # fmt: skip
    arena_gib = -(-pool_bytes(sizes.prefault_total) // GIB)
    variants.append(("MC_MMAP_ARENA_POOL_SIZE (arena, no HugeTLB)",
                     {"MC_MMAP_ARENA_POOL_SIZE": f"{arena_gib}gb"}))  # fmt: skip
    variants.append(("fill + remove at start", {}))
    variants.append(("MC_STORE_MEMCPY=0", {"MC_STORE_MEMCPY": "0"}))
    for name, env in variants:
        _guarded(emit, "prefault", name,
                 lambda n=name, e=env: _one_prefault(lab, sizes, emit, n, e))  # fmt: skip


def _one_prefault(
    lab: PoolLab, sizes: ProbeSizes, emit: Emit, name: str, env: dict[str, str]
) -> None:
    value, total = sizes.small_value, sizes.prefault_total
    count = total // value
    size = pool_bytes(total)
    restore = None
    note = ""
    if "MC_STORE_USE_HUGEPAGE" in env:
        granted, restore = _hugetlb_reserve(size // (2 * MIB) + 16)
        note = f"{granted} HugeTLB pages reserved"
    try:
        with lab.pool(size, env=env) as pool:
            lab.connect(pool, 1, value, num_slots=64)
            fields = {"probe": "prefault", "variant": name, "start_s": pool.start_s}
            if name.startswith("fill"):
                filler = keys("filler", count)  # as much as the put below: ~86% of the pool
                fields["fill_s"] = lab.op(pool, "put", [filler], 64)["wall_s"]
                lab.remove([filler])
            for temp in ("cold", "warm"):
                _put_get_remove(lab, pool, [keys(temp, count)], value, 64, emit, temp=temp,
                                note=note, **fields)  # fmt: skip
    finally:
        if restore is not None:
            Path("/proc/sys/vm/nr_hugepages").write_text(restore)
