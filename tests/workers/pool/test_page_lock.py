"""Page-locked staging for a GPU cache: registered once at connect, released at close, and a
client whose staging cannot be page-locked refuses to connect, saying why.

The registration is a narrow fake here (this machine has no GPU); the real cudaHostRegister
runs in test_handoff_gpu.py. The pool is real: master, owner, both transports.
"""

from __future__ import annotations

import importlib.util

import pytest

from workers.pool.client import KVPoolClient, PoolClientConfig
from workers.pool.errors import PoolSetupError
from workers.pool.object_header import HEADER_BYTES
from workers.pool.page_lock import lock_staging

SLOT_BYTES = 64 << 10
NUM_SLOTS = 4
# The slots, then each slot's object header bytes (workers/pool/staging.py).
STAGING_BYTES = NUM_SLOTS * (SLOT_BYTES + HEADER_BYTES)


class FakeRegistration:
    """Records register/close; a real HostRegistration page-locks the range instead."""

    def __init__(self, log: list[tuple], ptr: int, nbytes: int) -> None:
        self.log, self.ptr = log, ptr
        log.append(("register", ptr, nbytes))

    def close(self) -> None:
        self.log.append(("unregister", self.ptr))


def _config(addr, transport: str, page_lock: bool = True) -> PoolClientConfig:
    return PoolClientConfig(
        master_addr=addr.master_addr,
        metadata_url=addr.metadata_url,
        num_slots=NUM_SLOTS,
        slot_bytes=SLOT_BYTES,
        owner_addr=addr.owner_addr if transport == "shm" else None,
        page_lock=page_lock,
    )


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_staging_is_locked_once_and_released_at_close(running_pool, transport) -> None:
    log: list[tuple] = []
    client = KVPoolClient(
        _config(running_pool, transport), register=lambda p, n: FakeRegistration(log, p, n)
    ).connect()
    buffer = client.buffer
    assert log == [("register", buffer.ptr, STAGING_BYTES)]
    slots = client.slots.allocate(1)
    client.buffer.slot(slots[0])[:] = 7
    assert client.put_from([f"lock/{transport}/a"], slots).ok
    client.slots.free(slots)
    client.close()
    assert log == [("register", buffer.ptr, STAGING_BYTES), ("unregister", buffer.ptr)]


def test_no_lock_without_a_gpu_cache(running_pool) -> None:
    log: list[tuple] = []
    client = KVPoolClient(
        _config(running_pool, "shm", page_lock=False),
        register=lambda p, n: FakeRegistration(log, p, n),
    ).connect()
    client.close()
    assert log == []


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_refused_registration_refuses_the_client(running_pool, transport) -> None:
    def refuse(ptr: int, nbytes: int) -> FakeRegistration:
        raise RuntimeError("cudaErrorHostMemoryAlreadyRegistered")

    client = KVPoolClient(_config(running_pool, transport), register=refuse)
    with pytest.raises(PoolSetupError) as info:
        client.connect()
    message = str(info.value)
    assert "cudaHostRegister refused" in message
    assert f"{STAGING_BYTES}-byte pool staging buffer" in message
    assert "cudaErrorHostMemoryAlreadyRegistered" in message
    assert not client.is_open
    # The pool is untouched: a client without page locking connects and works.
    other = KVPoolClient(_config(running_pool, transport, page_lock=False)).connect()
    try:
        assert other.exists([f"lock/{transport}/never"]) == [False]
    finally:
        other.close()


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="CuPy is installed")
def test_without_cupy_the_real_registration_names_the_install() -> None:
    with pytest.raises(PoolSetupError, match=r"CuPy is not importable.*pip install cupy"):
        lock_staging(4096, 4096)
