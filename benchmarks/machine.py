"""The CPU (and GPU) a benchmark ran on, as its table's Machine line names it."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_name(fallback: str | None = None) -> str:
    """The first "model name" of /proc/cpuinfo; where there is none, `fallback`, or else
    platform.processor() or platform.machine()."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    if fallback is not None:
        return fallback
    return platform.processor() or platform.machine()


def device_name(gpu: bool) -> str:
    if not gpu:
        return "no GPU (--cpu: numpy caches, CPU kernel)"
    from kernels.cuda_swap import import_cupy

    props = import_cupy().cuda.runtime.getDeviceProperties(0)
    name = props["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def gpu_missing() -> str | None:
    """Why the GPU mode cannot run here, or None."""
    try:
        from kernels.cuda_swap import import_cupy

        if import_cupy().cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device"
    except Exception as exc:  # ImportError, or CUDARuntimeError without a driver
        return str(exc)
    return None
