"""Doubles for the device-pointer path on a machine without a GPU.

HostBackedStaging stands in for workers/pool/device_staging.py's DeviceStaging: the same slots,
slot addresses, swap target and copies, in plain host memory. Passed to the real pool with
the CPU Mooncake wheel, its addresses are what a device pointer is to that wheel: memory no
shared-memory registration covers, which the owner refuses with -600 (measured). So the real
pool itself injects the device path's failure, and the fallback runs end to end.

ScriptedClient is the narrow fault double for what the real pool cannot do on cue (a device
call that fails once and then works, a host staging with no free slot): a dict-backed client
whose device-staging calls answer from a script.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from workers.pool.errors import BatchResult
from workers.pool.staging import SlotAllocator, StagingBuffer

MISSING, BAD_PARAMS = -704, -600


class HostBackedStaging:
    """DeviceStaging's interface over host memory."""

    def __init__(self, num_slots: int, slot_bytes: int) -> None:
        self._buffer = StagingBuffer(num_slots, slot_bytes)
        self.slots = SlotAllocator(num_slots)
        self.slot_ptrs = [self._buffer.slot_ptr(s) for s in range(num_slots)]
        self.view = self._buffer.view  # [num_slots, slot_bytes]
        self.closed = False

    def to_host(self, slots: Sequence[int], host: StagingBuffer, host_slots: Sequence[int]) -> None:
        host.view[list(host_slots)] = self.view[list(slots)]

    def from_host(
        self, host: StagingBuffer, host_slots: Sequence[int], slots: Sequence[int]
    ) -> None:
        self.view[list(slots)] = host.view[list(host_slots)]

    def close(self) -> None:
        self.closed = True


@dataclass
class _Config:
    slot_bytes: int
    num_slots: int
    owner_addr: str | None = "127.0.0.1:1"


@dataclass
class ScriptedClient:
    """put_from / get_into over a dict; calls on the device staging first answer
    `device_codes` (one code for every key of a call, in call order), then work."""

    slot_bytes: int
    num_slots: int = 8
    device_codes: list[int] = field(default_factory=list)
    store: dict[str, bytes] = field(default_factory=dict)
    calls: list[tuple[str, str, int]] = field(default_factory=list)  # (op, where, keys)

    def __post_init__(self) -> None:
        self.config = _Config(self.slot_bytes, self.num_slots)
        self.buffer = StagingBuffer(self.num_slots, self.slot_bytes)
        self.slots = SlotAllocator(self.num_slots)
        self.device: HostBackedStaging | None = None
        self.is_open = True

    def use_device_staging(self, staging: HostBackedStaging) -> None:
        self.device = staging

    def _view(self, staging: object) -> np.ndarray:
        return self.device.view if staging is self.device else self.buffer.view  # type: ignore[union-attr]

    def _scripted(self, op: str, keys: Sequence[str], staging: object) -> BatchResult | None:
        where = "device" if staging is self.device else "host"
        self.calls.append((op, where, len(keys)))
        if where == "device" and self.device_codes:
            return BatchResult.from_codes(keys, [self.device_codes.pop(0)] * len(keys))
        return None

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return [k in self.store for k in keys]

    def put_from(self, keys, slots, sizes=None, staging=None) -> BatchResult:
        scripted = self._scripted("put", keys, staging)
        if scripted is not None:
            return scripted
        view = self._view(staging)
        for key, slot in zip(keys, slots, strict=True):
            self.store.setdefault(key, view[slot].tobytes())
        return BatchResult.from_codes(keys, [0] * len(keys))

    def get_into(self, keys, slots, staging=None) -> BatchResult:
        scripted = self._scripted("get", keys, staging)
        if scripted is not None:
            return scripted
        view, codes = self._view(staging), []
        for key, slot in zip(keys, slots, strict=True):
            value = self.store.get(key)
            if value is not None:
                view[slot] = np.frombuffer(value, np.uint8)
            codes.append(MISSING if value is None else len(value))
        return BatchResult.from_codes(keys, codes)
