"""The CUDA kernel is bitwise equal to the CPU implementation (the spec) over a grid of
shapes, element sizes, block counts and id patterns, with every output poisoned first.

Needs an NVIDIA GPU and CuPy; skipped cleanly elsewhere. No Paddle needed (CuPy arrays).
"""

from __future__ import annotations

import threading
import zlib

import numpy as np
import pytest

from kernels import (
    MODE_DEVICE_TO_HOST,
    MODE_HOST_TO_DEVICE,
    CudaLaunchConfig,
    DeviceBuffer,
    HostBuffer,
    SwapLayoutError,
    bytes_per_slot,
    swap_cache_layout,
)
from tests.kernels.reference import DTYPES, POISON_BYTE, poisoned_like, random_layers

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cp():
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA device")
    except Exception as exc:  # ImportError, or CUDARuntimeError without a driver
        pytest.skip(f"needs an NVIDIA GPU with CuPy: {exc}")
    return cupy


@pytest.fixture(scope="module")
def pinned(cp):
    from kernels.pinned_host import PinnedHostBuffer

    buffer = PinnedHostBuffer(64 << 20)
    yield buffer
    cp.cuda.runtime.deviceSynchronize()
    buffer.close()


# (num_layers, num_blocks, num_kv_heads, block_size, head_dim): chunk bytes vary from 1 to
# 128 KiB per element byte; odd sizes force 1/2/4/8-byte vectors, large ones several tiles.
SHAPES = [(1, 3, 1, 1, 1), (2, 9, 3, 5, 7), (3, 40, 2, 16, 64), (2, 24, 8, 16, 128),
          (1, 10, 8, 64, 128), (4, 33, 1, 4, 6)]  # fmt: skip
PATTERNS = ["scattered", "contiguous", "single"]


def _ids(rng: np.random.Generator, pattern: str, num_blocks: int) -> tuple[list, list]:
    if pattern == "single":
        return [num_blocks - 1], [1]
    count = max(1, (2 * num_blocks) // 3)
    if pattern == "contiguous":
        start = num_blocks - count
        return list(range(start, num_blocks)), list(range(1, count + 1))
    ids = rng.choice(num_blocks, size=count, replace=False).tolist()
    slots = rng.choice(count + 2, size=count, replace=False).tolist()
    return ids, slots


def _host_slice(pinned, nbytes: int) -> tuple[HostBuffer, np.ndarray]:
    assert nbytes <= pinned.nbytes
    view = pinned.as_array()[:nbytes]
    view[...] = POISON_BYTE
    return HostBuffer(pinned.ptr, nbytes), view


@pytest.mark.parametrize("strategy", ["kernel", "dma"])
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("elem_bytes", [1, 2, 4])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "L{}N{}H{}B{}D{}".format(*s))
def test_gpu_equals_cpu_both_directions(cp, pinned, shape, elem_bytes, pattern, strategy) -> None:
    launch = CudaLaunchConfig(strategy=strategy)
    rng = np.random.default_rng(zlib.crc32(repr((shape, elem_bytes, pattern)).encode()))
    layers = random_layers(rng, *shape, DTYPES[elem_bytes])
    ids, slots = _ids(rng, pattern, shape[1])
    num_slots = max(slots) + 2
    slot_bytes = bytes_per_slot(layers)

    # device -> host: host poisoned, compared with the CPU result on a poisoned copy
    buffer, host_view = _host_slice(pinned, num_slots * slot_bytes)
    expected_host = host_view.copy()
    swap_cache_layout(layers, expected_host, ids, slots, MODE_DEVICE_TO_HOST)
    gpu_layers = [cp.asarray(t) for t in layers]
    swap_cache_layout(gpu_layers, buffer, ids, slots, MODE_DEVICE_TO_HOST, None, launch).wait()
    np.testing.assert_array_equal(host_view, expected_host)

    # host -> device: cache poisoned, random host bytes
    host_view[...] = rng.integers(0, 256, size=host_view.shape, dtype=np.uint8)
    expected_layers = poisoned_like(layers)
    swap_cache_layout(expected_layers, host_view.copy(), ids, slots, MODE_HOST_TO_DEVICE)
    targets = [cp.asarray(t) for t in poisoned_like(layers)]
    swap_cache_layout(targets, buffer, ids, slots, MODE_HOST_TO_DEVICE, None, launch).wait()
    for got, want in zip(targets, expected_layers, strict=True):
        np.testing.assert_array_equal(cp.asnumpy(got), want)


