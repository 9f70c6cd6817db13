"""Fixtures of the handoff tests: the real pool, and CuPy for the GPU tests (skipped cleanly
without a GPU, CuPy or the Mooncake wheel)."""

from typing import Any

import pytest

from tests.workers.pool.fixtures import running_pool  # noqa: F401 (pytest fixture)


@pytest.fixture(scope="module")
def cp() -> Any:
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA device")
    except Exception as exc:  # ImportError, or CUDARuntimeError without a driver
        pytest.skip(f"needs an NVIDIA GPU with CuPy: {exc}")
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"needs the Mooncake wheel: {exc}")
    return cupy
