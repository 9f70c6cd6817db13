"""A 4K-token prefix on a GPU three ways: a host-tier hit, a pool hit and a recompute.

    python -m benchmarks.cache.host_tier_gpu [--tokens 4096] [--reps 5] [--output FILE]

Llama-3-8B-shaped KV (32 layers, 8 KV heads, head dim 128, 2 bytes, block size 16: 2 MiB a
block, 512 MiB for 4096 tokens) in CuPy caches, as the handoff's GPU tests hold it:
- host hit: HostTier.read (workers/engine/host_tier.py), the engine's swap-in, from the
  page-locked host buffer open_host_storage gives a GPU engine, into the request's blocks
  (in another order than they were written from); the copy that filled the tier (its
  write policy's D2H) is timed too;
- pool hit: workers.handoff.reader.load_blocks from a real master and pool owner through a
  page-locked shared-memory client (the P worker's pool prefix read), after P wrote them;
- recompute: benchmarks.handoff.chunked's stand-in prefill (float16 GEMMs on a blocking
  stream for --prefill-ms-4k, default 110 ms for 4096 tokens of Llama-3-8B on an H100, then
  the blocks' KV written), since the GPU host has no Paddle.
Median of --reps after a warm-up rep; every copy checked byte for byte.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from benchmarks.handoff.chunked import BOUNDS, KV_HEADS, LAYERS, connect
from benchmarks.machine import device_name, gpu_missing
from benchmarks.table_file import publish
from workers.engine.host_policy import HostTierConfig
from workers.engine.host_storage import open_host_storage
from workers.engine.host_tier import HostTier
from workers.handoff.reader import load_blocks
from workers.handoff.writer import write_blocks
from workers.pool.keys import block_keys, model_fingerprint
from workers.pool.local_pool import LocalPool

BLOCK = 16


def one_rep(cp, p, d, tier: HostTier, tokens: int, gemms: int, salt: int) -> dict[str, float]:
    ids = list(range(tokens // BLOCK))
    d_ids = ids[::-1]
    fingerprint = model_fingerprint("bench", "bf16", LAYERS, KV_HEADS, 128, BLOCK)
    keys = block_keys(fingerprint, [salt, *range(tokens - 1)], BLOCK)
    row: dict[str, float] = {}

    def clear_and_check(value: int) -> None:
        cp.cuda.runtime.deviceSynchronize()
        index = cp.asarray(d_ids)
        assert all(bool((t[index] == value).all()) for t in d.kv_caches), "bytes differ"
        for t in d.kv_caches:
            t[index] = 0
        cp.cuda.runtime.deviceSynchronize()

    t0 = time.perf_counter()
    p.chunk(gemms, ids)  # the stand-in prefill, its blocks' KV written (7)
    row["recompute"] = (time.perf_counter() - t0) * 1000
    # pool hit: P put them, D reads them into its blocks
    write_blocks(p.pool, p.kv_caches, keys, ids, **BOUNDS)
    t0 = time.perf_counter()
    out = load_blocks(d.pool, d.kv_caches, keys, d_ids, **BOUNDS)
    row["pool"] = (time.perf_counter() - t0) * 1000
    assert out.num_loaded == len(ids), out
    clear_and_check(7)
    # host hit: D's blocks (written 9) copied to its host tier, then swapped into d_ids
    index = cp.asarray(ids)
    for t in d.kv_caches:
        t[index] = 9
    cp.cuda.runtime.deviceSynchronize()
    hashes = [f"{salt}:{k}" for k in keys[: len(ids)]]
    t0 = time.perf_counter()
    tier.on_registered(zip(ids, hashes, strict=True))
    tier.flush()
    row["host_write"] = (time.perf_counter() - t0) * 1000
    for t in d.kv_caches:
        t[index] = 0
    cp.cuda.runtime.deviceSynchronize()
    t0 = time.perf_counter()
    tier.read(hashes, d_ids)
    row["host"] = (time.perf_counter() - t0) * 1000
    clear_and_check(9)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prefill-ms-4k", type=float, default=110.0)
    ap.add_argument("--output", default="")
    args = ap.parse_args(argv)
    if why := gpu_missing():
        print(f"benchmarks.cache.host_tier_gpu: skipped, needs an NVIDIA GPU with CuPy ({why})")
        return 0
    from kernels.cuda_swap import import_cupy

    cp = import_cupy()
    num_blocks = args.tokens // BLOCK
    shape = (num_blocks, KV_HEADS, BLOCK, 128)
    block_bytes = LAYERS * 2 * KV_HEADS * BLOCK * 128 * 2
    pool_bytes = int(block_bytes * num_blocks * (args.reps + 1) * 1.6)
    with (
        LocalPool(pool_bytes, owner_threads=8) as pool,
        connect(cp, pool, shape, "host") as p,
        connect(cp, pool, shape, "host") as d,
    ):
        storage = open_host_storage(d.kv_caches, num_blocks * block_bytes / 2**30)
        assert storage is not None and storage.num_slots == num_blocks
        tier = HostTier(HostTierConfig(num_blocks, "write_through"), storage.copier)
        prefill_ms = args.prefill_ms_4k * args.tokens / 4096
        gemms = max(1, round(prefill_ms / p.gemm_ms))
        reps = [one_rep(cp, p, d, tier, args.tokens, gemms, s) for s in range(args.reps + 1)]
        storage.close()
    med = {k: statistics.median(r[k] for r in reps[1:]) for k in reps[0]}
    print(med, flush=True)
    mib = num_blocks * block_bytes / 2**20
    head = (f"Generated by `python -m benchmarks.cache.host_tier_gpu "
            f"{' '.join(argv if argv is not None else sys.argv[1:])}` on "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; device {device_name(True)}; "
            f"{args.tokens} tokens, {mib:.0f} MiB of Llama-3-8B-shaped KV; median of "
            f"{args.reps} reps.")  # fmt: skip
    rows = ["| way | ms | GB/s | x faster than recompute |", "|---|---:|---:|---:|"]
    labels = {"recompute": "recompute (stand-in prefill)", "pool": "pool hit",
              "host": "host-tier hit (swap-in)",
              "host_write": "host-tier write (D2H, at the end of a step)"}  # fmt: skip
    for way, label in labels.items():
        ms = med[way]
        rate = "" if way == "recompute" else f"{mib / 1024 / (ms / 1000):.1f}"
        rows.append(f"| {label} | {ms:.1f} | {rate} | {med['recompute'] / ms:.1f} |")
    publish(args.output, head + "\n\n" + "\n".join(rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