@pytest.mark.parametrize("strategy", ["kernel", "dma"])
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("shape", SHAPES[1:4], ids=lambda s: "L{}N{}H{}B{}D{}".format(*s))
def test_device_staging_equals_cpu(cp, shape, pattern, strategy) -> None:
    """A DeviceBuffer (the device-pointer path's staging) holds the same slot layout as host
    staging, both ways, with the unused slots left poisoned."""
    launch = CudaLaunchConfig(strategy=strategy)
    rng = np.random.default_rng(zlib.crc32(repr((shape, pattern, "dev")).encode()))
    layers = random_layers(rng, *shape, np.uint16)
    ids, slots = _ids(rng, pattern, shape[1])
    nbytes = (max(slots) + 2) * bytes_per_slot(layers)
    staging = cp.full(nbytes, POISON_BYTE, dtype=cp.uint8)
    buffer = DeviceBuffer(staging.data.ptr, nbytes)
    expected = np.full(nbytes, POISON_BYTE, dtype=np.uint8)
    swap_cache_layout(layers, expected, ids, slots, MODE_DEVICE_TO_HOST)
    gpu_layers = [cp.asarray(t) for t in layers]
    swap_cache_layout(gpu_layers, buffer, ids, slots, MODE_DEVICE_TO_HOST, None, launch).wait()
    np.testing.assert_array_equal(cp.asnumpy(staging), expected)

    staging[...] = cp.asarray(rng.integers(0, 256, size=nbytes, dtype=np.uint8))
    expected_layers = poisoned_like(layers)
    swap_cache_layout(expected_layers, cp.asnumpy(staging), ids, slots, MODE_HOST_TO_DEVICE)
    targets = [cp.asarray(t) for t in poisoned_like(layers)]
    swap_cache_layout(targets, buffer, ids, slots, MODE_HOST_TO_DEVICE, None, launch).wait()
    for got, want in zip(targets, expected_layers, strict=True):
        np.testing.assert_array_equal(cp.asnumpy(got), want)


def test_host_memory_as_device_buffer_is_refused(cp, pinned) -> None:
    layers = [cp.zeros((4, 1, 2, 8), dtype=cp.float16) for _ in range(2)]
    with pytest.raises(SwapLayoutError, match="is not GPU memory"):
        swap_cache_layout(layers, DeviceBuffer(pinned.ptr, 4096), [0], [0], MODE_DEVICE_TO_HOST)


@pytest.mark.parametrize(("threads", "ctas"), [(32, 1), (64, 3), (1024, 1000)])
def test_any_launch_shape_covers_all_work(cp, pinned, threads, ctas) -> None:
    rng = np.random.default_rng(threads + ctas)
    layers = random_layers(rng, 2, 30, 4, 16, 64, np.uint16)  # 8 KiB chunks, 2 pieces each
    ids = rng.choice(30, size=25, replace=False).tolist()
    slots = rng.permutation(25).tolist()
    buffer, host_view = _host_slice(pinned, 25 * bytes_per_slot(layers))
    expected = host_view.copy()
    swap_cache_layout(layers, expected, ids, slots, MODE_DEVICE_TO_HOST)
    launch = CudaLaunchConfig(strategy="kernel", threads_per_cta=threads, max_ctas=ctas)
    gpu_layers = [cp.asarray(t) for t in layers]
    swap_cache_layout(gpu_layers, buffer, ids, slots, MODE_DEVICE_TO_HOST, None, launch).wait()
    np.testing.assert_array_equal(host_view, expected)


def test_misaligned_host_uses_narrow_vectors(cp, pinned) -> None:
    rng = np.random.default_rng(3)
    layers = random_layers(rng, 2, 12, 2, 16, 64, np.uint16)  # 4 KiB chunks
    slot_bytes = bytes_per_slot(layers)
    for offset in (2, 4, 8):
        view = pinned.as_array()[offset : offset + 5 * slot_bytes]
        view[...] = POISON_BYTE
        expected = view.copy()
        swap_cache_layout(layers, expected, [11, 0, 5], [4, 0, 2], MODE_DEVICE_TO_HOST)
        buffer = HostBuffer(pinned.ptr + offset, view.nbytes)
        gpu_layers = [cp.asarray(t) for t in layers]
        swap_cache_layout(gpu_layers, buffer, [11, 0, 5], [4, 0, 2], MODE_DEVICE_TO_HOST).wait()
        np.testing.assert_array_equal(view, expected)


