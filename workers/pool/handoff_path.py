"""Which way a worker's handoff goes through the pool, decided once at start.

    --handoff-path host     host staging (any wheel, any transport)
    --handoff-path device   device pointers, or the worker refuses to start saying why
    --handoff-path auto     device pointers when all of these hold, else host with the reason:
                              the KV cache is on a GPU;
                              the client reaches the owner over shared memory (--pool-owner);
                              the device staging can be allocated on the cache's GPU;
                              a self-test passes: a probe object put from a device slot and
                              got into another, byte for byte

The self-test is what makes the other conditions of the device-pointer path
(docs/design/handoff_and_pool.md) checked rather than assumed: the owner started with
MC_STORE_MEMCPY=1 (workers/pool/owner_process.py sets it for every owner), Mooncake's CUDA
wheel on both sides (the CPU wheel answers -600 to a device pointer), the client's host staging
registered (open_store), the device current on the call threads (PoolClientConfig.cuda_device).
The chosen path, and why, goes into /health, the registration and pdworker_handoff_path.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from workers.pool.device_pool import DEVICE_CALLS, DevicePool, DeviceSlots, OnFallback
from workers.pool.errors import PoolError, PoolSetupError

log = logging.getLogger(__name__)

HANDOFF_PATH_MODES = ("auto", "device", "host")
PathName = Literal["host", "device"]
SELF_TEST_KEY_PREFIX = "pdprobe/device/"
# (num_slots, slot_bytes, device_id) -> device staging (workers/pool/device_staging.py)
MakeStaging = Callable[[int, int, int], DeviceSlots]


@dataclass(frozen=True)
class HandoffPath:
    """The path chosen, why, and the pool object the handoff uses on it (the client itself
    on the host path, a DevicePool over it on the device path)."""

    name: PathName
    reason: str
    pool: Any


def _make_device_staging(num_slots: int, slot_bytes: int, device_id: int) -> DeviceSlots:
    from workers.pool.device_staging import DeviceStaging

    return DeviceStaging(num_slots, slot_bytes, device_id)


def choose_handoff_path(
    mode: str,
    client: Any,
    device_id: int | None,
    on_fallback: OnFallback | None = None,
    make_staging: MakeStaging = _make_device_staging,
    device_calls: int = DEVICE_CALLS,
) -> HandoffPath:
    """The handoff path for a connected client whose cache is on GPU device_id (None: the
    CPU). PoolSetupError when mode is "device" and a condition does not hold. device_calls:
    concurrent Mooncake calls a device batch is split over (DevicePool)."""
    if mode not in HANDOFF_PATH_MODES:
        raise PoolSetupError(f"--handoff-path must be one of {HANDOFF_PATH_MODES}, got {mode!r}")
    if mode == "host":
        return HandoffPath("host", "--handoff-path host", client)
    why_not = _device_precondition(client, device_id)
    if why_not is None:
        assert device_id is not None
        config = client.config
        try:
            staging = make_staging(config.num_slots, config.slot_bytes, device_id)
        except Exception as exc:  # out of GPU memory, no CuPy: the host path still works
            why_not = f"the device staging could not be allocated ({type(exc).__name__}: {exc})"
        else:
            why_not = self_test(client, staging)
            if why_not is None:
                pool = DevicePool(client, staging, device_calls, on_fallback)
                log.info("handoff through device pointers (self-test passed)")
                return HandoffPath("device", "device pointers: the self-test passed", pool)
            staging.close()
    if mode == "device":
        raise PoolSetupError(f"--handoff-path device, but {why_not}")
    # A GPU worker left on the slow path is worth a warning; a CPU worker has no other path.
    level = logging.WARNING if device_id is not None else logging.INFO
    log.log(level, "handoff through host staging: %s", why_not)
    return HandoffPath("host", why_not, client)


def _device_precondition(client: Any, device_id: int | None) -> str | None:
    if device_id is None:
        return "the KV cache is not on a GPU"
    if client.config.owner_addr is None:
        return "the pool is reached over TCP (device pointers need a same-host --pool-owner)"
    return None


def self_test(client: Any, staging: DeviceSlots) -> str | None:
    """None if a probe object put from one device slot reads back into another byte for
    byte, else what went wrong. Uses two device slots and one host slot, all given back."""
    client.use_device_staging(staging)
    slot_bytes = client.config.slot_bytes
    device_slots, host_slots = staging.slots.allocate(2), client.slots.allocate(1)
    if device_slots is None or host_slots is None:
        for allocator, taken in ((staging.slots, device_slots), (client.slots, host_slots)):
            allocator.free(taken or [])
        return "no free staging slots for the self-test (--staging-slots below 2?)"
    host = client.buffer
    key = f"{SELF_TEST_KEY_PREFIX}{uuid.uuid4().hex}"
    pattern = np.random.default_rng().integers(0, 256, slot_bytes, dtype=np.uint8)
    try:
        host.view[host_slots[0]] = pattern
        staging.from_host(host, host_slots, device_slots[:1])
        put = client.put_from([key], device_slots[:1], staging=staging)
        if not put.ok:
            return f"a device-pointer put answered {put.codes[0]} ({put.statuses[0].value})"
        host.view[host_slots[0]] = 0
        staging.from_host(host, host_slots, device_slots[1:])
        got = client.get_into([key], device_slots[1:], staging=staging)
        if not got.ok:
            return f"a device-pointer get answered {got.codes[0]} ({got.statuses[0].value})"
        staging.to_host(device_slots[1:], host, host_slots)
        wrong = int(np.count_nonzero(host.view[host_slots[0]] != pattern))
        if wrong:
            return f"a device-pointer round trip changed {wrong} of {slot_bytes} bytes"
        return None
    except PoolError as exc:
        return f"a device-pointer call failed ({type(exc).__name__}: {exc})"
    except Exception as exc:  # a CUDA copy refused: the device path cannot work here
        return f"the self-test's copies failed ({type(exc).__name__}: {exc})"
    finally:
        staging.slots.free(device_slots)
        client.slots.free(host_slots)
        with contextlib.suppress(PoolError):  # a read lease may keep it until its TTL
            client.remove([key])
