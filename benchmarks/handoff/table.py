"""The handoff table: for each block size and prompt, one fresh pool, a cold pass, warm passes.

    for block_size, prompt:         new P and D processes make their caches, and a fresh
                                    LocalPool (master + `pdworker pool`) starts: the first
                                    pass is cold (no object ever written; the owner's memory
                                    pre-faulted at start unless prefault=False)
        cold pass, warm passes      D zeroes its target blocks; P writes (D2H + put); D reads
                                    (get + H2D) and checks every byte; D removes the keys, so
                                    the next pass reuses memory the owner has already touched
        limits                      bulk cudaMemcpyAsync each way and host memcpy, same bytes

P's and D's block ids are distinct random permutations of their caches (scattered, as a paged
cache hands them out) and the last block is partial (kv.TAIL_SHORT_TOKENS).
"""

from __future__ import annotations

import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.handoff.actor import Actor
from benchmarks.handoff.kv import KvShape, Prompt, scattered_ids
from benchmarks.handoff.limits import HostMemcpy
from benchmarks.handoff.side import Side

MIB = 1 << 20


@dataclass(frozen=True)
class TableConfig:
    gpu: bool
    shape: KvShape
    tokens: tuple[int, ...]
    block_sizes: tuple[int, ...]
    mode: str = "pipelined"
    group_blocks: int = 64  # blocks per swap + pool call: pdworker --transfer-batch-blocks
    staging_slots: int = 256  # pdworker --staging-slots
    warm_reps: int = 3
    limit_reps: int = 3
    prefault: bool = True  # `pdworker pool` pre-faults its memory (--no-prefault: cold)
    log_dir: Path = Path("/tmp/pdrouter-handoff")
    path: str = "host"  # host staging, or device pointers (--handoff-path device)
    device_calls: int = 4  # device path: concurrent Mooncake calls per batch
    owner_threads: int = 8  # `pdworker pool --threads`


@dataclass
class Row:
    prompt: Prompt
    slot_bytes: int
    moved_bytes: int
    setup: dict[str, float]
    passes: dict[str, dict[str, Any]] = field(default_factory=dict)  # "cold" | "warm"
    limits: dict[str, float] = field(default_factory=dict)
    error: str = ""  # the traceback, when this prompt could not be measured


def segment_bytes(moved_bytes: int) -> int:
    """Pool memory for one prompt: room to spare under the master's 90% eviction mark."""
    return moved_bytes + moved_bytes // 4 + 64 * MIB


