"""AsyncEngine: the LLMEngine loop in one background thread, served to asyncio callers.

    event loop (server)                         engine thread
    -------------------                         -------------
    generate(req) --- ("add", req) ---> inbox   take inbox; apply adds/aborts/releases
      -> RequestStream (async iterator)
    abort(id)     --- ("abort", id) --> inbox   step() (schedule -> run -> update)
    stream closed --- ("abort_stream", ...)     (aborts only the request that stream added)
    release(id)   --- ("release", id) > inbox   deliver outputs:
    per-request asyncio.Queue <-- loop.call_soon_threadsafe(queue.put_nowait, output)

The thread sleeps on a condition when there is nothing to do or when the engine is blocked
(waiting requests need blocks that only an outside event can free), and wakes on any command.
allocate_blocks()/free_blocks() and the prefix lease calls go through the inbox too (applied
between two steps): no caller ever takes the engine lock, which a step holds throughout, so an
event loop is never stalled by one.

Blocks for a request, before it is added (the caller fills them outside the engine thread):

    decode role   await allocate_blocks(n) -> fill from P's handoff -> free_blocks(unfilled)
                  -> generate(preallocated_block_ids=filled, num_cached_tokens=0)
    pool tier     await acquire_prefix(tokens, k) -> PrefixLease(device hits + k fresh
                  blocks) -> fill extra blocks from the pool -> await trim_lease(lease, filled)
                  -> generate(preallocated_block_ids=lease.block_ids,
                              num_computed_tokens=num_cached_tokens=lease.num_computed_tokens)
                  or release_lease(lease) to give everything back

Failure policy: an exception in the engine thread fails every in-flight request with an error
(their streams raise EngineDeadError) and marks the engine dead; later calls raise at
once. Every wait is bounded: shutdown joins with a timeout, and a generate() that hears
nothing from the engine for output_timeout_s raises TimeoutError and aborts its request.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from workers.engine.api import EngineRequest, EngineStats, PrefixLease, RequestOutput
from workers.engine.engine import LLMEngine
from workers.engine.engine_call import EngineCall, undo_cancelled
from workers.engine.engine_config import EngineConfig
from workers.engine.request_stream import RequestStream, Stream

logger = logging.getLogger(__name__)
T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine thread failed or was shut down; no request can run on this engine."""


