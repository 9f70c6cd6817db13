"""The answer of one request, through P and D: one flow, or one per sequence, merged.

    plain request            prefill() -> Answers.stream | Answers.complete   (as before)
    several sequences        sub-requests (pdrouter.wire.choices.sub_bodies), one per
    (batch, n, best_of,      sequence, each answered as a plain request, all at once, then
     echo, max_tokens 0)     complete: the answers merged; stream: chunks relayed as they
                             come, each with its choice's index, usage and [DONE] at the end

A prompt's n (or best_of) sequences without echo (ChoicePlan.forks) are one group: ONE
prefill (the group's body, pdrouter.wire.choices.group_bodies: P computes the prompt once
and samples every sequence's first token) and ONE decode on one D (orchestrator.group_decode:
D loads the prompt once, forks the sequences and decodes them in one batch); each sequence's
sub-request answers from its own view of P's result (its first token) and its own share of
D's events (orchestrator.sub_answers.SequenceAnswers). A request of one prompt keeps its
context for the group (its id, its early decode prefetch, its timeline); a batch's groups
get their own.

Echoed sequences run as sub-requests of their own: a prompt's first sequence goes first; its
others start once P has answered it, when its full blocks are in P's device prefix cache and
the pool (each echoed sequence computes its prompt whole, for its logprobs). Such a
sub-request is the plain flow under its own id (`<request id>-<k>`; its calls are made by
its own task, so a call abandoned on a dead worker fails that sub-request's attempt and is
retried as any), with P's echo (PrefillResult.echo) applied to its answer
(pdrouter.wire.scoring), P then D in the usual order (no early decode prefetch). The mixed
worker runs the same sub-requests and groups (workers.server.choices): PD equals mixed
choice for choice. The request's timeline shows its accept and end, and its first token
(TTFT, first_token_sent: the first of any sub-request's, once: orchestrator.sub_answers).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Coroutine
from typing import Any, TypeVar

from pdrouter.router.orchestrator.answer import Answers
from pdrouter.router.orchestrator.attempts import Hop
from pdrouter.router.orchestrator.context import RequestContext
from pdrouter.router.orchestrator.group_decode import GroupDecode
from pdrouter.router.orchestrator.prefill import prefill
from pdrouter.router.orchestrator.sub_answers import (
    Firsts,
    SequenceAnswers,
    SubAnswers,
    sequence_result,
)
from pdrouter.wire.choices import (
    ChoicePlan,
    StreamMerge,
    group_bodies,
    merge_responses,
    sub_bodies,
)
from pdrouter.wire.pd import LocalPrefill, PrefillResult
from pdrouter.wire.responses import SSE_DONE
from pdrouter.wire.scoring import Scoring, scored

T = TypeVar("T")


class Flow:
    """How RouterService.serve answers one request (plan: None for a plain request, which
    answers through answers alone: the group state below is a grouped request's only)."""

    # Each prompt's first sequence (its sub-request), set once P answered it.
    prefilled: dict[int, asyncio.Event]
    # A forked prompt's group, by prompt: P's result and D's decode, made once.
    groups: dict[int, asyncio.Future[tuple[PrefillResult, GroupDecode]]]
    group_ctxs: list[RequestContext]
    firsts: Firsts  # the request's first and second tokens, counted once
    sub_answers: SubAnswers
    body: dict[str, Any]  # the client's body, parsed once for its sub-requests and groups
    group_bodies: list[dict[str, Any]]  # each forked prompt's (none without forks)

    def __init__(
        self,
        hop: Hop,
        answers: Answers,
        ctx: RequestContext,
        local_prefill_below_tokens: int,
        plan: ChoicePlan | None,
    ) -> None:
        self.hop = hop
        self.answers = answers
        self.ctx = ctx
        self.local_below = local_prefill_below_tokens
        self.plan = plan
        if plan is not None:
            self._grouped(plan)

    def _grouped(self, plan: ChoicePlan) -> None:
        """The state of a request of several sequences (a plain request makes none)."""
        m = plan.num_sequences_per_prompt
        self.prefilled = (
            {i * m: asyncio.Event() for i in range(plan.num_prompts)}
            if m > 1 and not plan.forks
            else {}
        )
        self.groups = {}
        self.group_ctxs = []
        self.firsts = Firsts(self.ctx)
        self.sub_answers = SubAnswers(self.answers, self.firsts)
        self.body = json.loads(self.ctx.body)
        self.group_bodies = group_bodies(self.body, plan) if plan.forks else []

    def _group(self, i: int) -> asyncio.Future[tuple[PrefillResult, GroupDecode]]:
        """Prompt i's group: its one prefill, started by its first sequence to ask."""
        if i not in self.groups:
            self.groups[i] = asyncio.ensure_future(self._group_prefill(i))
        return self.groups[i]

    async def _group_prefill(self, i: int) -> tuple[PrefillResult, GroupDecode]:
        assert self.plan is not None
        ctx = self.ctx
        body = self.group_bodies[i]
        own = self.plan.num_prompts == 1  # the request's context, its prefetch included
        group = dataclasses.replace(
            ctx,
            request_id=ctx.request_id if own else f"{ctx.request_id}-g{i}",
            prompt_index=i,
            prompt_tokens_estimate=self._prompt_estimate(),
            task=None,
            body=json.dumps(body, separators=(",", ":")).encode(),
            timeline=ctx.timeline if own else None,
            prefetch=ctx.prefetch if own else None,
            decode_urls=[],
            _frame=None,
        )
        self.group_ctxs.append(group)
        result = await prefill(self.hop, group, 0)  # a group is never left to D
        if not isinstance(result, PrefillResult):
            raise RuntimeError(f"P answered {type(result).__name__} for a group")
        return result, GroupDecode(
            self.answers.decode, group, result, self.answers.missing_kv_policy
        )

    def _answers(self, k: int) -> Answers:
        """Sub-request k's answers: a forked sequence's read its group's decode."""
        plan = self.plan
        assert plan is not None  # only a request with a plan has sub-requests
        if not plan.forks:
            return self.sub_answers
        _, decode = self.groups[plan.prompt_of(k)].result()
        return SequenceAnswers(self.answers, self.firsts, decode, k % plan.num_sequences_per_prompt)

    async def _close_groups(self) -> None:
        for future in self.groups.values():
            future.cancel()
            if future.done() and not future.cancelled() and future.exception() is None:
                await future.result()[1].close()

    async def _prefill(self, k: int, sub: RequestContext) -> PrefillResult | LocalPrefill:
        """Sub-request k's prefill, after its prompt's first sequence's (k itself if first);
        a forked sequence's: its view of its group's."""
        assert self.plan is not None
        if self.plan.forks:
            result, decode = await asyncio.shield(self._group(self.plan.prompt_of(k)))
            own = decode.first_tokens[k % self.plan.num_sequences_per_prompt]
            return sequence_result(result, own)
        first = k - k % self.plan.num_sequences_per_prompt
        if first != k and first in self.prefilled:
            await self.prefilled[first].wait()
        try:
            return await prefill(self.hop, sub, self.local_below)
        finally:
            if k in self.prefilled:
                self.prefilled[k].set()

    async def stream(self) -> AsyncGenerator[bytes]:
        """The answer's SSE parts (prefill done first for a plain request)."""
        if self.plan is None:
            result = await prefill(self.hop, self.ctx, self.local_below)
            return self.answers.stream(self.ctx, result)  # type: ignore[return-value]
        return self._merged_stream(self.plan)

    async def complete(self) -> dict[str, Any]:
        if self.plan is None:
            result = await prefill(self.hop, self.ctx, self.local_below)
            return await self.answers.complete(self.ctx, result)
        plan = self.plan
        subs = self._sub_contexts(plan)
        try:
            coros = [self._complete_one(k, sub) for k, sub in enumerate(subs)]
            answers = await _all_or_none(coros)
        finally:
            await self._close_groups()
        merged = merge_responses(answers, plan)
        frame = self.ctx.frame()
        merged["id"], merged["created"] = frame.response_id, frame.created
        self._answered(subs, merged["usage"])
        return merged

    def _sub_contexts(self, plan: ChoicePlan) -> list[RequestContext]:
        ctx = self.ctx
        bodies = sub_bodies(self.body, plan)
        return [
            dataclasses.replace(
                ctx,
                request_id=f"{ctx.request_id}-{k}",
                prompt_index=plan.prompt_of(k),
                prompt_tokens_estimate=self._prompt_estimate(),
                include_usage=True,
                task=None,
                body=json.dumps(body, separators=(",", ":")).encode(),
                timeline=None,
                prefetch=None,
                decode_urls=[],
                _frame=None,
            )
            for k, body in enumerate(bodies)
        ]

    def _prompt_estimate(self) -> int:
        """A sub-request's (or group's) share of the request's prompt estimate: the load its
        prefill call holds on P (the whole batch's, held once per call, filled P's token
        bound with a batch it could hold)."""
        assert self.plan is not None
        return max(1, self.ctx.prompt_tokens_estimate // self.plan.num_prompts)

    def _scoring(self, result: PrefillResult | LocalPrefill) -> Scoring | None:
        plan = self.plan
        if plan is None or not (plan.echo or plan.score_only):
            return None
        echoed = result.echo if isinstance(result, PrefillResult) and plan.echo else None
        return Scoring(echoed, plan.score_only)

    async def _complete_one(self, k: int, sub: RequestContext) -> dict[str, Any]:
        result = await self._prefill(k, sub)
        answer = await self._answers(k).complete(sub, result)
        scoring = self._scoring(result)
        return answer if scoring is None else scoring.response(answer)

    def _answered(self, subs: list[RequestContext], usage: dict[str, Any]) -> None:
        """The request's answer is complete: its counts, for its end (the service's)."""
        firsts = [s.first_token_s for s in subs if s.first_token_s]
        self.ctx.prefill_url = subs[0].prefill_url
        self.ctx.decode_urls = [url for s in (*self.group_ctxs, *subs) for url in s.decode_urls]
        if self.group_ctxs:
            self.ctx.prefill_url = self.group_ctxs[0].prefill_url
        self.ctx.answered(
            usage["prompt_tokens"],
            usage["completion_tokens"],
            min(firsts, default=time.monotonic()),
            time.monotonic(),
        )
        self.ctx.num_sequence_tokens = max(s.num_output_tokens for s in subs)

    async def _pump(
        self, k: int, sub: RequestContext, queue: asyncio.Queue[tuple[int, Any]]
    ) -> None:
        """One sub-request's stream into the queue: its parts, then None (or its error)."""
        try:
            result = await self._prefill(k, sub)
            scoring = self._scoring(result)
            ended = False
            async with contextlib.aclosing(self._answers(k).stream(sub, result)) as parts:
                async for part in parts:  # read to its end: D's connection goes back
                    if not ended:
                        await queue.put((k, scored(scoring, part)))
                    if part.endswith(SSE_DONE) and not ended:
                        ended = True
                        await queue.put((k, None))
        except Exception as exc:
            await queue.put((k, exc))

    async def _merged_stream(self, plan: ChoicePlan) -> AsyncIterator[bytes]:
        subs = self._sub_contexts(plan)
        frame = self.ctx.frame()
        merge = StreamMerge(plan, frame.response_id, frame.created)
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        tasks = [asyncio.ensure_future(self._pump(k, sub, queue)) for k, sub in enumerate(subs)]
        try:
            open_streams = len(tasks)
            while open_streams:
                k, part = await queue.get()
                if isinstance(part, Exception):
                    raise part
                if part is None:
                    open_streams -= 1
                    continue
                if out := merge.part(k, part):
                    yield out
            self._answered(subs, merge.usage())
            yield (merge.usage_event() if plan.include_usage else b"") + SSE_DONE
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._close_groups()


async def _all_or_none(coros: list[Coroutine[Any, Any, T]]) -> list[T]:
    """Every result, or the first error with the others cancelled."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
