"""HostTier alone: exact entries, slots, pins, LRU order, bytes moved and byte counts of each
write policy, over numpy caches and the real swap_cache_layout (no Paddle)."""

from __future__ import annotations

import numpy as np
import pytest

from workers.engine.engine_config import EngineConfig
from workers.engine.host_policy import HostTierConfig, WritePolicy
from workers.engine.host_storage import SwapCopier, open_host_storage
from workers.engine.host_tier import MODE_D2H, HostTier

SLOT_BYTES = 2 * 4 * 4  # K and V of one layer, block_size 4, head_dim 1, float32


def caches(num_blocks: int = 8) -> list[np.ndarray]:
    """[K0, V0], each [num_blocks, 1, 4, 1]; block b holds b + 1 (K) and -(b + 1) (V)."""
    k = np.zeros((num_blocks, 1, 4, 1), np.float32)
    for b in range(num_blocks):
        k[b] = b + 1
    return [k, -k]


def make(
    policy: WritePolicy = "write_through", num_slots: int = 2, threshold: int = 2
) -> tuple[HostTier, list[np.ndarray], list[tuple]]:
    kv = caches()
    host = np.zeros(num_slots * SLOT_BYTES, np.uint8)
    changes: list[tuple] = []
    tier = HostTier(
        HostTierConfig(num_slots, policy, threshold),
        SwapCopier(kv, host, SLOT_BYTES),
        on_change=lambda added, removed: changes.append((added, removed)),
    )
    return tier, kv, changes


def host_block(tier: HostTier, block_hash: str) -> float:
    """The K value the entry holds (block b's is b + 1)."""
    copier = tier._copier
    slot = tier.entries()[block_hash]
    return float(copier.host[slot * SLOT_BYTES :][:4].view(np.float32)[0])


def test_write_through_copies_each_completed_block_at_the_flush() -> None:
    tier, _, changes = make("write_through")
    tier.on_registered([(3, "h0"), (5, "h1")])
    assert tier.pending() == {"h0": 3, "h1": 5}
    assert tier.entries() == {}  # not visible before its copy completed
    assert "h0" not in tier
    tier.flush()
    assert tier.entries() == {"h0": 0, "h1": 1}
    assert (host_block(tier, "h0"), host_block(tier, "h1")) == (4.0, 6.0)
    assert changes == [(("h0", "h1"), ())]
    stats = tier.stats()
    assert (stats.blocks_written, stats.bytes_written, stats.num_used) == (2, 64, 2)
    tier.check_integrity()


def test_selective_copies_a_block_only_once_served_threshold_times() -> None:
    tier, _, changes = make("write_through_selective", threshold=2)
    tier.on_registered([(3, "h0"), (5, "h1")])
    tier.on_device_hits([(3, "h0")])
    tier.flush()
    assert (tier.pending(), tier.entries(), changes) == ({}, {}, [])
    tier.on_device_hits([(3, "h0"), (5, "h1")])
    assert tier.pending() == {"h0": 3}
    tier.flush()
    assert tier.entries() == {"h0": 0}
    assert tier.stats().bytes_written == SLOT_BYTES  # write_through would have moved 2 blocks


def test_write_back_copies_at_device_eviction_before_returning() -> None:
    tier, kv, _ = make("write_back")
    tier.on_registered([(3, "h0")])
    tier.on_device_hits([(3, "h0"), (3, "h0")])
    assert tier.pending() == {}
    tier.on_device_evict([(3, "h0")])
    assert tier.entries() == {"h0": 0}
    kv[0][3] = 99.0  # the new owner writes the block: the host copy was taken before
    assert host_block(tier, "h0") == 4.0


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_byte_counts_of_each_policy_over_one_trace(policy: WritePolicy) -> None:
    """Four blocks computed; h0 served twice, h1 once; h2 and h3 evicted from the device."""
    tier, _, _ = make(policy, num_slots=8)
    tier.on_registered([(0, "h0"), (1, "h1"), (2, "h2"), (3, "h3")])
    tier.flush()
    tier.on_device_hits([(0, "h0"), (1, "h1")])
    tier.on_device_hits([(0, "h0")])
    tier.flush()
    tier.on_device_evict([(2, "h2"), (3, "h3")])
    expected = {"write_through": 4, "write_through_selective": 1, "write_back": 2}[policy]
    assert tier.stats().bytes_written == expected * SLOT_BYTES


