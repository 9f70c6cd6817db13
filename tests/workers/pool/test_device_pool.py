"""DevicePool's retry and host fallback, on the narrow scripted double (tests/workers/pool/
device_double.py): a device call that fails is tried once more, then redone through host
staging, counted and logged once per transition; what the host cannot fix either stands."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from tests.workers.pool.device_double import (
    BAD_PARAMS,
    MISSING,
    HostBackedStaging,
    ScriptedClient,
)
from workers.pool.device_pool import DevicePool
from workers.pool.errors import KeyStatus

SLOT_BYTES = 64


def _pool(device_codes: list[int], calls: int = 1, num_slots: int = 8):
    client = ScriptedClient(SLOT_BYTES, num_slots, device_codes=list(device_codes))
    staging = HostBackedStaging(8, SLOT_BYTES)
    fallbacks: list[tuple[str, str]] = []
    pool = DevicePool(client, staging, calls=calls, on_fallback=lambda *a: fallbacks.append(a))
    return client, staging, pool, fallbacks


def _fill(staging: HostBackedStaging, slots: list[int]) -> list[bytes]:
    for i, slot in enumerate(slots):
        staging.view[slot] = 10 + i
    return [staging.view[s].tobytes() for s in slots]


def test_device_calls_that_work_never_touch_host_staging() -> None:
    client, staging, pool, fallbacks = _pool([], calls=3)
    assert pool.slots is staging.slots and pool.buffer is staging
    values = _fill(staging, [0, 1, 2, 3, 4])
    assert pool.put_from(list("abcde"), [0, 1, 2, 3, 4]).ok
    staging.view[:] = 0
    got = pool.get_into(list("abcde"), [5, 6, 7, 0, 1])
    assert got.codes == (SLOT_BYTES,) * 5
    assert [staging.view[s].tobytes() for s in (5, 6, 7, 0, 1)] == values
    # each batch split over 3 concurrent device calls (2 + 1 + 2 keys... in order)
    assert sorted(client.calls) == sorted([("put", "device", n) for n in (1, 2, 2)] +
                                          [("get", "device", n) for n in (1, 2, 2)])  # fmt: skip
    assert fallbacks == [] and client.slots.num_free == client.num_slots


def test_a_failure_once_is_retried_as_a_device_call() -> None:
    client, staging, pool, fallbacks = _pool([BAD_PARAMS])
    _fill(staging, [0, 1])
    assert pool.put_from(["a", "b"], [0, 1]).ok
    assert client.calls == [("put", "device", 2), ("put", "device", 2)]
    assert fallbacks == []


def test_twice_failed_put_is_redone_through_host_staging(caplog) -> None:
    client, staging, pool, fallbacks = _pool([BAD_PARAMS, BAD_PARAMS, BAD_PARAMS, BAD_PARAMS])
    values = _fill(staging, [2, 3])
    with caplog.at_level(logging.INFO, logger="workers.pool.device_pool"):
        assert pool.put_from(["a", "b"], [2, 3]).ok
        assert pool.put_from(["c"], [2]).ok  # falls back again: counted, not logged again
        assert pool.put_from(["d"], [3]).ok  # the device works again: logged once
    assert [client.store["a"], client.store["b"]] == values
    assert client.calls[:3] == [("put", "device", 2), ("put", "device", 2), ("put", "host", 2)]
    assert fallbacks == [("put", KeyStatus.BAD_PARAMS.value)] * 2
    messages = [r.getMessage() for r in caplog.records]
    assert sum("redone through host staging" in m for m in messages) == 1
    assert sum("work again" in m for m in messages) == 1
    assert client.slots.num_free == client.num_slots  # the host slots went back


def test_twice_failed_get_is_read_through_host_into_device_slots() -> None:
    client, staging, pool, fallbacks = _pool([BAD_PARAMS, BAD_PARAMS])
    client.store.update({"a": bytes([7]) * SLOT_BYTES, "b": bytes([9]) * SLOT_BYTES})
    got = pool.get_into(["a", "zz", "b"], [4, 5, 6])
    assert got.statuses == (KeyStatus.OK, KeyStatus.MISSING, KeyStatus.OK)
    assert staging.view[4].tolist() == [7] * SLOT_BYTES
    assert staging.view[6].tolist() == [9] * SLOT_BYTES
    assert not staging.view[5].any()
    assert fallbacks == [("get", "bad_params")]


def test_a_miss_is_neither_retried_nor_redone() -> None:
    client, _, pool, fallbacks = _pool([MISSING])
    assert pool.get_into(["a"], [0]).statuses == (KeyStatus.MISSING,)
    assert client.calls == [("get", "device", 1)] and fallbacks == []


def test_without_free_host_slots_the_failure_stands(monkeypatch) -> None:
    monkeypatch.setattr("workers.pool.device_pool.HOST_SLOTS_WAIT_S", 0.05)
    client, staging, pool, fallbacks = _pool([BAD_PARAMS, BAD_PARAMS], num_slots=1)
    held = client.slots.allocate(1)
    assert held is not None
    _fill(staging, [0, 1])
    result = pool.put_from(["a", "b"], [0, 1])
    assert result.codes == (BAD_PARAMS, BAD_PARAMS) and client.store == {}
    assert fallbacks == [("put", "bad_params")]


def test_a_foreign_staging_is_refused() -> None:
    _, _, pool, _ = _pool([])
    with pytest.raises(ValueError, match="not this pool's device staging"):
        pool.put_from(["a"], [0], staging=np.zeros(4))
