"""OpenAI responses and SSE chunks of one request, for the router and the workers alike.

The one builder of OpenAI bodies: the router builds them from P's first token and D's events,
the mixed worker from its engine's outputs, with the shapes of `pdrouter.wire.openai`:

    chat stream:        {delta: {role: assistant, content: <P's first token>}}   at once
                        {delta: {content: ...}} ...                              relayed from D
                        {delta: {}, finish_reason}  |  last text + finish_reason
    completion stream:  {text: <first token>}, {text: ...} ..., {text, finish_reason}
    then, with stream_options.include_usage, {choices: [], usage}; then [DONE]
"""

from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from pydantic import BaseModel

from pdrouter.wire.errors import error_body
from pdrouter.wire.logprobs import TokenLogprob, chat_logprobs, completion_logprobs
from pdrouter.wire.openai import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatResponseMessage,
    CompletionChoice,
    CompletionResponse,
    UsageInfo,
)
from pdrouter.wire.pd import Endpoint

SSE_DONE = b"data: [DONE]\n\n"
# A str as a JSON string, non-ASCII kept: what json.dumps(s, ensure_ascii=False) returns, from
# the C function it calls itself, without building an encoder per call (one per relayed token).
encode_json_string = json.encoder.encode_basestring  # type: ignore[attr-defined]
# Proxies must pass each event on at once rather than buffer the stream.
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


_TEXT_MARK = "\x00text\x00"  # JSON-encoded the same by both encoders: "\u0000text\u0000"
_TEXT_MARK_JSON = json.dumps(_TEXT_MARK).encode()


@functools.lru_cache(maxsize=256)  # model names come from clients: bounded
def _chunk_rest(
    endpoint: Endpoint,
    model: str,
    system_fingerprint: str | None,
    first: bool,
    finish_reason: Any,
    has_text: bool,
) -> tuple[bytes, bytes] | None:
    """A chunk's bytes after its frame head, split where its text goes (the second part is
    empty when there is no text); None when the split is ambiguous (a model name holding the
    marker), and the models then build every such chunk."""
    frame = ResponseFrame(endpoint, "r", model, created=0, system_fingerprint=system_fingerprint)
    raw = frame._model_chunk(_TEXT_MARK if has_text else "", finish_reason, first)
    head = frame._head
    if head is None or not raw.startswith(head):
        return None
    rest = raw[len(head) :]
    if not has_text:
        return rest, b""
    pieces = rest.split(_TEXT_MARK_JSON)
    return (pieces[0], pieces[1]) if len(pieces) == 2 else None


def sse(payload: BaseModel | dict[str, Any]) -> bytes:
    """One server-sent event carrying a JSON payload."""
    if isinstance(payload, BaseModel):
        data = payload.model_dump_json()
    else:
        data = json.dumps(payload, separators=(",", ":"))
    return b"data: " + data.encode() + b"\n\n"


def sse_error(message: str, err_type: str = "server_error", code: str | None = None) -> bytes:
    """An error after the 200 went out, in-band: the openai client raises it as APIError."""
    return sse(error_body(message, err_type, None, code))


