"""Benchmark swap_cache_layout against bulk and per-chunk cudaMemcpyAsync on one GPU.

    python -m benchmarks.kernels.bench --output docs/benchmarks/kernels.md

Needs CuPy and an NVIDIA GPU (no Paddle); prints a note and exits 0 where there is none, so
`make bench` runs everywhere. The tables (markdown) go to stdout and, with --output, to a file.
"""

from __future__ import annotations

import argparse
import datetime
import sys

from benchmarks.kernels.cases import Bench, Workload, compute_interference, gbps
from kernels.cuda_swap import CudaLaunchConfig, import_cupy
from kernels.layout import MODE_DEVICE_TO_HOST, MODE_HOST_TO_DEVICE

KIB = 1024
DIRECTIONS = {MODE_DEVICE_TO_HOST: "D->H", MODE_HOST_TO_DEVICE: "H->D"}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kernels.bench", description=__doc__)
    parser.add_argument("--chunks-kib", type=_ints, default=[8, 16, 32, 64, 128, 256, 512, 1024],
                        help="chunk sizes (one layer's K or V of one block), KiB")  # fmt: skip
    parser.add_argument("--blocks", type=int, default=1024, help="scattered blocks moved a call")
    parser.add_argument("--layers", type=int, default=2, help="layers (2 tensors each)")
    parser.add_argument("--reps", type=int, default=11, help="timed repetitions (median)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed repetitions first")
    parser.add_argument("--sweep-ctas", type=_ints, default=[1, 2, 4, 8, 16, 132],
                        help="CTA caps tried at 8 and 64 KiB")  # fmt: skip
    parser.add_argument("--output", help="also write the markdown here")
    return parser.parse_args(argv)


KERNEL = CudaLaunchConfig(strategy="kernel")
DMA = CudaLaunchConfig(strategy="dma")
AUTO = CudaLaunchConfig()


