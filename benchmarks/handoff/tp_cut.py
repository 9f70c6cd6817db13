"""The cut of a reader's heads out of a larger shard (a 1-rank P -> a 2-rank D), on the GPU:
which way to copy, and its section of docs/benchmarks/handoff.md (`python -m
benchmarks.handoff.tp --reader-tp 2` runs both).

Two ways to put rank r's 4 of the 8 heads of each staged block into its paged cache:

    kernel   swap_cache_layout with host_heads: the SMs read only the rank's heads out of
             each page-locked slot (one launch, half the bytes of a whole block cross PCIe)
    bounce   the whole slots into a GPU scratch cache of 8 heads (the plain kernel), then a
             strided copy of heads [4, 8) of each scratch block into the cache (per layer)

beside the plain whole-block copy of a 1-rank reader. Timed on the copy alone (no pool):
the median of 5 after a warm-up, the result checked equal between the two ways.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from benchmarks.handoff.kv import LLAMA3_8B, scattered_ids

CUT_SECTION = "handoff-tp-cut"
CUT_PROSE = """## Tensor parallel: a 1-rank P -> a 2-rank D (the head cut)

Llama-3-8B's KV shape, block size 16, host staging (page-locked), one pool owner. P of TP
size 1 writes each block whole (`h0-8of8`); D of TP size 2, two processes holding heads
[0, 4) and [4, 8), each reads the whole object into a staging slot and copies only its heads
into its cache (`swap_cache_layout(..., host_heads=HostHeads(4r, 8))`, kernels/layout.py),
both ranks at once. The baseline: a 1-rank D reading the same blocks. Every byte each rank
holds is checked against the heads of the whole cache P wrote. Rep 0 is cold."""
ROUTES_PROSE = """Which copy (`benchmarks/handoff/tp_cut.py`, the copy alone, no pool, median of 5):
the kernel reads only the rank's heads out of each page-locked slot; the bounce moves whole
slots into a GPU scratch cache and then copies the heads with a strided copy per layer."""
ROUTES_HEADER = (
    "| tokens | blocks | plain whole block ms | kernel cut ms | bounce ms | "
    "kernel / plain | bounce / kernel | equal |\n" + "|---" * 8 + "|"
)


def _median_ms(cp: Any, run: Any) -> float:
    run()  # warm-up (compilation, first touch)
    cp.cuda.Device().synchronize()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        run()
        cp.cuda.Device().synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def cut_routes(tokens_list: list[int], block_size: int) -> list[str]:
    """One row per prompt length: plain, kernel cut and bounce times (GPU 0)."""
    from kernels.cuda_swap import import_cupy

    cp = import_cupy()
    rows = []
    for tokens in tokens_list:
        rows.append(_one_length(cp, tokens, block_size))
        print(rows[-1], flush=True)
    return rows


def _one_length(cp: Any, tokens: int, block_size: int) -> str:
    from kernels import MODE_HOST_TO_DEVICE, HostHeads, swap_cache_layout
    from kernels.pinned_host import PinnedHostBuffer

    s, n = LLAMA3_8B, tokens // block_size
    shape = (n, s.num_kv_heads, block_size, s.head_dim)
    pinned = PinnedHostBuffer(n * s.slot_bytes(block_size))
    try:
        pinned.as_array()[...] = cp.asnumpy(cp.random.default_rng(tokens).integers(
            0, 256, pinned.nbytes, dtype=cp.uint8))  # fmt: skip
        host, slots = pinned.buffer, list(range(n))
        ids = scattered_ids(n, n, seed=tokens)
        whole = [cp.empty(shape, cp.uint16) for _ in range(s.num_tensors)]
        half = [cp.empty((n, 4, block_size, s.head_dim), cp.uint16) for _ in whole]
        bounced = [cp.empty_like(t) for t in half]
        scratch = [cp.empty(shape, cp.uint16) for _ in whole]
        order = cp.asarray(ids)

        def plain() -> None:
            swap_cache_layout(whole, host, ids, slots, MODE_HOST_TO_DEVICE)

        def kernel() -> None:
            swap_cache_layout(half, host, ids, slots, MODE_HOST_TO_DEVICE,
                              host_heads=HostHeads(4, 8))  # fmt: skip

        def bounce() -> None:
            swap_cache_layout(scratch, host, slots, slots, MODE_HOST_TO_DEVICE)
            for dst, src in zip(bounced, scratch, strict=True):
                dst[order] = src[:, 4:8]

        times = [_median_ms(cp, f) for f in (plain, kernel, bounce)]
        equal = all(bool(cp.array_equal(a, b)) for a, b in zip(half, bounced, strict=True))
    finally:
        cp.cuda.Device().synchronize()
        pinned.close()
    return (
        f"| {tokens} | {n} | {times[0]:.1f} | {times[1]:.1f} | {times[2]:.1f} | "
        f"{times[1] / times[0]:.2f} | {times[2] / times[1]:.2f} | {'yes' if equal else 'NO'} |"
    )


def render_cut(
    lines: list[str], routes: list[str], header: str, when: str, device: str, command: str
) -> str:
    text = f"{CUT_PROSE}\n\n{when}, {device}: `{command}`\n\n{header}\n" + "\n".join(lines)
    if routes:
        text += f"\n\n{ROUTES_PROSE}\n\n{ROUTES_HEADER}\n" + "\n".join(routes)
    return text
