"""One engine request of n sequences, read as n streams: how a mixed worker serves n > 1 and
best_of with the prompt computed once (workers/engine/sequence_group.py).

    sub-requests <id>-<k> .. <id>-<k+m-1> of one prompt (pdrouter.wire.choices.sub_bodies)
        each run by OpenAIService over a GroupStreams as its engine:
        the first generate() adds ONE engine request (id <id>-<k>, one seed per sequence:
        each sub-request's own) and starts a reader that hands each event to the stream of
        its sequence's sub-request; every generate() returns that sub-request's stream

A sub-request's stream ends at its sequence's final event. abort() of any sub-request ends
the whole group (the service aborts only when the client went away or the engine failed,
and then every sub-request of the answer goes with it).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Sequence
from typing import Any

from workers.engine.api import EngineRequest, EngineStats, RequestOutput
from workers.server.prepare import PreparedRequest

_END = None  # the group's stream ended without this sequence's final event (an abort)


class GroupStreams:
    """An engine for the sub-requests of one prompt's sequences (the ServingEngine shape)."""

    def __init__(self, engine: Any, members: Sequence[PreparedRequest]):
        """members: the sub-requests of the prompt's sequences, sequence 0's first."""
        self._engine = engine
        self._first = members[0]
        self._member_ids = [one.request_id for one in members]
        self._seeds = tuple(one.params.seed for one in members)
        self._queues: dict[str, asyncio.Queue[Any]] = {m: asyncio.Queue() for m in self._member_ids}
        self._reader: asyncio.Task[None] | None = None
        # The group's request with its grammar state, built once by choices.prepare_all.
        self.readied: EngineRequest | None = None

    @property
    def tokenizer(self) -> Any:
        return self._engine.tokenizer

    @property
    def group_id(self) -> str:
        return self._member_ids[0]

    def validate(self, request: EngineRequest) -> None:
        self._engine.validate(request)

    def stats(self) -> EngineStats:
        return self._engine.stats()

    def is_healthy(self) -> bool:
        return self._engine.is_healthy()

    def abort(self, request_id: str) -> None:
        del request_id  # any sequence's abort is the group's
        self._engine.abort(self.group_id)

    def request(self) -> EngineRequest:
        """The group's engine request (before grammar state: what validate() checks)."""
        return self._group(self._first.engine_request())

    @property
    def grammars(self) -> GroupStreams:
        """What with_matcher (workers.server.structured) readies a sub-request with: this
        view, whose ready() hands out the group's matchers."""
        return self

    def ready(self, request: EngineRequest) -> EngineRequest:
        """A constrained sub-request with its group's matchers (one per sequence: the group
        runs as one engine request), built before the group started (readied)."""
        assert self.readied is not None, "choices.prepare_all readies every group"
        readied = self.readied
        return dataclasses.replace(
            request, matcher=readied.matcher, sequence_matchers=readied.sequence_matchers
        )

    def _group(self, request: EngineRequest) -> EngineRequest:
        """A sub-request's engine request as its group's: the group's id, every seed."""
        return dataclasses.replace(request, request_id=self.group_id, sequence_seeds=self._seeds)

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """The stream of request's sequence; the group is added on the first call."""
        if self._reader is None:
            stream = self._engine.generate(self._group(request))
            self._reader = asyncio.ensure_future(self._read(stream))
        return self._member(self._queues[request.request_id])

    async def close(self) -> None:
        """Stop reading (the group was aborted or every sequence ended)."""
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader

    async def _read(self, stream: Any) -> None:
        try:
            async with contextlib.aclosing(stream) as outputs:
                async for out in outputs:
                    self._queues[self._member_ids[out.sequence_index]].put_nowait(out)
        except Exception as exc:  # the engine's failure is every sequence's
            for queue in self._queues.values():
                queue.put_nowait(exc)
            return
        for queue in self._queues.values():
            queue.put_nowait(_END)

    @staticmethod
    async def _member(queue: asyncio.Queue[Any]) -> AsyncIterator[RequestOutput]:
        while True:
            item = await queue.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finished:
                return