def _median_pass(passes: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-field median of the warm passes; exact only if every pass was."""
    out: dict[str, Any] = {"exact": all(p["exact"] for p in passes), "reps": len(passes)}
    for key in passes[0]:
        if key != "exact":
            out[key] = statistics.median(p[key] for p in passes)
    return out


def run_table(
    cfg: TableConfig, log: Any = print, on_row: Callable[[list[Row]], None] | None = None
) -> list[Row]:
    """Every (block size, prompt) row; on_row(rows so far) after each. A prompt that fails
    becomes a row carrying the error, and the next prompt runs."""
    max_moved = max(Prompt(n, bs).num_blocks * cfg.shape.slot_bytes(bs)
                    for n in cfg.tokens for bs in cfg.block_sizes)  # fmt: skip
    memcpy = HostMemcpy(max_moved)
    rows: list[Row] = []
    for bs in cfg.block_sizes:
        for n in cfg.tokens:
            prompt = Prompt(n, bs)
            slot_bytes = cfg.shape.slot_bytes(bs)
            row = Row(prompt, slot_bytes, prompt.num_blocks * slot_bytes, setup={})
            try:
                _run_prompt(cfg, row, memcpy, log)
            except Exception:
                row.error = traceback.format_exc()
                log(f"  {prompt.label} bs{bs} failed:\n{row.error}")
            rows.append(row)
            if on_row is not None:
                on_row(rows)
    return rows


def _run_prompt(cfg: TableConfig, row: Row, memcpy: HostMemcpy, log: Any) -> None:
    """Fresh P and D processes and a fresh pool for one prompt, all stopped by PID after.

    Fresh sides, not one pair for every prompt: Mooncake 0.3.13's dummy client never unmaps
    its shared-memory pool on close(), so each reconnect in one process would leak a staging
    buffer (up to 2 GiB here); workers connect once, as these sides now do.
    """
    from workers.pool.local_pool import LocalPool

    prompt = row.prompt
    cache_blocks = prompt.num_blocks + prompt.num_blocks // 4 + 1
    side_args = (cfg.gpu, cfg.shape, cfg.path, cfg.device_calls)
    p = Actor("prefill", Side, ("prefill", *side_args))
    d = Actor("decode", Side, ("decode", *side_args))
    try:
        for side in (p, d):
            side.send("alloc", num_blocks=cache_blocks, block_size=prompt.block_size)
        p_alloc, d_alloc = p.result(), d.result()
        log(f"{prompt.label} bs{prompt.block_size}: caches of {cache_blocks} blocks "
            f"(P {p_alloc['alloc_s']:.1f} s, D {d_alloc['alloc_s']:.1f} s)")  # fmt: skip
        log_dir = cfg.log_dir / f"bs{prompt.block_size}-{prompt.label}"
        with LocalPool(
            segment_bytes(row.moved_bytes),
            log_dir=log_dir,
            prefault=cfg.prefault,
            owner_threads=cfg.owner_threads,
        ) as pool:
            _run_passes(cfg, p, d, pool, row, cache_blocks, log)
        row.limits = p.call(
            "bulk_copy", nbytes=row.moved_bytes, reps=cfg.limit_reps, capacity=row.moved_bytes
        )
        row.limits["memcpy_gbps"] = memcpy.gbps(row.moved_bytes, cfg.limit_reps)
        log(f"  limits {row.limits}")
    finally:
        p.stop()
        d.stop()


def _run_passes(
    cfg: TableConfig, p: Actor, d: Actor, pool: Any, row: Row, cache_blocks: int, log: Any
) -> None:
    prompt = row.prompt
    n = prompt.num_blocks
    p_ids = scattered_ids(cache_blocks, n, seed=1)
    d_ids = scattered_ids(cache_blocks, n, seed=2)
    a = pool.addresses
    where = {
        "master_addr": a.master_addr,
        "metadata_url": a.metadata_url,
        "owner_addr": a.owner_addr,
        "owner_pid": str(pool.owner.pid),
    }
    slots = max(cfg.staging_slots, cfg.group_blocks)
    try:
        for side in (p, d):
            side.send("connect", pool=where, num_slots=slots, slot_bytes=row.slot_bytes)
        row.setup = {"p_" + k: v for k, v in p.result().items()}
        row.setup.update({"d_" + k: v for k, v in d.result().items()})
        warm: list[dict[str, Any]] = []
        for i in range(1 + cfg.warm_reps):
            keys = prompt.keys(f"handoff/bs{prompt.block_size}/{prompt.label}/pass{i}")
            d.call("reset", block_ids=d_ids)
            t0 = time.perf_counter()
            w = p.call("write", mode=cfg.mode, keys=keys, block_ids=p_ids, group=cfg.group_blocks)
            r = d.call(
                "read",
                mode=cfg.mode,
                keys=keys,
                block_ids=d_ids,
                source_ids=p_ids,
                group=cfg.group_blocks,
            )
            result = {**w, **r, "handoff_wall_s": time.perf_counter() - t0}
            removed = d.call("remove", keys=keys)
            assert removed == n, f"removed {removed} of {n} keys"
            name = "cold" if i == 0 else "warm"
            brief = _brief(result, row.moved_bytes)
            log(f"  {prompt.label} bs{prompt.block_size} {name}: {brief}")
            if i == 0:
                row.passes["cold"] = {**result, "reps": 1}
            else:
                warm.append(result)
        if warm:
            row.passes["warm"] = _median_pass(warm)
    finally:
        for side in (p, d):
            side.settle()
            side.call("disconnect")


def _brief(result: dict[str, Any], nbytes: int) -> str:
    parts = []
    for stage in ("d2h", "put", "get", "h2d"):
        s = max(result[f"{stage}_s"], 1e-9)
        parts.append(f"{stage} {s * 1e3:.1f} ms {nbytes / s / 1e9:.2f} GB/s")
    return ", ".join(parts) + f", exact {result['exact']}"