def test_registered_numpy_buffer(cp) -> None:
    from kernels.pinned_host import HostRegistration

    rng = np.random.default_rng(4)
    layers = random_layers(rng, 2, 16, 4, 16, 64, np.uint16)
    host = np.full(8 * bytes_per_slot(layers), POISON_BYTE, dtype=np.uint8)
    expected = host.copy()
    swap_cache_layout(layers, expected, [15, 2, 9], [7, 1, 0], MODE_DEVICE_TO_HOST)
    with HostRegistration(host.ctypes.data, host.nbytes):
        gpu_layers = [cp.asarray(t) for t in layers]
        swap_cache_layout(gpu_layers, host, [15, 2, 9], [7, 1, 0], MODE_DEVICE_TO_HOST).wait()
    np.testing.assert_array_equal(host, expected)


def test_pageable_host_is_refused(cp) -> None:
    layers = [cp.zeros((4, 1, 2, 8), dtype=cp.float16) for _ in range(2)]
    host = np.zeros(4 * 64, dtype=np.uint8)
    with pytest.raises(SwapLayoutError, match="not page-locked host memory"):
        swap_cache_layout(layers, host, [0], [0], MODE_DEVICE_TO_HOST)


def test_host_array_on_device_is_refused(cp) -> None:
    layers = [cp.zeros((4, 1, 2, 8), dtype=cp.float16) for _ in range(2)]
    with pytest.raises(SwapLayoutError, match="host buffer is a ndarray"):
        swap_cache_layout(layers, cp.zeros(256, cp.uint8), [0], [0], MODE_DEVICE_TO_HOST)


def test_mixed_cpu_and_gpu_layers_are_refused(cp) -> None:
    layers = [cp.zeros((4, 1, 2, 8), dtype=cp.float16), np.zeros((4, 1, 2, 8), np.float16)]
    with pytest.raises(SwapLayoutError, match=r"layer_tensors\[1\] is on the CPU"):
        swap_cache_layout(layers, np.zeros(256, np.uint8), [0], [0], MODE_DEVICE_TO_HOST)


class _TorchLikeStream:
    """Holds a stream the way PyTorch and Paddle expose it: an int in `.cuda_stream`."""

    def __init__(self, address: int) -> None:
        self.cuda_stream = address


@pytest.mark.parametrize("kind", ["cupy", "int", "cuda_stream"])
def test_round_trip_queued_on_one_stream(cp, pinned, kind) -> None:
    rng = np.random.default_rng(5)
    layers = random_layers(rng, 3, 64, 8, 16, 128, np.uint16)  # 32 KiB chunks
    ids = rng.choice(64, size=40, replace=False).tolist()
    slots = rng.permutation(40).tolist()
    buffer, _ = _host_slice(pinned, 40 * bytes_per_slot(layers))
    stream = cp.cuda.Stream(non_blocking=True)
    given = {"cupy": stream, "int": stream.ptr, "cuda_stream": _TorchLikeStream(stream.ptr)}[kind]
    from kernels.cuda_swap import resolve_stream

    assert resolve_stream(cp, given).ptr == stream.ptr
    with stream:
        source = [cp.asarray(t) for t in layers]
        target = [cp.asarray(t) for t in poisoned_like(layers)]
    stream.synchronize()

    # Both calls are queued before any wait: the stream orders them.
    swap_cache_layout(source, buffer, ids, slots, MODE_DEVICE_TO_HOST, stream=given)
    handle = swap_cache_layout(target, buffer, ids[::-1], slots[::-1], MODE_HOST_TO_DEVICE, given)
    handle.wait()

    assert handle.done()
    for got, want in zip(target, layers, strict=True):
        np.testing.assert_array_equal(cp.asnumpy(got)[ids], want[ids])
        others = sorted(set(range(64)) - set(ids))
        assert (cp.asnumpy(got)[others].view(np.uint8) == POISON_BYTE).all()


def test_two_threads_with_their_own_buffers(cp) -> None:
    from kernels.pinned_host import PinnedHostBuffer

    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            rng = np.random.default_rng(seed)
            layers = random_layers(rng, 2, 48, 4, 16, 64, np.uint16)
            stream = cp.cuda.Stream(non_blocking=True)
            with PinnedHostBuffer(48 * bytes_per_slot(layers)) as host, stream:
                gpu_layers = [cp.asarray(t) for t in layers]
                for round_id in range(25):
                    ids = rng.choice(48, size=30, replace=False).tolist()
                    view = host.as_array()
                    view[...] = POISON_BYTE
                    swap_cache_layout(
                        gpu_layers, host.buffer, ids, list(range(30)), 0, stream
                    ).wait()
                    expected = np.full_like(view, POISON_BYTE)
                    swap_cache_layout(layers, expected, ids, list(range(30)), 0)
                    assert np.array_equal(view, expected), f"seed {seed} round {round_id}"
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in (10, 11)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
