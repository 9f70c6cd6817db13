"""Server-sent events as a client reads them, through httpx-sse: the suite's one SSE parser.

    resp = httpx.post(url, json={..., "stream": True})
    data = sse_data(resp)                    # ['{"id": ...}', ..., '[DONE]']
    text = "".join(chunk_texts(data))        # the streamed answer

Tests that check the exact bytes a server writes (the serializers' own tests) compare bytes
instead; everything that reads a stream as a client would goes through here.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator

import httpx
from httpx_sse import EventSource

DONE = "[DONE]"


def sse_data(source: httpx.Response | str | bytes) -> list[str]:
    """The data of every event of a complete SSE body: a response read whole, or its text."""
    if not isinstance(source, httpx.Response):
        raw = source.encode() if isinstance(source, str) else source
        source = httpx.Response(200, content=raw, headers={"content-type": "text/event-stream"})
    return [event.data for event in EventSource(source).iter_sse()]


def iter_sse_data(resp: httpx.Response) -> Iterator[str]:
    """Each event's data as it arrives on a streamed response (httpx.stream)."""
    for event in EventSource(resp).iter_sse():
        yield event.data


async def aiter_sse_data(resp: httpx.Response) -> AsyncIterator[str]:
    """Each event's data as it arrives on a streamed response (AsyncClient.stream)."""
    async for event in EventSource(resp).aiter_sse():
        yield event.data


def chunk_texts(data: list[str]) -> list[str]:
    """The text of each OpenAI chunk (a chat delta's content or a completion's text), in
    order; [DONE], usage-only chunks and error events carry none and are skipped."""
    texts = []
    for item in data:
        if item == DONE:
            continue
        choices = json.loads(item).get("choices")
        if not choices:
            continue
        choice = choices[0]
        texts.append(
            (choice["delta"].get("content") or "") if "delta" in choice else choice["text"]
        )
    return texts
