"""`POST /v1/responses` on the router and on every worker, served by the chat route itself.

Pure ASGI, in front of a server's chat completions handler (the router's RouterService for
the endpoint "chat", a worker's app):

    client --Responses body--> ResponsesRoute --chat body--> chat handler (PD, or the engine)
    client <--Response / events-- ResponsesRoute <--chat answer / chunks--

The body is read within the server's bound, parsed (pdrouter.wire.responses_api: a 400 naming
the field) and handed to the chat handler as a chat completions request on the same
connection: every check, the API key, admission, PD, retries and failover are the chat path's
own. Its answer is written back as a Response (pdrouter.wire.responses_output): the JSON
answer whole, a stream event by event as its chunks arrive. An error answer keeps its status
and OpenAI body, its param named as the Responses request names it (messages -> input).
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from pdrouter.common.body_limit import BodyLimit, declared_length, read_body, replaying
from pdrouter.common.error_mapping import api_error
from pdrouter.wire.errors import APIError
from pdrouter.wire.responses_api import (
    RESPONSES_PATH,
    ResponsesRequest,
    parse_responses_request,
    to_chat_body,
)
from pdrouter.wire.responses_output import ResponseEvents, new_response_id, response_from_chat

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Message, Receive, Send], Awaitable[None]]

CHAT_PATH = "/v1/chat/completions"
# A chat error's param -> the Responses request's name for it (prefixes: messages[2] -> input)
_PARAMS = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
}


class ResponsesRoute:
    """Serves POST /v1/responses through chat (an ASGI app taking the chat request)."""

    def __init__(self, chat: ASGIApp, body_limit: Callable[[], BodyLimit]) -> None:
        self.chat = chat
        self.body_limit = body_limit

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        try:
            if scope["method"] != "POST":
                raise APIError(
                    405,
                    f"method {scope['method'][:16]} not allowed on /v1/responses",
                    "invalid_request_error",
                    extra_headers={"Allow": "POST"},
                )
            raw = await read_body(receive, self.body_limit(), declared_length(scope))
            request = parse_responses_request(raw)
            body = json.dumps(to_chat_body(request), ensure_ascii=False).encode()
        except Exception as exc:  # a 400 naming the field, or a 500 logged here
            error = api_error(exc, "server", "POST /v1/responses")
            if error.status != 499:  # a client that left gets nothing
                await _send_error(send, error)
            return
        headers = [(k, v) for k, v in scope["headers"] if k != b"content-length"]
        chat_scope = {
            **scope,
            "path": CHAT_PATH,
            "raw_path": CHAT_PATH.encode(),
            "headers": [*headers, (b"content-length", str(len(body)).encode())],
        }
        # After the body, the chat handler's receive is the client's (its disconnect).
        await self.chat(chat_scope, replaying(body, receive), _Answer(send, request).send)


async def _send_error(send: Send, exc: APIError) -> None:
    body = json.dumps(exc.body()).encode()
    headers = [(k.lower().encode(), v.encode()) for k, v in exc.headers().items()]
    await send(
        {
            "type": "http.response.start",
            "status": exc.status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


class _Answer:
    """The send of the chat handler: its answer rewritten as the Responses API's."""

    def __init__(self, send: Send, request: ResponsesRequest) -> None:
        self._send = send
        self._request = request
        self._start: Message | None = None
        self._events: ResponseEvents | None = None  # a 200 stream
        self._pending = b""  # bytes of the answer not translated yet
        self._ended = False  # a stream's final event (or its error) is out

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self._start = message
            content_type = dict(message.get("headers", ())).get(b"content-type", b"")
            if message["status"] == 200 and content_type.startswith(b"text/event-stream"):
                self._events = ResponseEvents(self._request)
                await self._send(message)
            return
        if message["type"] != "http.response.body":
            await self._send(message)
            return
        self._pending += message.get("body", b"")
        more = message.get("more_body", False)
        if self._events is not None:
            await self._send(
                {"type": "http.response.body", "body": self._stream_part(), "more_body": more}
            )
        elif not more:
            await self._whole()

    def _stream_part(self) -> bytes:
        """The events of every complete SSE event received so far."""
        assert self._events is not None
        out = b"" if self._events.sequence_number else self._events.start()
        *complete, self._pending = self._pending.split(b"\n\n")
        for event in complete:
            lines = event.split(b"\n")
            data = b"".join(line[5:].strip() for line in lines if line.startswith(b"data:"))
            if not data or self._ended:  # a comment, or after the end
                continue
            if data == b"[DONE]":
                out += self._events.finish()
                self._ended = True
                continue
            payload = json.loads(data)
            if "error" in payload:
                out += self._events.error(payload["error"])
                self._ended = True
            else:
                out += self._events.chunk(payload)
        return out

    async def _whole(self) -> None:
        """A JSON answer: the Response of a 200, else the error with Responses param names."""
        assert self._start is not None
        payload = json.loads(self._pending) if self._pending else None
        if self._start["status"] == 200 and isinstance(payload, dict) and "choices" in payload:
            payload = response_from_chat(payload, self._request, new_response_id(), time.time())
        elif isinstance(payload, dict) and isinstance(payload.get("error"), dict):
            payload["error"]["param"] = responses_param(payload["error"].get("param"))
        body = self._pending if payload is None else json.dumps(payload).encode()
        headers = [(k, v) for k, v in self._start.get("headers", ()) if k != b"content-length"]
        await self._send(
            {**self._start, "headers": [*headers, (b"content-length", str(len(body)).encode())]}
        )
        await self._send({"type": "http.response.body", "body": body, "more_body": False})


def responses_param(param: str | None) -> str | None:
    """A chat request's parameter name as the Responses request names it."""
    if param is None:
        return None
    for chat_name, name in _PARAMS.items():
        if param == chat_name or param.startswith((f"{chat_name}[", f"{chat_name}.")):
            return name
    return param


class ResponsesMiddleware:
    """A FastAPI app's POST /v1/responses through its own chat route (a worker's)."""

    def __init__(self, app: ASGIApp, body_limit: Callable[[], BodyLimit]) -> None:
        self.app = app
        self.route = ResponsesRoute(app, body_limit)

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == RESPONSES_PATH:
            await self.route(scope, receive, send)
        else:
            await self.app(scope, receive, send)
