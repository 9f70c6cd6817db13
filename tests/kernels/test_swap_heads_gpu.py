"""swap_cache_layout with host_heads on the GPU equals the CPU spec (tests/kernels/
test_swap_heads.py), both directions, kernel and DMA, page-locked host and GPU staging.

Needs an NVIDIA GPU and CuPy; skipped cleanly elsewhere.
"""

from __future__ import annotations

import numpy as np
import pytest

from kernels import (
    MODE_DEVICE_TO_HOST,
    MODE_HOST_TO_DEVICE,
    CudaLaunchConfig,
    DeviceBuffer,
    HostBuffer,
    HostHeads,
    swap_cache_layout,
)
from tests.kernels.reference import POISON_BYTE, poisoned_like, random_layers
from tests.kernels.test_swap_gpu import cp  # noqa: F401 (pytest fixture)

pytestmark = pytest.mark.gpu

# (num_layers, num_blocks, cache heads, block_size, head_dim, host heads start, host total)
CASES = [(2, 24, 4, 16, 128, 4, 8), (2, 24, 4, 16, 128, 0, 8), (3, 9, 1, 5, 7, 2, 3),
         (1, 10, 2, 16, 64, 6, 8)]  # fmt: skip


@pytest.mark.parametrize("staging", ["pinned", "device"])
@pytest.mark.parametrize("strategy", ["kernel", "dma"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_gpu_equals_cpu_with_host_heads(cp, case, strategy, staging) -> None:  # noqa: F811
    from kernels.pinned_host import PinnedHostBuffer

    layers_n, blocks, heads, bs, dim, start, total = case
    rng = np.random.default_rng(sum(case))
    layers = random_layers(rng, layers_n, blocks, heads, bs, dim)
    cut, launch = HostHeads(start, total), CudaLaunchConfig(strategy=strategy)
    ids = rng.choice(blocks, size=blocks // 2, replace=False).tolist()
    slots = rng.choice(len(ids) + 2, size=len(ids), replace=False).tolist()
    nbytes = (len(ids) + 2) * 2 * layers_n * total * bs * dim * 2
    source = rng.integers(0, 256, size=nbytes, dtype=np.uint8)
    pinned = PinnedHostBuffer(nbytes) if staging == "pinned" else None
    device = cp.asarray(source) if staging == "device" else None
    try:
        if pinned is not None:
            pinned.as_array()[...] = source
            host = HostBuffer(pinned.ptr, nbytes)
        else:
            host = DeviceBuffer(device.data.ptr, nbytes)
        want = poisoned_like(layers)
        swap_cache_layout(want, source.copy(), ids, slots, MODE_HOST_TO_DEVICE, host_heads=cut)
        got = [cp.asarray(t) for t in poisoned_like(layers)]
        swap_cache_layout(got, host, ids, slots, MODE_HOST_TO_DEVICE, None, launch, cut).wait()
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(cp.asnumpy(g), w)
        # device -> host into poisoned staging: only the cache's heads of each slot change
        expected = np.full(nbytes, POISON_BYTE, np.uint8)
        swap_cache_layout(layers, expected, ids, slots, MODE_DEVICE_TO_HOST, host_heads=cut)
        if pinned is not None:
            pinned.as_array()[...] = POISON_BYTE
        else:
            device[...] = POISON_BYTE
        gpu_layers = [cp.asarray(t) for t in layers]
        swap_cache_layout(gpu_layers, host, ids, slots, MODE_DEVICE_TO_HOST, None, launch,
                          cut).wait()  # fmt: skip
        back = pinned.as_array().copy() if pinned is not None else cp.asnumpy(device)
        np.testing.assert_array_equal(back, expected)
    finally:
        cp.cuda.runtime.deviceSynchronize()
        if pinned is not None:
            pinned.close()
