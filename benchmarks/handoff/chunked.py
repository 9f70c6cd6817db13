"""P's write beside its chunked prefill, on a GPU: how much of the write is left after the
prefill's last chunk, with ChunkedWrite (the worker's writer) against writing after it.

    python -m benchmarks.handoff.chunked [--tokens 4096,16384] [--chunks 1024,2048]

No Paddle on the GPU host, so the prefill is a stand-in with a real GPU load: each chunk runs
float16 GEMMs on a blocking "model" stream for its share of an assumed prefill time (default
110 ms for 4096 tokens of Llama-3-8B on an H100, linear in the tokens; see
docs/benchmarks/handoff.md), writes its blocks' KV (random bytes) and waits for its stream, as
ModelRunner.run does. Then, per case, median of --reps:
- compute alone: the chunks, nothing else;
- write after: the chunks, then write_blocks of every block (the write the worker did before);
- beside: ChunkedWrite.add after each chunk, the last part after the last chunk, finish().
"exposed" = from the end of the last chunk to the end of the write. A real master and pool
owner (pre-faulted), one page-locked shared-memory client, Llama-3-8B-shaped KV (32 layers,
8 KV heads, head dim 128, 2 bytes). Appends its table to --output.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kernels.tensor_refs import describe_cache
from workers.pool.client import KVPoolClient, PoolClientConfig
from workers.pool.keys import block_keys, model_fingerprint
from workers.pool.local_pool import LocalPool
from workers.prefill.handoff_writer import ChunkedWrite, write_blocks

LAYERS, KV_HEADS, HEAD_DIM = 32, 8, 128
GEMM_N = 4096


@dataclass(frozen=True)
class Settings:
    transfer_batch_blocks: int = 64
    wait_s: float = 60.0


class Prefill:
    """What write_blocks and ChunkedWrite read of PDContext, plus the stand-in compute."""

    def __init__(self, cp: Any, pool: KVPoolClient, caches: list[Any]) -> None:
        self.cp, self.pool, self.settings = cp, pool, Settings()
        self.engine = type("Engine", (), {"kv_caches": caches})()
        self.stream = cp.cuda.Stream(non_blocking=False)
        with self.stream:
            self.a = cp.ones((GEMM_N, GEMM_N), dtype=cp.float16)
        self.gemm_ms = self._gemm_ms()

    def require_pool(self) -> KVPoolClient:
        return self.pool

    def wait_for_slots(self, num_slots: int, deadline_s: float) -> list[int]:
        while (slots := self.pool.slots.allocate(num_slots)) is None:
            if time.monotonic() > deadline_s:
                raise TimeoutError(f"no {num_slots} free staging slots")
            time.sleep(0.001)
        return slots

    def _gemm_ms(self) -> float:
        self.chunk(40, [])
        t0 = time.perf_counter()
        self.chunk(200, [])
        return (time.perf_counter() - t0) * 1000 / 200

    def chunk(self, num_gemms: int, block_ids: list[int]) -> None:
        """num_gemms GEMMs, then the blocks' KV written, on the model stream; returns when done."""
        with self.stream:
            for _ in range(num_gemms):
                self.a @ self.a
            if block_ids:
                index = self.cp.asarray(block_ids)
                for t in self.engine.kv_caches:
                    t[index] = 7
        self.stream.synchronize()


