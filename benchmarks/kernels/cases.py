"""Measurements behind `python -m benchmarks.kernels.bench`, each timed with CUDA events on one
stream (median of several repetitions after warm-ups). Needs CuPy and a GPU; no Paddle.

Every case moves the same bytes three ways so the numbers compare within one run:
- kernel: one swap_cache_layout launch (SMs read/write mapped pinned host memory);
- bulk:   one cudaMemcpyAsync of the same byte count between contiguous buffers (the ceiling);
- loop:   one cudaMemcpyAsync per (layer tensor, block) chunk, as FastDeploy's op does, issued
          eagerly and, separately, replayed from a CUDA graph (no Python cost per copy).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import numpy as np

from kernels.cuda_swap import CudaLaunchConfig, swap_on_cuda
from kernels.layout import MODE_DEVICE_TO_HOST, MODE_HOST_TO_DEVICE
from kernels.swap_plan import SwapPlan, plan_swap
from kernels.tensor_refs import HostBuffer

NUM_KV_HEADS, HEAD_DIM, ELEM_BYTES = 8, 128, 2  # fp16 K or V: 2 KiB per token and head group
_KIND = {MODE_DEVICE_TO_HOST: 2, MODE_HOST_TO_DEVICE: 1}  # cudaMemcpyDeviceToHost / HostToDevice


@dataclass(frozen=True)
class Workload:
    """One benchmark geometry: `num_moved` scattered blocks of `chunk_bytes` per layer tensor."""

    num_layers: int
    num_moved: int
    chunk_bytes: int

    @property
    def block_size(self) -> int:
        return self.chunk_bytes // (NUM_KV_HEADS * HEAD_DIM * ELEM_BYTES)

    @property
    def num_cache_blocks(self) -> int:
        return 2 * self.num_moved  # ids drawn from twice as many blocks: scattered, not a run

    @property
    def moved_bytes(self) -> int:
        return self.num_moved * 2 * self.num_layers * self.chunk_bytes


class Bench:
    """Holds the device pool, the pinned host buffer and the stream shared by every case."""

    def __init__(
        self, cupy: ModuleType, device_bytes: int, host_bytes: int, reps: int, warmup: int
    ) -> None:
        from kernels.pinned_host import PinnedHostBuffer

        self.cp = cupy
        self.reps, self.warmup = reps, warmup
        self.stream = cupy.cuda.Stream(non_blocking=True)
        with self.stream:
            # Varied bytes, never zeros: zeros can hide unwritten output and run faster.
            words = cupy.arange(device_bytes // 4, dtype=cupy.uint32)
            words *= np.uint32(2654435761)  # Knuth's multiplicative hash
        self.pool = words.view(cupy.uint8)
        self.host = PinnedHostBuffer(host_bytes)
        self.host.as_array()[...] = 0xA5
        self.stream.synchronize()

    def close(self) -> None:
        self.stream.synchronize()
        self.host.close()

    def layers(self, work: Workload) -> list:
        tensor_bytes = work.num_cache_blocks * work.chunk_bytes
        shape = (work.num_cache_blocks, NUM_KV_HEADS, work.block_size, HEAD_DIM)
        assert 2 * work.num_layers * tensor_bytes <= self.pool.nbytes, "device pool too small"
        return [
            self.pool[j * tensor_bytes : (j + 1) * tensor_bytes]
            .view(self.cp.float16)
            .reshape(shape)
            for j in range(2 * work.num_layers)
        ]

    def plan(self, work: Workload, mode: int, contiguous: bool = False) -> SwapPlan:
        """Scattered ids and permuted slots, or one run (ids from the middle, slots 0..n-1)."""
        rng = np.random.default_rng(0)
        if contiguous:
            ids = np.arange(work.num_moved) + work.num_moved // 2
            slots = np.arange(work.num_moved)
        else:
            ids = rng.choice(work.num_cache_blocks, size=work.num_moved, replace=False)
            slots = rng.permutation(work.num_moved)
        host = HostBuffer(self.host.ptr, work.num_moved * 2 * work.num_layers * work.chunk_bytes)
        return plan_swap(self.layers(work), host, ids, slots, mode)

    def _time_ms(self, enqueue: Callable[[], object]) -> float:
        cp = self.cp
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(self.stream)
        enqueue()
        end.record(self.stream)
        end.synchronize()
        return cp.cuda.get_elapsed_time(start, end)

    def interleaved_ms(self, cases: dict[str, Callable[[], object]]) -> dict[str, float]:
        """Median ms of each case, the cases taking turns within every repetition: a
        disturbance of a few seconds (another tenant, a clock change) then lands on all of
        them instead of on one case's whole sample."""
        for _ in range(self.warmup):
            for enqueue in cases.values():
                self._time_ms(enqueue)
        samples: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(self.reps):
            for name, enqueue in cases.items():
                samples[name].append(self._time_ms(enqueue))
        return {name: statistics.median(times) for name, times in samples.items()}

    def median_ms(self, enqueue: Callable[[], object]) -> float:
        return self.interleaved_ms({"only": enqueue})["only"]

    def swap_case(self, plan: SwapPlan, config: CudaLaunchConfig, calls: int = 1) -> Callable:
        """`calls` calls queued back to back (time it, then divide by calls): the host cost
        of each call overlaps the GPU work of the one before, the steady state of a worker."""

        def enqueue() -> None:
            for _ in range(calls):
                swap_on_cuda(plan, self.stream, config)

        return enqueue

    def swap_ms(self, plan: SwapPlan, config: CudaLaunchConfig, calls: int = 1) -> float:
        return self.median_ms(self.swap_case(plan, config, calls)) / calls

    def bulk_case(self, work: Workload, mode: int) -> Callable:
        """One cudaMemcpyAsync of the same byte count between contiguous buffers."""
        dev, host = self.pool.data.ptr, self.host.ptr
        dst, src = (host, dev) if mode == MODE_DEVICE_TO_HOST else (dev, host)
        memcpy, stream = self.cp.cuda.runtime.memcpyAsync, self.stream.ptr
        return lambda: memcpy(dst, src, work.moved_bytes, _KIND[mode], stream)

    def _loop_copies(self, plan: SwapPlan) -> list[tuple[int, int]]:
        chunk, num_tensors = plan.geometry.chunk_bytes, plan.geometry.num_tensors
        pairs = []
        for block, slot in zip(plan.block_ids.tolist(), plan.host_slots.tolist(), strict=True):
            for j, tensor in enumerate(plan.cache.tensors):
                dev = tensor.ptr + block * chunk
                host = plan.host.ptr + (slot * num_tensors + j) * chunk
                pairs.append((host, dev) if plan.mode == MODE_DEVICE_TO_HOST else (dev, host))
        return pairs

    def loop_case(self, plan: SwapPlan) -> Callable:
        """One cudaMemcpyAsync per (tensor, block) chunk, issued from Python."""
        pairs, chunk = self._loop_copies(plan), plan.geometry.chunk_bytes
        memcpy, kind, stream = self.cp.cuda.runtime.memcpyAsync, _KIND[plan.mode], self.stream.ptr

        def enqueue() -> None:
            for dst, src in pairs:
                memcpy(dst, src, chunk, kind, stream)

        return enqueue

    def loop_graph_case(self, plan: SwapPlan) -> Callable:
        """The same per-chunk copies captured once into a CUDA graph and replayed."""
        pairs, chunk = self._loop_copies(plan), plan.geometry.chunk_bytes
        memcpy, kind = self.cp.cuda.runtime.memcpyAsync, _KIND[plan.mode]
        capture = self.cp.cuda.Stream(non_blocking=True)
        capture.begin_capture()
        for dst, src in pairs:
            memcpy(dst, src, chunk, kind, capture.ptr)
        graph = capture.end_capture()
        graph.upload(self.stream)
        return lambda: graph.launch(self.stream)

    def issue_ms(self, enqueue: Callable[[], object]) -> float:
        """Host time to issue one enqueue (the GPU may still be busy afterwards)."""
        begin = time.perf_counter()
        enqueue()
        elapsed = (time.perf_counter() - begin) * 1e3
        self.stream.synchronize()
        return elapsed

    def host_us(
        self, work: Workload, plan: SwapPlan, config: CudaLaunchConfig
    ) -> tuple[float, float]:
        """Host time of validation (plan_swap) and of queueing one call while the stream still
        runs earlier work: a call that waited for the stream would show milliseconds here."""
        tensors = self.layers(work)
        host = HostBuffer(plan.host.ptr, plan.host.nbytes)
        plan_us, call_us = [], []
        for _ in range(self.warmup + self.reps):
            begin = time.perf_counter()
            plan_swap(tensors, host, plan.block_ids, plan.host_slots, plan.mode)
            plan_us.append((time.perf_counter() - begin) * 1e6)
            for _ in range(3):
                swap_on_cuda(plan, self.stream, config)  # keep the stream busy for a while
            begin = time.perf_counter()
            swap_on_cuda(plan, self.stream, config)
            call_us.append((time.perf_counter() - begin) * 1e6)
            self.stream.synchronize()
        return statistics.median(plan_us[self.warmup :]), statistics.median(call_us[self.warmup :])


