"""Completion of one swap_cache_layout call.

The CUDA path is asynchronous on the caller's stream; the handle lets the caller wait for (or
poll) exactly this call, and keeps the call's small index buffer alive until then.
"""

from __future__ import annotations

from typing import Any


class SwapHandle:
    """A finished swap (the CPU path copies synchronously). Subclasses track GPU work."""

    def done(self) -> bool:
        """True once every byte of this call has landed."""
        return True

    def wait(self) -> None:
        """Block the calling thread until every byte of this call has landed."""


class CudaSwapHandle(SwapHandle):
    """A swap queued on a CUDA stream, completed when its event fires."""

    def __init__(self, event: Any, keepalive: tuple[object, ...]) -> None:
        self._event = event
        # The device copy of block ids/slots/layer addresses: freed (back to CuPy's
        # stream-ordered pool) only when this handle goes, never while the kernel may read it.
        self._keepalive: tuple[object, ...] | None = keepalive

    @property
    def event(self) -> Any:
        """The cupy.cuda.Event recorded after the kernel (for stream.wait_event)."""
        return self._event

    def done(self) -> bool:
        finished = bool(self._event.done)
        if finished:
            self._keepalive = None
        return finished

    def wait(self) -> None:
        self._event.synchronize()
        self._keepalive = None