@dataclass(frozen=True)
class ResponseFrame:
    """What every chunk and the response of one request share; `created` is fixed once."""

    endpoint: Endpoint
    request_id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))
    system_fingerprint: str | None = None  # the cluster's KV fingerprint, as workers answer

    @property
    def response_id(self) -> str:
        return ("chatcmpl-" if self.endpoint == "chat" else "cmpl-") + self.request_id

    def _common(self) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.system_fingerprint,
        }

    def chunk(
        self,
        text: str,
        finish_reason: Any = None,
        first: bool = False,
        logprobs: list[TokenLogprob] | None = None,
        text_offset: int = 0,
    ) -> bytes:
        """A text delta and/or the finish reason; a chat stream's first chunk names the role.
        logprobs: the chunk's tokens' (None: the request asked for none); text_offset: where
        the first of them starts in the completion's text (completions only).

        Every relayed token passes here, so the bytes are spliced from parts the models gave
        once (byte-identical to them; tests/pdrouter/wire/test_responses_fast_path.py): this frame's
        id and created time, then the rest of a chunk of that kind, cached per (endpoint,
        model, fingerprint, kind), around the JSON-encoded text. A text delta alone, most of
        a stream, is spliced from the frame's own two parts (text_chunk_parts).
        """
        if logprobs is not None:
            return self._model_chunk(text, finish_reason, first, logprobs, text_offset)
        if text and finish_reason is None and not first:
            parts = self.text_chunk_parts
            if parts is not None:
                try:
                    return parts[0] + encode_json_string(text).encode() + parts[1]
                except UnicodeEncodeError:  # a lone surrogate: let the models raise as before
                    return self._model_chunk(text, finish_reason, first)
        head = self._head
        rest = _chunk_rest(
            self.endpoint, self.model, self.system_fingerprint, first, finish_reason, bool(text)
        )
        if head is not None and rest is not None:
            try:
                encoded = encode_json_string(text).encode() if text else b""
            except UnicodeEncodeError:  # a lone surrogate: let the models raise as before
                pass
            else:
                return head + rest[0] + encoded + rest[1]
        return self._model_chunk(text, finish_reason, first)

    @cached_property
    def text_chunk_parts(self) -> tuple[bytes, bytes] | None:
        """The two parts of this frame's chunk for a text delta alone (not the first chunk,
        no finish reason) around the text as a JSON string: chunk(text) is the first part +
        encode_json_string(text).encode() + the second, for any text that encodes. None when
        chunk() builds them otherwise (a frame whose chunk() holds text overrides this)."""
        head = self._head
        rest = _chunk_rest(self.endpoint, self.model, self.system_fingerprint, False, None, True)
        if head is None or rest is None:
            return None
        return head + rest[0], rest[1]

    @cached_property
    def _head(self) -> bytes | None:
        """The bytes every chunk of this frame starts with, up to and including the comma
        after `created` (None when the id cannot be encoded: the models then decide)."""
        try:
            response_id = encode_json_string(self.response_id).encode()
        except UnicodeEncodeError:
            return None
        return b'data: {"id":' + response_id + b',"created":' + str(self.created).encode() + b","

    def _model_chunk(
        self,
        text: str,
        finish_reason: Any,
        first: bool,
        logprobs: list[TokenLogprob] | None = None,
        text_offset: int = 0,
    ) -> bytes:
        if self.endpoint == "chat":
            if first:
                delta = ChatDelta(role="assistant", content=text)
            else:
                delta = ChatDelta(content=text) if text else ChatDelta()
            chat_lp = None if logprobs is None else chat_logprobs(logprobs)
            choice = ChatChunkChoice(delta=delta, logprobs=chat_lp, finish_reason=finish_reason)
            return sse(ChatCompletionChunk(**self._common(), choices=[choice]))
        lp = None if logprobs is None else completion_logprobs(logprobs, text_offset)
        completion = CompletionChoice(text=text, logprobs=lp, finish_reason=finish_reason)
        return sse(CompletionResponse(**self._common(), choices=[completion]))

    def usage_chunk(
        self, num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int = 0
    ) -> bytes:
        """The include_usage chunk: no choices, the whole request's usage."""
        usage = UsageInfo.of(num_prompt_tokens, num_completion_tokens, num_cached_tokens)
        if self.endpoint == "chat":
            return sse(ChatCompletionChunk(**self._common(), choices=[], usage=usage))
        return sse(CompletionResponse(**self._common(), choices=[], usage=usage))

    def response(
        self,
        text: str,
        finish_reason: Any,
        num_prompt_tokens: int,
        num_completion_tokens: int,
        logprobs: list[TokenLogprob] | None = None,
        num_cached_tokens: int = 0,
    ) -> dict[str, Any]:
        """The whole non-streamed response as a JSON-able dict (logprobs: of every generated
        token, None when the request asked for none; num_cached_tokens: prompt tokens whose KV
        came from a cache)."""
        usage = UsageInfo.of(num_prompt_tokens, num_completion_tokens, num_cached_tokens)
        if self.endpoint == "chat":
            chat = ChatChoice(
                message=ChatResponseMessage(content=text),
                logprobs=None if logprobs is None else chat_logprobs(logprobs),
                finish_reason=finish_reason,
            )
            return ChatCompletionResponse(
                **self._common(), choices=[chat], usage=usage
            ).model_dump()
        lp = None if logprobs is None else completion_logprobs(logprobs)
        completion = CompletionChoice(text=text, logprobs=lp, finish_reason=finish_reason)
        return CompletionResponse(**self._common(), choices=[completion], usage=usage).model_dump()