def gbps(num_bytes: int, ms: float) -> float:
    return num_bytes / (ms * 1e-3) / 1e9


def compute_interference(
    bench: Bench, plan: SwapPlan, configs: list[CudaLaunchConfig], matmul_n: int = 8192
) -> list[tuple[str, float, float]]:
    """(label, matmul TFLOP/s, swap GB/s) with fp16 matmuls and swaps on two streams at once:
    the swap kernel takes SMs from compute, a DMA copy does not."""
    cp, num_matmuls = bench.cp, 24
    compute = cp.cuda.Stream(non_blocking=True)
    with compute:
        a = cp.random.random((matmul_n, matmul_n), dtype=cp.float32).astype(cp.float16)
        b = cp.random.random((matmul_n, matmul_n), dtype=cp.float32).astype(cp.float16)
        c = cp.empty_like(a)
    flops = 2.0 * matmul_n**3 * num_matmuls

    def matmuls() -> None:
        with compute:
            for _ in range(num_matmuls):
                cp.matmul(a, b, out=c)

    def run(swap: Callable[[], object] | None, num_swaps: int) -> tuple[float, float]:
        events = [cp.cuda.Event() for _ in range(4)]
        events[0].record(compute)
        events[2].record(bench.stream)
        matmuls()
        for _ in range(num_swaps if swap else 0):
            swap()
        events[1].record(compute)
        events[3].record(bench.stream)
        events[1].synchronize()
        events[3].synchronize()
        return (
            cp.cuda.get_elapsed_time(events[0], events[1]),
            cp.cuda.get_elapsed_time(events[2], events[3]),
        )

    run(None, 0)  # warm-up: cuBLAS handle and heuristics
    alone_ms = statistics.median(run(None, 0)[0] for _ in range(3))
    rows = [("matmuls alone", flops / alone_ms / 1e9, 0.0)]
    work_bytes = plan.num_bytes
    swaps = [(f"kernel, {cfg.max_ctas} CTAs x {cfg.threads_per_cta}", cfg) for cfg in configs]
    for label, cfg in [*swaps, ("bulk cudaMemcpyAsync", None)]:
        if cfg is None:
            dev, host = bench.pool.data.ptr, bench.host.ptr
            dst, src = (host, dev) if plan.mode == MODE_DEVICE_TO_HOST else (dev, host)

            def swap(dst: int = dst, src: int = src) -> None:
                bench.cp.cuda.runtime.memcpyAsync(
                    dst, src, work_bytes, _KIND[plan.mode], bench.stream.ptr
                )
        else:

            def swap(cfg: CudaLaunchConfig = cfg) -> None:
                swap_on_cuda(plan, bench.stream, cfg)

        one_ms = bench.median_ms(swap)
        num_swaps = max(1, round(alone_ms / one_ms))
        run(swap, num_swaps)
        mm_ms, swap_ms = run(swap, num_swaps)
        rows.append((label, flops / mm_ms / 1e9, gbps(work_bytes * num_swaps, swap_ms)))
    return rows
