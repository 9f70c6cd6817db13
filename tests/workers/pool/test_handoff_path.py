"""The handoff path chosen at start, and the device path's fallback end to end, through the
real pool on the CPU: Mooncake's CPU wheel answers -600 to the stand-in device staging
(tests/workers/pool/device_double.py), as it would to a device pointer, so the self-test
picks host staging and names why, and a DevicePool forced over it redoes every group through
host staging with every byte intact."""

from __future__ import annotations

import numpy as np
import pytest

from kernels.tensor_refs import bytes_per_slot
from tests.workers.pool.device_double import HostBackedStaging
from workers.handoff.reader import load_blocks
from workers.handoff.writer import write_blocks
from workers.pool.client import KVPoolClient, PoolClientConfig
from workers.pool.device_pool import DevicePool
from workers.pool.errors import PoolSetupError
from workers.pool.handoff_path import choose_handoff_path

# [num_blocks, kv_heads, block_size, head_dim] per layer tensor, 2 layers: 2 KiB a block
SHAPE = (12, 2, 4, 16)
SLOTS = 8


def _caches(seed: int | None) -> list[np.ndarray]:
    if seed is None:
        return [np.zeros(SHAPE, np.uint16) for _ in range(4)]
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 1 << 16, SHAPE, dtype=np.uint16) for _ in range(4)]


def _client(addr, shm: bool = True) -> KVPoolClient:
    config = PoolClientConfig(
        master_addr=addr.master_addr,
        metadata_url=addr.metadata_url,
        owner_addr=addr.owner_addr if shm else None,
        num_slots=SLOTS,
        slot_bytes=bytes_per_slot(_caches(None)),
        probe_interval_s=0,
    )
    return KVPoolClient(config).connect()


def _stand_in(num_slots: int, slot_bytes: int, device_id: int) -> HostBackedStaging:
    assert device_id == 0
    return HostBackedStaging(num_slots, slot_bytes)


def test_auto_takes_host_staging_when_the_self_test_fails(running_pool) -> None:
    made: list[HostBackedStaging] = []

    def make(n: int, b: int, d: int) -> HostBackedStaging:
        made.append(_stand_in(n, b, d))
        return made[-1]

    with _client(running_pool) as client:
        path = choose_handoff_path("auto", client, 0, make_staging=make)
        assert (path.name, path.pool) == ("host", client)
        assert path.reason == "a device-pointer put answered -600 (bad_params)"
        assert made[0].closed and made[0].slots.num_free == SLOTS
        assert client.slots.num_free == SLOTS
        with pytest.raises(PoolSetupError, match=r"--handoff-path device, but .*-600"):
            choose_handoff_path("device", client, 0, make_staging=_stand_in)
        assert choose_handoff_path("host", client, 0).reason == "--handoff-path host"
        no_gpu = choose_handoff_path("auto", client, None, make_staging=_stand_in)
        assert (no_gpu.name, no_gpu.reason) == ("host", "the KV cache is not on a GPU")


def test_a_tcp_client_takes_host_staging(running_pool) -> None:
    with _client(running_pool, shm=False) as client:
        path = choose_handoff_path("auto", client, 0, make_staging=_stand_in)
    assert path.name == "host" and "over TCP" in path.reason


def test_every_group_redone_through_host_is_byte_exact(running_pool) -> None:
    """P and D on the device path whose every device call fails (-600 from the real pool):
    write_blocks and load_blocks still move every byte, each group counted once."""
    p_cache, d_cache = _caches(1), _caches(None)
    p_ids, d_ids = [11, 3, 7, 0, 5, 9, 2], [1, 10, 4, 8, 6, 0, 3]
    keys = [f"devpath/fallback/{i}" for i in range(len(p_ids))]
    fallbacks: list[tuple[str, str]] = []
    with _client(running_pool) as p_client, _client(running_pool) as d_client:
        slot_bytes = p_client.config.slot_bytes
        pools = [
            DevicePool(c, HostBackedStaging(SLOTS, slot_bytes), calls=2,
                       on_fallback=lambda *a: fallbacks.append(a))
            for c in (p_client, d_client)
        ]  # fmt: skip
        wrote = write_blocks(pools[0], p_cache, keys, p_ids, group_blocks=3, wait_s=5)
        read = load_blocks(pools[1], d_cache, keys, d_ids, group_blocks=3, wait_s=5)
    assert (wrote.num_written, read.num_loaded, read.missing_keys) == (7, 7, ())
    for p_tensor, d_tensor in zip(p_cache, d_cache, strict=True):
        np.testing.assert_array_equal(d_tensor[d_ids], p_tensor[p_ids])
    assert fallbacks == [("put", "bad_params")] * 3 + [("get", "bad_params")] * 3
    for pool in pools:
        assert pool.slots.num_free == SLOTS and pool.client.slots.num_free == SLOTS
