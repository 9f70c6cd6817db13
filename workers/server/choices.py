"""A mixed worker's requests of several sequences (pdrouter.wire.choices): batched prompts,
n > 1, best_of, echo and max_tokens 0.

    parsed request -> plan_choices -> sub_bodies -> each parsed and prepared (all admitted
    before any runs)
        complete: every sub-request's answer, merged (merge_responses)
        stream:   every sub-stream read at once, chunks relayed as they come (StreamMerge)

Each sub-request is an ordinary request of one prompt and one choice to OpenAIService, so it
is admitted, counted, aborted on a disconnect and rewritten for echo exactly as one; the
router runs the same sub-requests through P and D (pdrouter.router.orchestrator.choices).
A prompt's n (or best_of) sequences without echo (ChoicePlan.forks) run on the engine as ONE
request of that many sequences (workers.server.group_streams): its prompt computed once, the
sequences forked and decoded in one batch, each with its sub-request's seed, so the answer is
the one the separate sub-requests would give; it counts as one request in the worker's
metrics, its prompt once (its later sequences add their generated tokens alone). Echoed
sequences run as separate requests, a prompt's first one first; the others join the engine
once its first token is out and take its full blocks from the device prefix cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pdrouter.wire.choices import ChoicePlan, StreamMerge, merge_responses, sub_bodies
from pdrouter.wire.errors import bad_request
from pdrouter.wire.openai import ChatCompletionRequest, CompletionRequest, parse_request
from pdrouter.wire.responses import SSE_DONE
from workers.server.group_streams import GroupStreams
from workers.server.openai_service import OpenAIService
from workers.server.prepare import PreparedRequest


@dataclass(frozen=True)
class PreparedChoices:
    """A request's sub-requests, prepared and admitted, and the GroupStreams of each prompt
    whose sequences fork (none unless ChoicePlan.forks), built once, by prepare_all."""

    requests: tuple[PreparedRequest, ...]
    groups: tuple[GroupStreams, ...]


async def prepare_all(
    service: OpenAIService,
    parsed: CompletionRequest | ChatCompletionRequest,
    plan: ChoicePlan,
    body: bytes,
    request_id: str,
    tenant: str | None,
) -> PreparedChoices:
    """Every sub-request prepared and admitted, or none (a refusal releases the others)."""
    request_cls = type(parsed)
    prepared: list[PreparedRequest] = []
    try:
        for sub, sub_body in enumerate(sub_bodies(json.loads(body), plan)):
            one = parse_request(request_cls, json.dumps(sub_body).encode())
            prepared.append(await service.prepare(one, f"{request_id}-{sub}", tenant))
        groups = _groups(service, plan, prepared)
        for group in groups:
            request = group.request()
            try:
                service.engine.validate(request)
            except ValueError as exc:
                raise bad_request(str(exc)) from None
            group.readied = await service.ready(request)  # once, for all its sequences
    except BaseException:
        for one in prepared:
            service.forget(one)
        raise
    return PreparedChoices(tuple(prepared), groups)


async def complete_all(
    service: OpenAIService,
    plan: ChoicePlan,
    choices: PreparedChoices,
    wait_disconnect: Callable[[], Awaitable[Any]],
) -> dict[str, Any] | None:
    """The merged answer; None when the client went away (every sub-request aborted)."""
    gone = asyncio.ensure_future(wait_disconnect())
    firsts = _first_tokens(plan)
    prepared, services = choices.requests, _services(service, plan, choices)

    async def one_of(sub: int, one: PreparedRequest) -> dict[str, Any] | None:
        await _after_first(plan, firsts, sub)
        try:
            return await services[sub].complete(one, lambda: asyncio.shield(gone), firsts.get(sub))
        finally:
            _release(firsts, sub)

    tasks = [asyncio.ensure_future(one_of(sub, one)) for sub, one in enumerate(prepared)]
    try:
        answers = await asyncio.gather(*tasks)
    finally:
        for task in (*tasks, gone):
            task.cancel()
        await asyncio.gather(*tasks, gone, return_exceptions=True)
        await _close(choices.groups)
    if any(answer is None for answer in answers):
        return None
    merged = merge_responses(list(answers), plan)  # type: ignore[arg-type]
    merged["id"] = service.builder(prepared[0]).response_id.rsplit("-", 1)[0]
    return merged


async def stream_all(
    service: OpenAIService, plan: ChoicePlan, choices: PreparedChoices, request_id: str
) -> AsyncIterator[bytes]:
    """The merged SSE stream; closing it closes (aborts) every sub-stream."""
    prepared = choices.requests
    frame = service.builder(prepared[0])
    merge = StreamMerge(plan, frame.response_id.rsplit("-", 1)[0], frame.created)
    queue: asyncio.Queue[tuple[int, bytes | None]] = asyncio.Queue()
    firsts = _first_tokens(plan)
    services = _services(service, plan, choices)

    async def pump(sub: int, one: PreparedRequest) -> None:
        await _after_first(plan, firsts, sub)
        try:
            async with contextlib.aclosing(services[sub].stream(one, firsts.get(sub))) as parts:
                async for part in parts:
                    await queue.put((sub, part))
        finally:
            _release(firsts, sub)
        await queue.put((sub, None))

    tasks = [asyncio.ensure_future(pump(sub, one)) for sub, one in enumerate(prepared)]
    try:
        open_streams = len(tasks)
        while open_streams:
            sub, part = await queue.get()
            if part is None:
                open_streams -= 1
                continue
            if out := merge.part(sub, part):
                yield out
            if merge.error is not None:  # in-band: the 200 is out
                yield merge.error + SSE_DONE
                return
        if plan.include_usage:
            yield merge.usage_event()
        yield SSE_DONE
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for one in prepared:
            service.forget(one)
        await _close(choices.groups)


def _services(
    service: OpenAIService, plan: ChoicePlan, choices: PreparedChoices
) -> list[OpenAIService]:
    """The service each sub-request runs on: for the sequences of a prompt that fork as one
    group, the service over that group's GroupStreams; else the service itself."""
    prepared = choices.requests
    if not choices.groups:
        return [service] * len(prepared)
    m = plan.num_sequences_per_prompt
    views = [
        service.over(group, [one.request_id for one in prepared[i * m + 1 : (i + 1) * m]])
        for i, group in enumerate(choices.groups)
    ]
    return [views[plan.prompt_of(sub)] for sub in range(len(prepared))]