def test_a_pending_block_evicted_from_the_device_is_copied_before_reuse() -> None:
    tier, kv, _ = make("write_through")
    tier.on_registered([(3, "h0")])
    tier.on_device_evict([(3, "h0")])  # allocate() hands block 3 out after this returns
    kv[0][3] = 99.0
    assert (tier.pending(), host_block(tier, "h0")) == ({}, 4.0)


def test_lru_evicts_the_least_recently_written_or_read_entry() -> None:
    tier, kv, changes = make("write_through", num_slots=2)
    tier.on_registered([(0, "h0"), (1, "h1")])
    tier.flush()
    tier.read(["h0"], [6])  # h0 used: h1 is now the least recent
    assert kv[0][6, 0, 0, 0] == 1.0
    tier.on_registered([(2, "h2")])
    tier.flush()
    assert tier.entries() == {"h0": 0, "h2": 1}
    assert changes[-1] == (("h2",), ("h1",))
    assert tier.stats().evictions == 1
    tier.check_integrity()


def test_pinned_entries_are_never_evicted_and_the_write_is_skipped() -> None:
    tier, _, _ = make("write_through", num_slots=2)
    tier.on_registered([(0, "h0"), (1, "h1")])
    tier.flush()
    tier.pin(["h0", "h1"])
    tier.on_registered([(2, "h2")])
    tier.flush()
    assert tier.entries() == {"h0": 0, "h1": 1}
    assert (tier.stats().writes_skipped, tier.stats().evictions) == (1, 0)
    tier.unpin(["h0", "h1"])
    tier.check_integrity()


def test_read_copies_bytes_into_the_device_blocks_and_counts_hits() -> None:
    tier, kv, _ = make("write_through", num_slots=2)
    tier.on_registered([(0, "h0"), (1, "h1")])
    tier.flush()
    kv[0][6:8] = 0.0
    kv[1][6:8] = 0.0
    tier.read(["h0", "h1"], [7, 6])
    assert kv[0][7].ravel().tolist() == [1.0] * 4 and kv[1][6].ravel().tolist() == [-2.0] * 4
    stats = tier.stats()
    assert (stats.blocks_read, stats.bytes_read) == (2, 2 * SLOT_BYTES)
    with pytest.raises(KeyError):
        tier.read(["h0", "nope"], [5, 4])
    tier.check_integrity()  # no pin left behind


class _FailingCopier:
    slot_bytes = SLOT_BYTES

    def __init__(self, fail_mode: int) -> None:
        self.fail_mode = fail_mode

    def copy(self, block_ids: list[int], slots: list[int], mode: int) -> None:
        if mode == self.fail_mode:
            raise RuntimeError("injected copy failure")


def test_a_failed_write_lists_nothing_and_gives_its_slots_back() -> None:
    tier = HostTier(HostTierConfig(2, "write_through"), _FailingCopier(MODE_D2H))
    tier.on_registered([(0, "h0")])
    tier.flush()
    assert (tier.entries(), tier.pending(), tier.stats().writes_skipped) == ({}, {}, 1)
    tier.check_integrity()


def test_config_is_checked() -> None:
    with pytest.raises(ValueError, match="write policy"):
        HostTierConfig(2, "write_around")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="slot"):
        HostTierConfig(0)


def test_storage_holds_whole_blocks_only() -> None:
    kv = caches()
    assert open_host_storage(kv, (SLOT_BYTES - 1) / 2**30) is None  # no whole block: no tier
    storage = open_host_storage(kv, (3 * SLOT_BYTES + 5) / 2**30)
    assert storage is not None and storage.num_slots == 3
    assert storage.copier.host.nbytes == 3 * SLOT_BYTES
    storage.close()


def test_engine_config_checks_the_host_tier_flags() -> None:
    with pytest.raises(ValueError, match="needs the device prefix cache"):
        EngineConfig(swap_space_gib=1.0, enable_prefix_cache=False)
    with pytest.raises(ValueError, match="--write-policy"):
        EngineConfig(write_policy="write_around")
    with pytest.raises(ValueError, match="--write-through-threshold"):
        EngineConfig(write_through_threshold=0)
    assert EngineConfig().swap_space_gib == 0.0  # off by default
