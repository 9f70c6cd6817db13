"""OpenAI response bodies and SSE chunks for one request, in the order OpenAI sends them.

A stream, chat:                                   completion:
    data: {delta: {role: assistant, content: ""}}     (no opening chunk)
    data: {delta: {content: "..."}}  ...              data: {text: "..."} ...
    data: {delta: {}, finish_reason: "stop"}          data: {text: "", finish_reason: "stop"}
    data: {choices: [], usage: {...}}    only with stream_options.include_usage
    data: [DONE]

Pure functions of (kind, ids, text, counts): the mixed server, the decode role and the router
build the same bytes from them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel

from pdrouter.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatResponseMessage,
    CompletionChoice,
    CompletionResponse,
    FinishReason,
    UsageInfo,
    error_body,
)

SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_event(payload: BaseModel | dict[str, Any]) -> bytes:
    """One server-sent event carrying a JSON payload."""
    if isinstance(payload, BaseModel):
        data = payload.model_dump_json()
    else:
        import json

        data = json.dumps(payload, separators=(",", ":"))
    return b"data: " + data.encode() + b"\n\n"


def sse_error(message: str, err_type: str = "server_error", code: str | None = None) -> bytes:
    """An error that happens after the 200 went out: the openai client raises it as APIError."""
    return sse_event(error_body(message, err_type, None, code))


def response_id(kind: Literal["completion", "chat"], request_id: str) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{request_id}"


@dataclass(frozen=True)
class ResponseBuilder:
    """Builds every body of one request's answer; `created` is fixed once, as OpenAI does."""

    kind: Literal["completion", "chat"]
    request_id: str
    model: str
    system_fingerprint: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def id(self) -> str:
        return response_id(self.kind, self.request_id)

    def _common(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.system_fingerprint,
        }

    def full_response(
        self,
        text: str,
        finish_reason: FinishReason | None,
        num_prompt_tokens: int,
        num_completion_tokens: int,
    ) -> ChatCompletionResponse | CompletionResponse:
        """The non-streaming answer."""
        usage = UsageInfo.of(num_prompt_tokens, num_completion_tokens)
        if self.kind == "chat":
            choice = ChatChoice(
                message=ChatResponseMessage(content=text), finish_reason=finish_reason
            )
            return ChatCompletionResponse(**self._common(), choices=[choice], usage=usage)
        completion = CompletionChoice(text=text, finish_reason=finish_reason)
        return CompletionResponse(**self._common(), choices=[completion], usage=usage)

    def opening_chunks(self) -> list[bytes]:
        """What a stream starts with: chat announces the assistant role, completions nothing."""
        if self.kind != "chat":
            return []
        choice = ChatChunkChoice(delta=ChatDelta(role="assistant", content=""))
        return [sse_event(ChatCompletionChunk(**self._common(), choices=[choice]))]

    def text_chunk(self, text: str, finish_reason: FinishReason | None = None) -> bytes:
        """A chunk carrying a text delta and/or the finish reason."""
        if self.kind == "chat":
            delta = ChatDelta(content=text) if text else ChatDelta()
            choice = ChatChunkChoice(delta=delta, finish_reason=finish_reason)
            return sse_event(ChatCompletionChunk(**self._common(), choices=[choice]))
        completion = CompletionChoice(text=text, finish_reason=finish_reason)
        return sse_event(CompletionResponse(**self._common(), choices=[completion]))

    def usage_chunk(self, num_prompt_tokens: int, num_completion_tokens: int) -> bytes:
        """The last data chunk when stream_options.include_usage is set: no choices."""
        usage = UsageInfo.of(num_prompt_tokens, num_completion_tokens)
        if self.kind == "chat":
            return sse_event(ChatCompletionChunk(**self._common(), choices=[], usage=usage))
        return sse_event(CompletionResponse(**self._common(), choices=[], usage=usage))
