"""The CPU path stays free of CuPy and Paddle; the benchmark exits cleanly without a GPU."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.repo import REPO_ROOT

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}

CPU_ONLY_SCRIPT = """
import sys
import numpy as np
import kernels
layers = [np.arange(16, dtype=np.uint16).reshape(2, 1, 2, 4) for _ in range(2)]
host = np.zeros(2 * kernels.bytes_per_slot(layers), np.uint8)
kernels.swap_cache_layout(layers, host, [1], [0], kernels.MODE_DEVICE_TO_HOST).wait()
kernels.CudaLaunchConfig(strategy="dma")
import kernels.cuda_swap, kernels.dma_swap, benchmarks.kernels.bench
print(int(host[:32].view(np.uint16).sum()), "cupy" in sys.modules, "paddle" in sys.modules)
"""


def test_cpu_path_imports_neither_cupy_nor_paddle() -> None:
    result = subprocess.run(
        [sys.executable, "-c", CPU_ONLY_SCRIPT], env=ENV, capture_output=True, text=True,
        timeout=60, check=False, cwd=REPO_ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    # block 1 of K and of V: values 8..15 each
    assert result.stdout.split() == [str(2 * sum(range(8, 16))), "False", "False"]


def test_bench_without_gpu_says_why_and_exits_zero() -> None:
    # No visible GPU: the same outcome with or without CuPy installed.
    env = {**ENV, "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.kernels.bench"], env=env, capture_output=True, text=True,
        timeout=60, check=False, cwd=REPO_ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(
        "benchmarks.kernels.bench: skipped, needs an NVIDIA GPU with CuPy ("
    )
