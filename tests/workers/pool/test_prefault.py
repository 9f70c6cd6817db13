"""The pool owner writes its memory once at start (and removes what it wrote), unless told
not to: the owner's mooncake_client then holds the pages before the first put arrives."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.pool.client import KVPoolClient, PoolClientConfig
from workers.pool.local_pool import LocalPool
from workers.pool.prefault import FILL_FRACTION, VALUE_BYTES

POOL_BYTES = 192 << 20


def _child_rss_bytes(owner_pid: int) -> int:
    """VmRSS of the owner's mooncake_client child (the process holding the pool memory)."""
    children = Path(f"/proc/{owner_pid}/task/{owner_pid}/children").read_text().split()
    assert len(children) == 1, f"pdworker pool should have one child, has {children}"
    for line in Path(f"/proc/{children[0]}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no VmRSS line")


@pytest.mark.parametrize("prefault", [True, False])
def test_owner_touches_its_memory_at_start(tmp_path: Path, prefault: bool) -> None:
    pool = LocalPool(POOL_BYTES, log_dir=tmp_path, prefault=prefault).start()
    try:
        assert pool.owner is not None
        rss = _child_rss_bytes(pool.owner.pid)
        filled = int(POOL_BYTES * FILL_FRACTION) // VALUE_BYTES * VALUE_BYTES
        log = (tmp_path / "owner.log").read_text()
        if prefault:
            assert rss >= filled, f"owner RSS {rss} < the {filled} bytes pre-faulted"
            assert f"pool memory pre-faulted: {filled} bytes in " in log
            assert "incomplete" not in log
        else:
            assert rss < filled // 2, f"owner RSS {rss}: memory touched without pre-faulting"
            assert "pre-faulted" not in log
        # The fill is gone: the pool holds no object, and a client can fill it again.
        a = pool.addresses
        config = PoolClientConfig(a.master_addr, a.metadata_url, num_slots=1, slot_bytes=4096)
        with KVPoolClient(config) as client:
            pid = pool.owner.pid
            keys = [f"__pdworker_prefault__/{pid}/{i}" for i in range(filled // VALUE_BYTES)]
            assert client.exists(keys) == [False] * len(keys)
    finally:
        pool.stop()