def _groups(
    service: OpenAIService, plan: ChoicePlan, prepared: list[PreparedRequest]
) -> tuple[GroupStreams, ...]:
    """A GroupStreams per prompt whose sequences fork (none unless ChoicePlan.forks)."""
    if not plan.forks:
        return ()
    m = plan.num_sequences_per_prompt
    return tuple(
        GroupStreams(service.engine, prepared[i * m : (i + 1) * m]) for i in range(plan.num_prompts)
    )


async def _close(groups: tuple[GroupStreams, ...]) -> None:
    for group in groups:
        await group.close()


def _first_tokens(plan: ChoicePlan) -> dict[int, asyncio.Event]:
    """The event of each prompt's first sequence (by sub-request), set at its first token;
    none for forked groups (their prompt is computed once by construction)."""
    m = plan.num_sequences_per_prompt
    if m == 1 or plan.forks:
        return {}
    return {i * m: asyncio.Event() for i in range(plan.num_prompts)}


async def _after_first(plan: ChoicePlan, firsts: dict[int, asyncio.Event], sub: int) -> None:
    """Wait, for a prompt's later sequences, until its first one has its first token."""
    first = sub - sub % plan.num_sequences_per_prompt
    if first != sub and first in firsts:
        await firsts[first].wait()


def _release(firsts: dict[int, asyncio.Event], sub: int) -> None:
    """A first sequence that ended (even without a token) lets its prompt's others go."""
    if sub in firsts:
        firsts[sub].set()
