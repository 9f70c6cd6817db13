"""Bad configuration fails fast with a message naming what to fix; misuse never crashes."""

from __future__ import annotations

import time

import pytest

from pdrouter.common.proc import find_free_port
from workers.pool.client import KVPoolClient, PoolClientConfig
from workers.pool.errors import BadParamsError, PoolClosedError, PoolSetupError

# Preflight probes take milliseconds; Mooncake's own failure would take 4 to 90 s.
FAST_S = 5.0


def _config(addr, **overrides) -> PoolClientConfig:
    fields = {
        "master_addr": addr.master_addr,
        "metadata_url": addr.metadata_url,
        "num_slots": 4,
        "slot_bytes": 64 << 10,
    }
    fields.update(overrides)
    return PoolClientConfig(**fields)


def _setup_error(config: PoolClientConfig) -> tuple[str, float]:
    client = KVPoolClient(config)
    start = time.monotonic()
    with pytest.raises(PoolSetupError) as info:
        client.connect()
    elapsed_s = time.monotonic() - start
    assert not client.is_open
    with pytest.raises(PoolClosedError):
        client.exists(["k"])
    return str(info.value), elapsed_s


def test_unreachable_master(running_pool):
    port = find_free_port()
    message, elapsed_s = _setup_error(_config(running_pool, master_addr=f"127.0.0.1:{port}"))
    assert message.startswith(f"cannot reach the Mooncake master at 127.0.0.1:{port}")
    assert "fix --master / PDWORKER_MASTER" in message
    assert elapsed_s < FAST_S


def test_metadata_port_given_as_master(running_pool):
    metadata_port = running_pool.metadata_url.split(":")[2].split("/")[0]
    bad = f"127.0.0.1:{metadata_port}"
    message, elapsed_s = _setup_error(_config(running_pool, master_addr=bad))
    assert message.startswith(f"{bad} answers HTTP, so it is not the master's RPC port")
    assert elapsed_s < FAST_S


def test_unreachable_metadata_server(running_pool):
    url = f"http://127.0.0.1:{find_free_port()}/metadata"
    message, elapsed_s = _setup_error(_config(running_pool, metadata_url=url))
    assert message.startswith(f"cannot reach the metadata server at {url}")
    assert "--metadata / PDWORKER_METADATA" in message
    assert elapsed_s < FAST_S


@pytest.mark.parametrize("url", ["127.0.0.1:8080/metadata", "etcd://127.0.0.1:2379", "http://h"])
def test_metadata_must_be_an_http_url(running_pool, url):
    message, _ = _setup_error(_config(running_pool, metadata_url=url))
    assert message == (
        f"--metadata must be the master's HTTP metadata URL, http://HOST:PORT/metadata, got {url!r}"
    )


@pytest.mark.parametrize("addr", ["localhost", "127.0.0.1:", ":50051", "127.0.0.1:http"])
def test_master_must_be_host_port(running_pool, addr):
    message, _ = _setup_error(_config(running_pool, master_addr=addr))
    assert message == f"--master must be HOST:PORT (e.g. 127.0.0.1:50051), got {addr!r}"


def test_unreachable_pool_owner(running_pool):
    owner = f"127.0.0.1:{find_free_port()}"
    message, elapsed_s = _setup_error(_config(running_pool, owner_addr=owner))
    assert message.startswith(f"cannot reach the pool owner at {owner}")
    assert "--pool-owner / PDWORKER_POOL_OWNER" in message
    assert elapsed_s < FAST_S


def test_calls_before_connect_and_after_close_raise_and_never_reach_mooncake(running_pool):
    client = KVPoolClient(_config(running_pool))
    with pytest.raises(PoolClosedError, match="pool client is new"):
        client.get_into(["k"], [0])
    with pytest.raises(PoolClosedError, match="not connected"):
        _ = client.buffer
    client.connect()
    slots = client.slots.allocate(1)
    assert client.put_from(["guard/k"], slots).ok
    client.close()
    client.close()  # twice is fine
    for call in (
        lambda: client.put_from(["guard/k"], slots),
        lambda: client.get_into(["guard/k"], slots),
        lambda: client.exists(["guard/k"]),
        lambda: client.remove(["guard/k"]),
    ):
        with pytest.raises(PoolClosedError, match="pool client is closed"):
            call()
    with pytest.raises(PoolSetupError, match="connect\\(\\) on a client that is closed"):
        client.connect()


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_misuse_is_refused_before_any_native_call(running_pool, transport):
    owner = running_pool.owner_addr if transport == "shm" else None
    with KVPoolClient(_config(running_pool, owner_addr=owner)) as client:
        slots = client.slots.allocate(2)
        with pytest.raises(ValueError, match="2 keys but 1 slots"):
            client.put_from(["a", "b"], slots[:1])
        with pytest.raises(ValueError, match="a slot appears twice"):
            client.get_into(["a", "b"], [slots[0], slots[0]])
        free = next(s for s in range(client.slots.num_slots) if s not in slots)
        with pytest.raises(ValueError, match=f"slot {free} is not allocated to any request"):
            client.put_from(["a"], [free])
        with pytest.raises(ValueError, match=r"size 65537 outside \(0, slot_bytes=65536\]"):
            client.put_from(["a"], slots[:1], [65537])
        assert client.get_into([], []).keys == ()
        assert client.exists([]) == []
        client.slots.check_integrity()
        assert client.slots.num_free == 2


def test_object_larger_than_the_slot_is_bad_params(running_pool):
    big = _config(running_pool, num_slots=1, slot_bytes=256 << 10)
    small = _config(running_pool, num_slots=1, slot_bytes=64 << 10)
    with KVPoolClient(big) as writer, KVPoolClient(small) as reader:
        assert writer.put_from(["big/0"], writer.slots.allocate(1)).ok
        result = reader.get_into(["big/0"], reader.slots.allocate(1))
        assert result.codes == (-600,)
        with pytest.raises(BadParamsError, match=r"1/1 keys bad_params \(code -600\): big/0"):
            result.raise_for_error()
        assert reader.stats().errors == {"bad_params": 1}
