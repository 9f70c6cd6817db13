"""CPU-side parts of the GPU path: run detection for the DMA strategy, launch config checks."""

from __future__ import annotations

import numpy as np
import pytest

from kernels import CudaLaunchConfig, SwapLayoutError
from kernels.cuda_swap import choose_strategy
from kernels.dma_swap import contiguous_runs, mean_run_bytes
from kernels.swap_plan import SwapPlan, plan_swap


def _runs(ids: list[int], slots: list[int]) -> list[list[int]]:
    return contiguous_runs(np.array(ids, np.int64), np.array(slots, np.int64)).tolist()


def test_runs_follow_both_ids_and_slots() -> None:
    assert _runs([4, 5, 6, 9, 10, 2], [0, 1, 2, 3, 4, 7]) == [[4, 0, 3], [9, 3, 2], [2, 7, 1]]
    # consecutive ids but a slot jump splits the run
    assert _runs([1, 2, 3], [0, 1, 5]) == [[1, 0, 2], [3, 5, 1]]
    # descending ids are separate runs
    assert _runs([3, 2, 1], [0, 1, 2]) == [[3, 0, 1], [2, 1, 1], [1, 2, 1]]
    assert _runs([7], [0]) == [[7, 0, 1]]
    assert _runs([], []) == []


def test_mean_run_bytes() -> None:
    layers = [np.zeros((16, 1, 4, 8), np.float16) for _ in range(4)]  # 64-byte chunks
    host = np.zeros(16 * 4 * 64, np.uint8)
    contiguous = plan_swap(layers, host, list(range(3, 11)), list(range(8)), 0)
    assert mean_run_bytes(contiguous) == 8 * 64
    split = plan_swap(layers, host, [3, 4, 9, 1], [0, 1, 2, 3], 0)
    assert mean_run_bytes(split) == 4 * 64 / 3


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"strategy": "memcpy"}, "strategy must be kernel, dma or auto"),
        ({"threads_per_cta": 100}, "multiple of 32 in \\[32, 1024\\], got 100"),
        ({"threads_per_cta": 2048}, "got 2048"),
        ({"max_ctas": 0}, r"max_ctas \(0\) and device_max_ctas \(16\) must be positive"),
        ({"dma_min_chunk_bytes": -1}, "dma_min_chunk_bytes and dma_min_run_bytes must be >= 0"),
    ],
)
def test_bad_launch_config(kwargs: dict, match: str) -> None:
    with pytest.raises(SwapLayoutError, match=match):
        CudaLaunchConfig(**kwargs)


def test_auto_strategy_needs_large_chunks_and_long_runs() -> None:
    def plan(chunk_elems: int, ids: list[int]) -> SwapPlan:
        layers = [np.zeros((64, 1, 1, chunk_elems), np.float16) for _ in range(2)]
        host = np.zeros(len(ids) * 2 * chunk_elems * 2, np.uint8)
        return plan_swap(layers, host, ids, list(range(len(ids))), 0)

    auto = CudaLaunchConfig()  # dma from 64 KiB chunks and 1 MiB runs
    assert choose_strategy(plan(32 << 10, list(range(16))), auto) == "dma"  # 64 KiB x 16
    assert choose_strategy(plan(32 << 10, list(range(15))), auto) == "kernel"  # 960 KiB runs
    assert choose_strategy(plan(16 << 10, list(range(64))), auto) == "kernel"  # 32 KiB chunks
    scattered = [9, 2, 40, 17]
    assert choose_strategy(plan(128 << 10, scattered), auto) == "kernel"  # 256 KiB runs of one
    assert choose_strategy(plan(512 << 10, scattered), auto) == "dma"  # 1 MiB runs of one
    assert choose_strategy(plan(128 << 10, scattered), CudaLaunchConfig(strategy="dma")) == "dma"
    forced = CudaLaunchConfig(strategy="kernel")
    assert choose_strategy(plan(32 << 10, list(range(16))), forced) == "kernel"
