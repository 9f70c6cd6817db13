"""The handoff left after a chunked prefill, on a GPU: P's write beside its chunks
(ChunkedWrite, what the worker runs) against writing after the prefill, each followed by D's
read, all in one run.

    python -m benchmarks.handoff.chunked [--tokens 4096,16384] [--chunks 1024,2048]

No Paddle on the GPU host, so the prefill is a stand-in with a real GPU load: each chunk runs
float16 GEMMs on a blocking "model" stream for its share of an assumed prefill time (default
110 ms for 4096 tokens of Llama-3-8B on an H100, linear in the tokens; see
docs/benchmarks/handoff.md), writes its blocks' KV and waits for its stream, as ModelRunner.run
does. Per case, median of --reps after one warm-up rep, the time from the end of the prefill
to the end of D's read (its write part in brackets):
- serialized: write_blocks and load_blocks one group at a time, after the prefill;
- pipelined: the same with the group pipeline (workers/handoff/pipeline.py), after the prefill;
- beside: ChunkedWrite.add after each chunk (the last part after the last chunk), finish(),
  then the pipelined read;
- behind: the same writes, and D reading behind them from the prefill's start
  (workers.handoff.follow.follow_blocks, the decode worker's reader: each key read once the
  pool holds it), so that after the prefill only the last chunk is left to write and read.
A real master and pool owner (pre-faulted), P and D as two page-locked shared-memory clients
in this process, Llama-3-8B-shaped KV (32 layers, 8 KV heads, head dim 128, 2 bytes), D's
blocks in another order than P's and zeroed before each read, checked after it. --path
device: both clients hand the pool device pointers (DevicePool, as a GPU worker's
--handoff-path device). Writes its table to --output.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from benchmarks.machine import device_name, gpu_missing
from benchmarks.table_file import publish
from kernels.tensor_refs import describe_cache
from workers.handoff.follow import follow_blocks
from workers.handoff.reader import load_blocks
from workers.handoff.writer import ChunkedWrite, write_blocks
from workers.pool.client import KVPoolClient, PoolClientConfig
from workers.pool.handoff_path import choose_handoff_path
from workers.pool.keys import block_keys, model_fingerprint
from workers.pool.local_pool import LocalPool

LAYERS, KV_HEADS, HEAD_DIM = 32, 8, 128
GEMM_N = 4096


# --transfer-batch-blocks and --pool-wait-s of the workers
BOUNDS = {"group_blocks": 64, "wait_s": 60.0}


class Prefill:
    """One side's pool client and cache (what write_blocks and ChunkedWrite take), plus the
    stand-in compute."""

    def __init__(self, cp: Any, pool: Any, caches: list[Any]) -> None:
        self.cp, self.pool = cp, pool
        self.kv_caches = caches
        self.stream = cp.cuda.Stream(non_blocking=False)
        with self.stream:
            self.a = cp.ones((GEMM_N, GEMM_N), dtype=cp.float16)
        self.gemm_ms = self._gemm_ms()

    def _gemm_ms(self) -> float:
        self.chunk(40, [])
        t0 = time.perf_counter()
        self.chunk(200, [])
        return (time.perf_counter() - t0) * 1000 / 200

    def begin(self, tokens: int) -> None:
        """A new prompt of `tokens` tokens: the stand-in's chunks need nothing of it."""

    def layer_bits(self, i: int, block_ids: list[int]) -> Any:
        """Layer tensor i's blocks block_ids as CuPy uint16 (the bytes, whatever the dtype)."""
        return self.kv_caches[i][self.cp.asarray(block_ids)].view(self.cp.uint16)

    def chunk(self, num_gemms: int, block_ids: list[int]) -> None:
        """num_gemms GEMMs, then the blocks' KV written, on the model stream; returns when done."""
        with self.stream:
            for _ in range(num_gemms):
                self.a @ self.a
            if block_ids:
                index = self.cp.asarray(block_ids)
                for t in self.kv_caches:
                    t[index] = 7
        self.stream.synchronize()


@contextlib.contextmanager
def connect(
    cp: Any, pool: LocalPool, shape: tuple[int, ...], path: str, model: Any = None
) -> Iterator[Prefill]:
    """A side: a cache of shape per layer tensor and a page-locked shared-memory client,
    seen through device staging on the device path. model: a real model's prefill
    (benchmarks/handoff/chunked_model.py) instead of the stand-in, its cache instead."""
    caches = (
        model.kv_caches if model else [cp.zeros(shape, dtype=cp.uint16) for _ in range(2 * LAYERS)]
    )
    a = pool.addresses
    config = PoolClientConfig(
        master_addr=a.master_addr,
        metadata_url=a.metadata_url,
        owner_addr=a.owner_addr,
        num_slots=256,
        slot_bytes=describe_cache(caches).geometry.slot_bytes,
        page_lock=True,
        cuda_device=0,
    )
    client = KVPoolClient(config).connect()
    handoff = choose_handoff_path(path, client, 0).pool
    try:
        yield model.attach(handoff) if model else Prefill(cp, handoff, caches)
    finally:
        cp.cuda.runtime.deviceSynchronize()
        handoff.close()