def run_case(p: Prefill, tokens: int, block: int, chunk: int, prefill_ms: float) -> dict:
    keys = block_keys(model_fingerprint("bench", "bf16", LAYERS, KV_HEADS, HEAD_DIM, block),
                      list(range(tokens)), block)  # fmt: skip
    ids = list(range(len(keys)))
    per_chunk = chunk // block
    parts = [ids[i : i + per_chunk] for i in range(0, len(ids), per_chunk)]
    gemms = max(1, round(prefill_ms * chunk / tokens / p.gemm_ms))

    def compute() -> float:
        for part in parts:
            p.chunk(gemms, part)
        return time.perf_counter()

    t0 = time.perf_counter()
    alone_end = compute()
    alone_ms = (alone_end - t0) * 1000
    times = dict.fromkeys(("d2h_s", "put_s"), 0.0)
    end = compute()
    write_blocks(p, keys, ids, times)
    after_ms = (time.perf_counter() - end) * 1000
    assert p.pool.remove(keys).ok

    async def beside() -> tuple[float, float]:
        writer = ChunkedWrite(p, keys)
        t_start = time.perf_counter()
        for k, part in enumerate(parts):
            await asyncio.to_thread(p.chunk, gemms, part)
            writer.add(k * per_chunk, part)
        t_end = time.perf_counter()
        await writer.finish()
        return (t_end - t_start) * 1000, (time.perf_counter() - t_end) * 1000

    compute_ms, exposed_ms = asyncio.run(beside())
    assert p.pool.remove(keys).ok
    return {"alone": alone_ms, "compute": compute_ms, "after": after_ms, "exposed": exposed_ms}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="4096,16384")
    ap.add_argument("--chunks", default="1024,2048")
    ap.add_argument("--block-sizes", default="16")
    ap.add_argument("--prefill-ms-4k", type=float, default=110.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--output", default="")
    args = ap.parse_args(argv)
    import cupy as cp

    tokens = [int(x) for x in args.tokens.split(",")]
    blocks = [int(x) for x in args.block_sizes.split(",")]
    max_blocks = max(tokens) // min(blocks)
    rows = []
    with LocalPool(3 * max(tokens) * LAYERS * KV_HEADS * HEAD_DIM * 4) as pool:
        for block in blocks:
            shape = (max_blocks * min(blocks) // block, KV_HEADS, block, HEAD_DIM)
            caches = [cp.zeros(shape, dtype=cp.uint16) for _ in range(2 * LAYERS)]
            cache = describe_cache(caches)
            a = pool.addresses
            config = PoolClientConfig(
                master_addr=a.master_addr,
                metadata_url=a.metadata_url,
                owner_addr=a.owner_addr,
                num_slots=256,
                slot_bytes=cache.geometry.slot_bytes,
                page_lock=True,
            )
            with KVPoolClient(config) as client:
                p = Prefill(cp, client, caches)
                for n in tokens:
                    prefill_ms = args.prefill_ms_4k * n / 4096
                    for chunk in (int(x) for x in args.chunks.split(",")):
                        reps = [run_case(p, n, block, chunk, prefill_ms) for _ in range(args.reps)]
                        med = {k: statistics.median(r[k] for r in reps) for k in reps[0]}
                        rows.append((n, block, chunk, prefill_ms, med))
                        print(n, block, chunk, med, flush=True)
    table = [
        "| prompt | block | chunk | MiB | assumed prefill ms | compute alone ms | compute beside "
        "the write ms | write after the prefill ms (exposed) | exposed beside ms | exposed, "
        "% of prefill |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n, block, chunk, prefill_ms, m in rows:
        mib = n * LAYERS * 2 * KV_HEADS * HEAD_DIM * 2 / 2**20
        table.append(
            f"| {n} | {block} | {chunk} | {mib:.0f} | {prefill_ms:.0f} | {m['alone']:.1f} | "
            f"{m['compute']:.1f} | {m['after']:.1f} | {m['exposed']:.1f} | "
            f"{100 * m['exposed'] / m['alone']:.1f}% |"
        )
    device = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    head = (f"Generated by `python -m benchmarks.handoff.chunked {' '.join(argv or sys.argv[1:])}`"
            f" on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; device {device}; "
            f"one {GEMM_N}^3 float16 GEMM = {p.gemm_ms:.3f} ms.")  # fmt: skip
    text = head + "\n\n" + "\n".join(table) + "\n"
    print(text)
    if args.output:
        Path(args.output).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
