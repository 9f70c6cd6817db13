"""SwapIns: the scheduler's swap-ins under way (host tier -> device), at most one per request.

    start   a request whose cached run goes on in the host tier takes its device hits, then
            fresh blocks for the host run, and their copy starts (PrefixCache.start_swap_in,
            one H2D call on the copier's own stream or thread); the request stays waiting,
            holding its blocks, and admission passes it by
    land    each schedule() finishes the copies that completed: the blocks become computed
            and cached, and the request is admitted like one that holds computed blocks.
            When nothing else would run, schedule() waits for the copies instead of
            returning an empty batch (the engine would sleep with work in flight)
    finish  an abort (or any removal) of a request mid-copy waits for its copy before its
            blocks are freed: no block goes back while a copy writes it

So other requests' steps run while a swap-in copies (on a GPU the kernel reads the pinned host
memory beside the model's stream; on the CPU a helper thread copies), and no step reads a
swapped block before its copy landed. A request whose swap-in failed computes those blocks
and is not swapped in again (a copy that fails once would fail again).
"""

from __future__ import annotations

from workers.engine.host_tier import PendingRead
from workers.engine.prefix_cache import PrefixCache
from workers.engine.request_state import RequestState


class SwapIns:
    """Swap-ins started and not yet landed, by request id."""

    def __init__(self, cache: PrefixCache) -> None:
        self._cache = cache
        self._pending: dict[str, tuple[RequestState, PendingRead]] = {}
        self._failed: set[str] = set()  # requests that compute their host run instead

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._pending

    def __bool__(self) -> bool:
        return bool(self._pending)

    def start(self, state: RequestState, num_host_blocks: int) -> bool:
        """Start state's swap-in of num_host_blocks; False if none started (no room, a copy
        that could not start, or one that failed before for this request)."""
        if state.request_id in self._failed:
            return False
        pending = self._cache.start_swap_in(state, num_host_blocks)
        if pending is None:
            return False
        self._pending[state.request_id] = (state, pending)
        return True

    def land(self, wait: bool) -> None:
        """Finish the swap-ins whose copy completed (every one, waiting, with wait)."""
        for request_id, (state, pending) in list(self._pending.items()):
            if wait or pending.handle.done():
                del self._pending[request_id]
                self._finish(state, pending)

    def finish(self, state: RequestState) -> None:
        """Before state's blocks are freed: its copy, if one is under way, waited for and
        finished; the request forgotten."""
        entry = self._pending.pop(state.request_id, None)
        if entry is not None:
            self._finish(*entry)
        self._failed.discard(state.request_id)

    def _finish(self, state: RequestState, pending: PendingRead) -> None:
        num_blocks = self._cache.finish_swap_in(state, pending)
        if num_blocks == 0:
            self._failed.add(state.request_id)
        elif state.num_cached_tokens is None:  # first scheduled: a host hit of its own
            state.num_host_cached_tokens += num_blocks * self._cache.block_size
