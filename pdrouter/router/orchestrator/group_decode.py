"""A group's decode: the sequences of one prompt (ChoicePlan.forks) decoded by one D as one
request, its events split into one stream per sequence.

    router ─► D  POST /internal/decode {..., output_token_ids: sequence 0's,
                                        sequences: [{index, output_token_ids}, ...]}
             ◄── DecodeEvent stream: each event names its sequence (index); a sequence's
                 final event says whether others go on (more); the last one ends the stream

The sequences sent are those P's first token did not end. Each sequence's answer reads its
own stream (GroupDecode.events), as a plain request reads decode_events. A D that fails
before its first event is replaced by another (a retry); one that fails after some events is
replaced by another D that resumes the group's unfinished sequences, each after every token
the client already has of it (a failover; a single one left resumes as a plain request with
its sequence's seed). Closing the group (GroupDecode.close) ends the call, and D aborts the
request: every sequence's blocks go back.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from pdrouter.router.orchestrator.attempts import Hop
from pdrouter.router.orchestrator.context import RequestContext
from pdrouter.router.orchestrator.decode import attempted_events
from pdrouter.router.upstream.decode_stream import BadEvent
from pdrouter.router.upstream.token_events import OutputIds
from pdrouter.wire.pd import (
    DecodeEvent,
    DecodeSequence,
    MissingKVPolicy,
    PrefillResult,
    decode_request_json,
)


class GroupDecode:
    """One decode call for a prompt's sequences still going on, read as one stream each."""

    def __init__(
        self,
        hop: Hop,
        ctx: RequestContext,
        result: PrefillResult,
        missing_kv_policy: MissingKVPolicy | None,
    ) -> None:
        self.hop = hop
        self.ctx = ctx
        self.result = result
        self.policy = missing_kv_policy
        self.first_tokens = result.first_tokens()  # every sequence's, made once
        # Each sequence still going on: the tokens the client has of it.
        self.outputs = {
            j: OutputIds([t.token_id])
            for j, t in enumerate(self.first_tokens)
            if t.finish_reason is None
        }
        self._queues: dict[int, asyncio.Queue[list[DecodeEvent] | BaseException]] = {
            j: asyncio.Queue() for j in self.outputs
        }
        self._task: asyncio.Task[None] | None = None

    def events(self, index: int) -> AsyncIterator[list[DecodeEvent]]:
        """Sequence index's events in batches, up to its final one; the call starts with the
        first sequence that asks."""
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())
        return self._sequence(self._queues[index])

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    @staticmethod
    async def _sequence(
        queue: asyncio.Queue[list[DecodeEvent] | BaseException],
    ) -> AsyncIterator[list[DecodeEvent]]:
        while True:
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item[-1].finished:
                return

    async def _run(self) -> None:
        try:
            async for batch in self._batches():
                by_index: dict[int, list[DecodeEvent]] = {}
                for ev in batch:
                    by_index.setdefault(ev.index, []).append(ev)
                for index, events in by_index.items():
                    self._queues[index].put_nowait(events)
        except Exception as exc:  # the group's failure is every unfinished sequence's
            for queue in self._queues.values():
                queue.put_nowait(exc)

    def _payload(self) -> bytes:
        ctx, result = self.ctx, self.result
        live = [
            DecodeSequence(index=j, output_token_ids=ids.ids()) for j, ids in self.outputs.items()
        ]
        return decode_request_json(
            ctx.request_id,
            ctx.endpoint,
            ctx.body,
            result.prompt_token_ids,
            live[0].output_token_ids,
            result.kv,
            self.policy,
            ctx.cache_scope,
            live,
        )

    def _batches(self) -> AsyncIterator[list[DecodeEvent]]:
        """D's events of the group: the decode stage's attempts over its sequences."""
        num_prompt = len(self.result.prompt_token_ids)
        num_tokens = num_prompt + self.ctx.max_output_tokens * len(self.outputs)
        return attempted_events(
            self.hop, self.ctx, self.result, self._payload, self._advance, num_tokens
        )

    def _advance(self, ev: DecodeEvent) -> None:
        """A sequence's tokens so far (what a failover resumes from); a finished one is
        not sent again."""
        if ev.index not in self.outputs:
            raise BadEvent(f"an event of sequence {ev.index}, which is not decoding")
        if ev.finished:
            del self.outputs[ev.index]
        else:
            self.outputs[ev.index].add(ev)