class AsyncEngine:
    """Thread-backed engine: generate() and the block/lease coroutines from asyncio;
    abort/release/free_blocks/release_lease post from any thread."""

    def __init__(
        self,
        engine: LLMEngine,
        idle_wait_s: float = 0.5,
        output_timeout_s: float = 300.0,
        shutdown_timeout_s: float = 10.0,
    ) -> None:
        self._engine = engine
        self._idle_wait_s = idle_wait_s
        self._output_timeout_s = output_timeout_s
        self._shutdown_timeout_s = shutdown_timeout_s
        # self._engine is touched by the engine thread only (commands go through the inbox).
        self._cond = threading.Condition()  # guards the fields below
        self._inbox: list[tuple[str, Any]] = []
        self._streams: dict[str, Stream] = {}
        # Engine thread only: the stream whose add the engine accepted, per live request id,
        # until its final output. A stream's own abort names it, so the abort of a stream the
        # engine refused (its id was still held by another) can never end the holder.
        self._added: dict[str, Stream] = {}
        self._stopping = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._stats = engine.stats()

    @classmethod
    def from_config(cls, config: EngineConfig, **kwargs: float) -> AsyncEngine:
        """Load the model, build the engine (not started: call start())."""
        return cls(LLMEngine.from_config(config), **kwargs)

    # ---- what the server reads ---------------------------------------------------------

    @property
    def tokenizer(self) -> Any:
        return self._engine.tokenizer

    @property
    def model_config(self) -> Any:
        return self._engine.model_config

    @property
    def engine_config(self) -> EngineConfig:
        return self._engine.config

    @property
    def kv_caches(self) -> Any:
        return self._engine.kv_caches

    @property
    def runner(self) -> Any:
        """The engine's runner (a TPRunner on a tensor-parallel worker's rank 0)."""
        return self._engine.runner

    @property
    def fingerprint(self) -> str:
        """The model fingerprint the device prefix cache hashes blocks with (= the pool's)."""
        return self._engine.fingerprint

    @property
    def grammars(self) -> Any:
        """The engine's Grammars: servers build each request's matcher with it (ready()), on
        their own threads; any thread may use it."""
        return self._engine.grammars

    @property
    def block_events(self) -> Any:
        """The device cache's BlockEventLog (None with caching off); any thread may read it."""
        return self._engine.pool.events

    @property
    def error(self) -> BaseException | None:
        """Why the engine died, or None while it is healthy."""
        return self._error

    def is_healthy(self) -> bool:
        thread = self._thread
        return self._error is None and thread is not None and thread.is_alive()

    def stats(self) -> EngineStats:
        """The snapshot taken after the latest step (no lock, never waits)."""
        return self._stats

    def validate(self, request: EngineRequest) -> None:
        """Raise ValueError with a client-facing message if request cannot run here."""
        self._engine.validate(request)

    # ---- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("AsyncEngine.start() called twice")
        self._thread = threading.Thread(target=self._run_loop, name="engine-loop", daemon=True)
        self._thread.start()

    def shutdown(self, timeout_s: float | None = None) -> bool:
        """Stop the thread (bounded wait) and fail in-flight requests; True if it stopped."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        stopped = True
        if self._thread is not None:
            self._thread.join(self._shutdown_timeout_s if timeout_s is None else timeout_s)
            stopped = not self._thread.is_alive()
            if not stopped:
                logger.warning("engine thread still in a step after the shutdown timeout")
        self._fail_all("the engine was shut down")
        self._engine.grammars.close()  # its compiler's child processes
        return stopped

    # ---- requests ----------------------------------------------------------------------

    def generate(self, request: EngineRequest) -> RequestStream:
        """Add request now and return the async iterator of its outputs.

        Raises ValueError for an invalid request or a live id, EngineDeadError if the engine
        failed or shut down; the caller then still owns request.preallocated_block_ids. Once
        generate() returns, the engine owns them, also if it refuses the request later (the
        stream raises ValueError and the engine frees them).
        Iterating the stream raises EngineDeadError if the engine dies and TimeoutError
        after output_timeout_s without an event; closing it, cancelling the iterating task
        or dropping the stream before the final output aborts the request.
        """
        self.validate(request)
        request_id = request.request_id
        stream = Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._cond:
            self._raise_if_dead()
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already being generated")
            self._streams[request_id] = stream
            self._inbox.append(("add", (request, stream)))
            self._cond.notify()
        return RequestStream(self._forget, request_id, stream, self._output_timeout_s)

    def abort(self, request_id: str) -> None:
        """Abort a request (before the next step); its stream, if any, ends with "abort"."""
        self._post("abort", request_id)

    def release(self, request_id: str) -> None:
        """Free the blocks of a finished prefill_only request (before the next step)."""
        self._post("release", request_id)

    # Block and lease calls go through the inbox, not the engine lock: the lock is held for
    # a whole step (tens to hundreds of ms on a GPU), and a coroutine that took it would stall
    # every stream and /health on its event loop for that long. The inbox is applied by the
    # engine thread between steps, in order with adds and aborts (a free posted before an
    # add is applied before it), and costs no thread of the default executor, which the pool
    # copies use. The ones with a result are coroutines, so a coroutine cannot take the lock
    # by mistake; the ones without (free_blocks, release_lease) only post and return.

    async def allocate_blocks(
        self, num_blocks: int, priority: int | None = None
    ) -> list[int] | None:
        """Blocks for a decode-role request to fill; None when no room (with its priority:
        after preempting less urgent running requests, LLMEngine.allocate_blocks). Applied
        between two steps; a caller cancelled meanwhile has the blocks freed for it."""
        block_ids = await self._call(
            lambda engine: engine.allocate_blocks(num_blocks, priority),
            undo=lambda ids: ids is not None and self.free_blocks(ids),
        )
        return None if block_ids is None else list(block_ids)

    def free_blocks(self, block_ids: Iterable[int]) -> None:
        """Give back blocks that were never handed to a request; applied before the next step.
        Returns at once (safe from any thread and from a sync callback)."""
        block_ids = list(block_ids)
        self._post("call", EngineCall(lambda engine: engine.free_blocks(block_ids)))

    async def acquire_prefix(
        self, token_ids: Sequence[int], max_extra_blocks: int, cache_scope: str | None = None
    ) -> PrefixLease | None:
        """The device-cached prefix of a sequence (under cache_scope), with references, plus up to
        max_extra_blocks fresh blocks after it to fill (positions before the last token
        only); None (nothing taken) when those do not fit. Applied between two steps; a
        caller cancelled meanwhile has the lease released for it."""
        tokens = tuple(token_ids)
        return await self._call(
            lambda engine: engine.acquire_prefix(tokens, max_extra_blocks, cache_scope),
            undo=lambda lease: lease is not None and self.release_lease(lease),
        )

    async def trim_lease(self, lease: PrefixLease, num_filled_blocks: int) -> PrefixLease:
        """Give back the lease's extra blocks after the first num_filled_blocks (the ones the
        pool could not fill); the rest of the lease. A caller cancelled meanwhile has the
        rest released for it."""
        return await self._call(
            lambda engine: engine.trim_lease(lease, num_filled_blocks),
            undo=self.release_lease,
            undo_unrun=lambda: self.release_lease(lease),
        )

    def release_lease(self, lease: PrefixLease) -> None:
        """Give back every block of a lease that no request took; applied before the next
        step. Returns at once (safe from any thread)."""
        self._post("call", EngineCall(lambda engine: engine.release_lease(lease)))

    async def _call(
        self,
        fn: Callable[[LLMEngine], T],
        undo: Callable[[T], object],
        undo_unrun: Callable[[], object] | None = None,
    ) -> T:
        """fn(engine) applied by the engine thread. A caller cancelled meanwhile leaves
        nothing behind: undo(result) is posted when fn had run, undo_unrun() when it never
        will (what the caller handed in goes back)."""
        call: EngineCall = EngineCall(fn, concurrent.futures.Future())
        self._post("call", call)
        try:
            return await asyncio.wrap_future(call.future)
        except asyncio.CancelledError:
            # Cancelling the wrapper cancels a call not yet applied; one already running
            # finishes, and what it took goes back.
            call.future.add_done_callback(lambda f: undo_cancelled(f, undo, undo_unrun))
            raise

    # ---- the engine thread -------------------------------------------------------------

    def _snapshot_stats(self) -> None:
        self._stats = self._engine.stats()

    def _post(self, kind: str, arg: Any) -> None:
        with self._cond:
            if kind == "call":
                self._raise_if_dead()
            self._inbox.append((kind, arg))
            self._cond.notify()

    def _forget(self, request_id: str, stream: Stream, abort: bool) -> None:
        """A RequestStream is done: stop delivering to it, abort the request if asked."""
        with self._cond:
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
        if abort:
            self._post("abort_stream", (request_id, stream))

    def _run_loop(self) -> None:
        can_progress = False
        try:
            while True:
                with self._cond:
                    if not self._inbox and not can_progress and not self._stopping:
                        self._cond.wait(self._idle_wait_s)
                    if self._stopping:
                        return
                    commands, self._inbox = self._inbox, []
                events = self._apply(commands)
                if self._engine.has_unfinished():
                    events.extend(self._engine.step())
                can_progress = (
                    self._engine.has_unfinished() and self._engine.last_step_num_tokens > 0
                )
                self._stats = self._engine.stats()
                self._deliver(events)
        except BaseException as exc:  # any failure must reach the waiters, not hang them
            logger.exception("engine thread failed")
            with self._cond:
                self._error = exc
            self._fail_all(f"the engine failed: {exc!r}")

    def _apply(self, commands: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
        events: list[tuple[str, Any]] = []
        for kind, arg in commands:
            if kind == "add":
                request, stream = arg
                try:
                    self._engine.add_request(request)
                except ValueError as exc:
                    self._engine.reclaim_blocks(request.preallocated_block_ids)
                    events.append((request.request_id, exc))
                else:
                    self._added[request.request_id] = stream
            elif kind == "abort_stream":
                request_id, stream = arg
                if self._added.get(request_id) is stream:
                    events.extend(self._abort(request_id))
            elif kind == "abort":
                events.extend(self._abort(arg))
            elif kind == "release":
                self._engine.release(arg)
            elif kind == "call":
                arg.run(self._engine, self._snapshot_stats)
        return events

    def _abort(self, request_id: str) -> list[RequestOutput]:
        self._added.pop(request_id, None)
        out = self._engine.abort(request_id)
        return [] if out is None else [out]

    def _deliver(self, events: list[Any]) -> None:
        for event in events:
            if isinstance(event, RequestOutput):
                request_id, item, final = event.request_id, event, event.ends_stream
            else:
                (request_id, item), final = event, True
            if final:
                self._added.pop(request_id, None)
            with self._cond:
                stream = self._streams.get(request_id)
                if stream is not None and final:
                    del self._streams[request_id]
            if stream is None:
                continue  # nobody listens any more (aborted or gone)
            try:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
            except RuntimeError:  # the caller's event loop is closed
                if not final:
                    self._post("abort", request_id)

    def _fail_all(self, message: str) -> None:
        with self._cond:
            streams, self._streams = self._streams, {}
            calls = [arg for kind, arg in self._inbox if kind == "call"]
            self._inbox = [(kind, arg) for kind, arg in self._inbox if kind != "call"]
        for call in calls:
            call.fail(EngineDeadError(message))
        for stream in streams.values():
            # One exception object per waiter: each raises it with its own traceback.
            # A closed event loop raises RuntimeError: nobody is waiting there.
            with contextlib.suppress(RuntimeError):
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, EngineDeadError(message))

    def _raise_if_dead(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"the engine failed: {self._error!r}")
        if self._stopping:
            raise EngineDeadError("the engine was shut down")