def run_case(
    p: Prefill, d: Prefill, tokens: int, block: int, chunk: int, prefill_ms: float, salt: int
) -> dict:
    """One rep: ms of compute alone, then of each way's handoff left after the prefill."""
    fingerprint = model_fingerprint("bench", "bf16", LAYERS, KV_HEADS, HEAD_DIM, block)
    ids = list(range(-(-tokens // block)))
    d_ids = ids[::-1]  # D's blocks in another order than P's
    per_chunk = chunk // block
    parts = [ids[i : i + per_chunk] for i in range(0, len(ids), per_chunk)]
    gemms = max(1, round(prefill_ms * chunk / tokens / p.gemm_ms))
    p.begin(tokens)

    def keys(way: int) -> list[str]:  # fresh keys for each way and rep: nothing is skipped
        return block_keys(fingerprint, [salt * 4 + way, *range(tokens - 1)], block)

    def compute() -> float:
        for part in parts:
            p.chunk(gemms, part)
        return time.perf_counter()

    def read(k: list[str], pipelined: bool) -> None:
        out = load_blocks(d.pool, d.kv_caches, k, d_ids, pipelined=pipelined, **BOUNDS)
        assert (out.num_loaded, out.missing_keys) == (len(k), ()), out

    def check_d() -> None:  # D holds what P's chunks wrote; zeroed again for the next way
        p.cp.cuda.runtime.deviceSynchronize()
        loaded = p.cp.asarray(d_ids)
        assert all(
            bool((d.layer_bits(i, d_ids) == p.layer_bits(i, ids)).all())
            for i in range(len(d.kv_caches))
        )
        for t in d.kv_caches:
            t[loaded] = 0
        p.cp.cuda.runtime.deviceSynchronize()

    t0 = time.perf_counter()
    row = {"alone": (compute() - t0) * 1000}
    for way, pipelined in ((0, False), (1, True)):  # the write after the prefill
        k = keys(way)
        end = compute()
        write_blocks(p.pool, p.kv_caches, k, ids, pipelined=pipelined, **BOUNDS)
        row[f"write{way}"] = (time.perf_counter() - end) * 1000
        read(k, pipelined)
        row[f"handoff{way}"] = (time.perf_counter() - end) * 1000
        check_d()

    async def beside(k: list[str], behind: bool) -> float:
        stop = threading.Event()
        follow = asyncio.ensure_future(asyncio.to_thread(
            follow_blocks, d.pool, d.kv_caches, k, d_ids, poll_s=0.001, stop=stop,
            deadline_s=time.monotonic() + 120, **BOUNDS
        )) if behind else None  # fmt: skip
        writer = ChunkedWrite(p.pool, p.kv_caches, k, **BOUNDS)
        try:
            for n, part in enumerate(parts):
                await asyncio.to_thread(p.chunk, gemms, part)
                writer.add(n * per_chunk, part)
            end = time.perf_counter()
            await writer.finish()
            row[f"write{2 + behind}"] = (time.perf_counter() - end) * 1000
            if follow is not None:
                assert (await follow).num_loaded == len(k)
        finally:
            stop.set()
        return end

    for way, behind in ((2, False), (3, True)):
        k = keys(way)
        t0 = time.perf_counter()
        end = asyncio.run(beside(k, behind))
        row["compute" if behind else "compute_beside"] = (end - t0) * 1000
        if not behind:
            read(k, True)
        row[f"handoff{way}"] = (time.perf_counter() - end) * 1000
        check_d()
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="4096,16384")
    ap.add_argument("--chunks", default="1024,2048")
    ap.add_argument("--block-sizes", default="16")
    ap.add_argument("--paths", default="device,host", help="device and/or host, comma-separated")
    ap.add_argument("--prefill-ms-4k", type=float, default=110.0)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--group-blocks", type=int, default=64, help="--transfer-batch-blocks")
    ap.add_argument("--owner-threads", type=int, default=8, help="pdworker pool --threads")
    ap.add_argument(
        "--model",
        default="",
        help="a checkpoint folder: its real prefill (torch runner, bf16) instead of the GEMM "
        "stand-in (benchmarks/handoff/chunked_model.py)",
    )
    ap.add_argument("--output", default="")
    args = ap.parse_args(argv)
    if why := gpu_missing():
        print(f"benchmarks.handoff.chunked: skipped, needs an NVIDIA GPU with CuPy ({why})")
        return 0
    from kernels.cuda_swap import import_cupy

    cp = import_cupy()
    tokens = [int(x) for x in args.tokens.split(",")]
    blocks = [int(x) for x in args.block_sizes.split(",")]
    chunks = [int(x) for x in args.chunks.split(",")]
    paths = [x for x in args.paths.split(",") if x]
    max_blocks = max(tokens) // min(blocks)
    rows = []
    BOUNDS["group_blocks"] = args.group_blocks
    # One pool per (path, block, chunk), sized for that case alone: every way of every rep
    # writes fresh keys (D's read leases keep them a while), all within the 85% of the segment
    # the owner pre-faults (a put into the rest would measure first-touch page faults, not the
    # handoff). One pool for every pair at once asked for 192 GiB with two of each.
    kv_bytes = sum(tokens) * LAYERS * 2 * KV_HEADS * HEAD_DIM * 2
    size_bytes = pool_bytes(kv_bytes, args.reps)
    for path, block, chunk in [(p, b, c) for p in paths for b in blocks for c in chunks]:
        shape = (max_blocks * min(blocks) // block, KV_HEADS, block, HEAD_DIM)
        model = None
        if args.model:  # the model's module imports this one: only when asked for
            from benchmarks.handoff.chunked_model import model_prefill

            model = model_prefill(cp, args.model, shape[0], block)
        with (
            LocalPool(size_bytes, owner_threads=args.owner_threads) as pool,
            connect(cp, pool, shape, path, model) as p,
            connect(cp, pool, shape, path) as d,
        ):
            salt = 1000 * len(rows)
            for n in tokens:
                prefill_ms = 0.0 if model else args.prefill_ms_4k * n / 4096
                reps = []
                for _ in range(args.reps + 1):  # the first warms D's staging
                    salt += 1
                    reps.append(run_case(p, d, n, block, chunk, prefill_ms, salt))
                med = {k: statistics.median(r[k] for r in reps[1:]) for k in reps[0]}
                rows.append((path, n, block, chunk, prefill_ms, med))
                print(path, n, block, chunk, med, flush=True)
            gemm_ms = p.gemm_ms
    device = device_name(True)
    head = (f"Generated by `python -m benchmarks.handoff.chunked {' '.join(argv or sys.argv[1:])}`"
            f" on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; device {device}; "
            + (f"the prefill is {args.model}'s, torch runner, bf16." if args.model else
               f"one {GEMM_N}^3 float16 GEMM = {gemm_ms:.3f} ms."))  # fmt: skip
    publish(args.output, head + "\n\n" + "\n".join(render(rows)) + "\n")
    return 0


def pool_bytes(kv_bytes: int, reps: int) -> int:
    """The segment for one (path, block, chunk) case: four ways, reps + 1 runs of each, every
    prompt length once, and room for the owner's headroom (1.6x)."""
    return int(4 * (reps + 1) * kv_bytes * 1.6)


def render(rows: list[tuple]) -> list[str]:
    """The table: per path and case, each way's ms after the prefill (write + read)."""
    table = [
        "| path | prompt | block | chunk | MiB | assumed prefill ms | compute alone ms | "
        "compute beside the writes ms | serialized: write + read ms | pipelined, write after "
        "the prefill: write + read ms | write beside + read after ms | write beside + read "
        "behind ms | left after the prefill: beside / behind, % of prefill |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---|---|---|---|",
    ]
    for path, n, block, chunk, prefill_ms, m in rows:
        mib = n * LAYERS * 2 * KV_HEADS * HEAD_DIM * 2 / 2**20
        cells = []
        for way in range(4):
            total, write = m[f"handoff{way}"], m[f"write{way}"]
            cells.append(f"{total:.1f} ({write:.1f} + {total - write:.1f})")
        left = " / ".join(f"{100 * m[f'handoff{w}'] / m['alone']:.1f}%" for w in (2, 3))
        table.append(
            f"| {path} | {n} | {block} | {chunk} | {mib:.0f} | {prefill_ms:.0f} | "
            f"{m['alone']:.1f} | {m['compute']:.1f} | {' | '.join(cells)} | {left} |"
        )
    return table


if __name__ == "__main__":
    sys.exit(main())