def _main_table(bench: Bench, args: argparse.Namespace) -> list[str]:
    lines = [
        "| chunk KiB | dir | kernel GB/s | kernel x4 GB/s | auto GB/s | bulk GB/s | loop GB/s "
        "| loop graph GB/s | kernel/bulk | kernel x4/bulk | kernel/loop | loop issue ms |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for chunk_kib in args.chunks_kib:
        work = Workload(args.layers, args.blocks, chunk_kib * KIB)
        for mode, name in DIRECTIONS.items():
            plan = bench.plan(work, mode)
            loop = bench.loop_case(plan)
            ms = bench.interleaved_ms({
                "kernel": bench.swap_case(plan, KERNEL),
                "x4": bench.swap_case(plan, KERNEL, calls=4),
                "auto": bench.swap_case(plan, AUTO),
                "bulk": bench.bulk_case(work, mode),
                "loop": loop,
                "graph": bench.loop_graph_case(plan),
            })  # fmt: skip
            ms["x4"] /= 4
            rate = {case: gbps(work.moved_bytes, t) for case, t in ms.items()}
            one, four, bulk = rate["kernel"], rate["x4"], rate["bulk"]
            lines.append(
                f"| {chunk_kib} | {name} | {one:.1f} | {four:.1f} | {rate['auto']:.1f} "
                f"| {bulk:.1f} | {rate['loop']:.1f} | {rate['graph']:.1f} | {one / bulk:.2f} "
                f"| {four / bulk:.2f} | {one / max(rate['loop'], rate['graph']):.2f} "
                f"| {bench.issue_ms(loop):.1f} |"
            )
            print(lines[-1], flush=True)
    return lines


def _contiguous_table(bench: Bench, args: argparse.Namespace) -> list[str]:
    lines = [
        "| chunk KiB | dir | kernel GB/s | dma 2-D GB/s | bulk GB/s | dma/bulk |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for chunk_kib in [c for c in args.chunks_kib if c in (8, 16, 64, 256, 1024)]:
        work = Workload(args.layers, args.blocks, chunk_kib * KIB)
        for mode, name in DIRECTIONS.items():
            plan = bench.plan(work, mode, contiguous=True)
            ms = bench.interleaved_ms({
                "kernel": bench.swap_case(plan, KERNEL),
                "dma": bench.swap_case(plan, DMA),
                "bulk": bench.bulk_case(work, mode),
            })  # fmt: skip
            kernel, dma, bulk = (gbps(work.moved_bytes, ms[c]) for c in ("kernel", "dma", "bulk"))
            lines.append(f"| {chunk_kib} | {name} | {kernel:.1f} | {dma:.1f} | {bulk:.1f} "
                         f"| {dma / bulk:.2f} |")  # fmt: skip
            print(lines[-1], flush=True)
    return lines


def _sweep_table(bench: Bench, args: argparse.Namespace) -> list[str]:
    header = " | ".join(f"{c} CTAs" for c in args.sweep_ctas)
    lines = [f"| chunk KiB | dir | threads | {header} |", "|---" * (3 + len(args.sweep_ctas)) + "|"]
    for chunk_kib in (8, 64):
        work = Workload(args.layers, args.blocks, chunk_kib * KIB)
        for mode, name in DIRECTIONS.items():
            plan = bench.plan(work, mode)
            for threads in (256, 512):
                ms = bench.interleaved_ms({
                    str(c): bench.swap_case(plan, kernel_at(threads, c), calls=4)
                    for c in args.sweep_ctas
                })  # fmt: skip
                cells = [gbps(4 * work.moved_bytes, ms[str(c)]) for c in args.sweep_ctas]
                row = " | ".join(f"{x:.1f}" for x in cells)
                lines.append(f"| {chunk_kib} | {name} | {threads} | {row} |")
                print(lines[-1], flush=True)
    return lines


def kernel_at(threads: int, ctas: int) -> CudaLaunchConfig:
    return CudaLaunchConfig(strategy="kernel", threads_per_cta=threads, max_ctas=ctas)


def _host_side(bench: Bench, args: argparse.Namespace) -> list[str]:
    """cudaHostRegister'd memory (Mooncake's buffer path) and the host cost of one call."""
    import numpy as np

    from kernels.pinned_host import HostRegistration
    from kernels.swap_plan import plan_swap
    from kernels.tensor_refs import HostBuffer

    work = Workload(args.layers, args.blocks, 64 * KIB)
    lines = ["| case | dir | result |", "|---|---|---:|"]
    backing = np.full(work.moved_bytes, 0xA5, dtype=np.uint8)
    with HostRegistration(backing.ctypes.data, backing.nbytes) as reg:
        for mode, name in DIRECTIONS.items():
            plan = bench.plan(work, mode)
            plan = plan_swap(bench.layers(work), HostBuffer(reg.ptr, reg.nbytes),
                             plan.block_ids, plan.host_slots, mode)  # fmt: skip
            ms = bench.swap_ms(plan, KERNEL)
            lines.append(f"| kernel, cudaHostRegister'd numpy buffer, 64 KiB | {name} | "
                         f"{gbps(work.moved_bytes, ms):.1f} GB/s |")  # fmt: skip
    for num_layers in (args.layers, 32):
        work = Workload(num_layers, args.blocks, 16 * KIB)
        plan = bench.plan(work, MODE_DEVICE_TO_HOST)
        plan_us, call_us = bench.host_us(work, plan, KERNEL)
        label = f"{args.blocks} blocks x {2 * num_layers} tensors, 16 KiB"
        lines.append(f"| validation (plan_swap), {label} | D->H | {plan_us:.0f} us |")
        lines.append(
            f"| queueing one call behind a busy stream, {label} | D->H | {call_us:.0f} us |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    try:
        cupy = import_cupy()
        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no CUDA device")
    except Exception as exc:  # ImportError, or CUDARuntimeError without a driver
        print(f"benchmarks.kernels.bench: skipped, needs an NVIDIA GPU with CuPy ({exc})")
        return 0
    props = cupy.cuda.runtime.getDeviceProperties(0)
    device = f"{props['name'].decode()} ({props['multiProcessorCount']} SMs)"
    max_chunk = max([*args.chunks_kib, 64]) * KIB
    moved_max = Workload(args.layers, args.blocks, max_chunk)
    bench = Bench(cupy, 2 * moved_max.moved_bytes, moved_max.moved_bytes, args.reps, args.warmup)
    try:
        print(f"device: {device}", flush=True)
        main_rows = _main_table(bench, args)
        contiguous_rows = _contiguous_table(bench, args)
        sweep_rows = _sweep_table(bench, args)
        extra_rows = _host_side(bench, args)
        mm_plan = bench.plan(Workload(args.layers, args.blocks, 64 * KIB), MODE_DEVICE_TO_HOST)
        configs = [kernel_at(512, c) for c in (1, 2, 4, 8, 64)]
        interference = compute_interference(bench, mm_plan, configs)
    finally:
        bench.close()
    text = "\n".join(
        [
            "# swap_cache_layout benchmark",
            "",
            f"- device: {device}; CUDA runtime {cupy.cuda.runtime.runtimeGetVersion()}, "
            f"CuPy {cupy.__version__}",
            f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
            f"- command: `python -m benchmarks.kernels.bench {' '.join(argv or sys.argv[1:])}`",
            f"- workload: {args.blocks} scattered blocks (ids drawn from {2 * args.blocks}, slots "
            f"permuted), {args.layers} layers = {2 * args.layers} tensors, fp16, 8 KV heads x 128; "
            "chunk = one layer's K or V of one block; bytes counted once; GB/s = 1e9 B/s; median "
            f"of {args.reps} after {args.warmup} warm-ups, CUDA events",
            f"- kernel: {KERNEL.max_ctas} CTAs x {KERNEL.threads_per_cta} threads, warps walk "
            "4 KiB pieces with a grid stride, 16-byte vectors; `kernel` = one call timed alone "
            "(includes the GPU idling while the host prepares it), `kernel x4` = four calls queued "
            "back to back, per call (steady state); `auto` = the default strategy (kernel, or "
            f"2-D DMA for >= {AUTO.dma_min_chunk_bytes >> 10} KiB chunks in runs of >= "
            f"{AUTO.dma_min_run_bytes >> 20} MiB per tensor)",
            "- bulk: one cudaMemcpyAsync of the same bytes, pinned host; loop: one "
            "cudaMemcpyAsync per (tensor, block) issued from Python (GPU time; `loop issue ms` = "
            "host time to issue it), loop graph: the same copies replayed from a CUDA graph; "
            "kernel/loop uses the faster of the two; the cases of one row take turns within each "
            "repetition",
            "",
            "## Scattered blocks",
            "",
            *main_rows,
            "",
            "## One contiguous run (ids n/2 .. 3n/2-1 into slots 0 .. n-1)",
            "",
            *contiguous_rows,
            "",
            "## Launch shape (GB/s, kernel x4, scattered)",
            "",
            *sweep_rows,
            "",
            "## Registered memory and host cost",
            "",
            *extra_rows,
            "",
            "## Sharing the GPU with compute (64 KiB chunks, D->H, fp16 8192^3 matmuls)",
            "",
            "| swap | matmul TFLOP/s | swap GB/s |",
            "|---|---:|---:|",
            *[f"| {label} | {tf:.0f} | {gb:.1f} |" for label, tf, gb in interference],
            "",
        ]
    )
    print(text)
    if args.output:
        with open(args.output, "w") as handle:
            handle.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
