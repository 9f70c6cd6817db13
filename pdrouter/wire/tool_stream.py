"""ToolCallFrame: a chat ResponseFrame that answers tool calls in OpenAI's shape.

The router (from P's first token and D's events) and the mixed worker (from its engine's
outputs) feed it the answer's text exactly as they feed a plain ResponseFrame; it turns the
text into `tool_calls` by the request's tool mode (`pdrouter.wire.tool_calls`):

    named, required   the calls stream as the model writes them (call_scanner.py), in
                      OpenAI's shape: a call's first delta {index, id, type, function:
                      {name, arguments: ""}} once its name is known, then {index, function:
                      {arguments: <the new characters>}} per text delta; then the finish
                      chunk with finish_reason "tool_calls". An answer cut before any call
                      began (a `length` finish) ends as content
    auto              text streams as content until it may begin a call (an answer that
                      opens with "{", "[" or a call marker, or a "<tool_call>" tag anywhere,
                      a possible start of the tag held back meanwhile). From a "<tool_call>"
                      tag on, the calls stream as above (call_scanner.py, mode hermes: a
                      call starts once its name is read); a call already sent stays sent if
                      the text turns out malformed. An answer that opens with "{" or "[" (a
                      Llama 3 / Mistral JSON call) is held and parsed at the finish (its calls
                      in one chunk): calls as above, or, if none parse, the text as content
    non-streamed      the message's content and tool_calls from the whole text; a forced
                      call's arguments exactly as streamed (the answer's own text)

A finish other than "stop" ("length") stays as it is, with whatever calls parsed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdrouter.wire.call_scanner import NO_ARGUMENTS, CallScanner, CallStart
from pdrouter.wire.logprobs import TokenLogprob
from pdrouter.wire.openai import ChatChunkChoice, ChatCompletionChunk, ChatDelta
from pdrouter.wire.responses import ResponseFrame, sse
from pdrouter.wire.structured import FunctionCall, ToolCall, ToolFields
from pdrouter.wire.tool_calls import TOOL_CALL_OPEN, named_call, new_call_id, parse_tool_calls

_CALL_STARTS = ("{", "[", TOOL_CALL_OPEN, "<|python_tag|>", "[TOOL_CALLS]")


def call_deltas(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """Stream deltas of whole calls: OpenAI's first delta of each call carries all of it."""
    return [{"index": i, **call.model_dump()} for i, call in enumerate(calls)]


@dataclass(frozen=True)
class ToolCallFrame(ResponseFrame):
    """A chat frame whose answer may be tool calls (mode: ToolFields.tool_mode())."""

    mode: str = "auto"
    function_name: str | None = None  # named mode: the forced function
    # Stream state: text held back, and whether the answer is known to be content.
    _held: list[str] = field(default_factory=list, compare=False, repr=False)
    _state: dict[str, bool] = field(default_factory=dict, compare=False, repr=False)
    # The call scanner, and how much of the held text it has read (auto: from the tag on).
    _stream: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def text_chunk_parts(self) -> None:  # type: ignore[override]
        """None: chunk() holds or rewrites every text delta, so the relay must not splice
        text around it."""
        return None

    def calls_of(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if self.mode == "named" and self.function_name is not None:
            return None, [named_call(self.function_name, text)]
        return parse_tool_calls(text, self.mode)

    def chunk(
        self,
        text: str,
        finish_reason: Any = None,
        first: bool = False,
        logprobs: list[TokenLogprob] | None = None,
        text_offset: int = 0,
    ) -> bytes:
        parts = [super().chunk("", first=True)] if first else []
        if self.mode in ("named", "required"):
            parts.extend(self._forced_deltas(text))
            if logprobs:
                parts.append(super().chunk("", logprobs=logprobs))
        else:
            content = self._content_delta(text, finish_reason is not None)
            if content or logprobs:
                parts.append(super().chunk(content, logprobs=logprobs))
            if self._state.get("hermes"):
                held = "".join(self._held)
                parts.extend(self._call_chunks(held[self._stream.get("read", 0) :]))
                self._stream["read"] = len(held)
        if finish_reason is not None:
            parts.append(self._finish(finish_reason))
        return b"".join(parts)

    def _forced_deltas(self, text: str) -> list[bytes]:
        """The chunks of a forced answer's new text: each call's start and its arguments as
        they arrive (the text is also held, for an answer cut before any call began)."""
        self._held.append(text)
        return self._call_chunks(text)

    def _call_chunks(self, text: str) -> list[bytes]:
        """The delta chunks of the calls that text, after what the scanner read, shows."""
        chunks = []
        for event in self._scanner().feed(text):
            if isinstance(event, CallStart):
                call = ToolCall(
                    id=new_call_id(), function=FunctionCall(name=event.name, arguments="")
                )
                delta = {"index": event.index, **call.model_dump()}
            else:
                delta = {"index": event.index, "function": {"arguments": event.text}}
            chunks.append(self._delta_chunk(ChatDelta(tool_calls=[delta]), None))
        return chunks

    def _scanner(self) -> CallScanner:
        scanner = self._stream.get("scanner")
        if scanner is None:
            mode = "hermes" if self.mode == "auto" else self.mode
            scanner = self._stream["scanner"] = CallScanner(mode, self.function_name)
        return scanner

    def _content_delta(self, text: str, finished: bool) -> str:
        """The part of the text so far that is surely content (auto mode), held text kept."""
        held = "".join(self._held) + text
        self._held.clear()
        if self.mode in ("named", "required") or self._state.get("calls"):
            self._held.append(held)
            return ""
        if not self._state.get("content"):
            opening = held.lstrip()
            if any(opening.startswith(s) for s in _CALL_STARTS):
                self._state["calls"] = True
                self._state["hermes"] = opening.startswith(TOOL_CALL_OPEN)
                self._held.append(held)
                return ""
            if not finished and (not opening or any(s.startswith(opening) for s in _CALL_STARTS)):
                self._held.append(held)
                return ""
            self._state["content"] = True
        if TOOL_CALL_OPEN in held:
            at = held.index(TOOL_CALL_OPEN)
            self._state["calls"] = self._state["hermes"] = True
            self._held.append(held[at:])
            return held[:at]
        keep = 0 if finished else _partial_tag_len(held)
        if keep:
            self._held.append(held[-keep:])
        return held[: len(held) - keep]

    def _finish(self, finish_reason: Any) -> bytes:
        held = "".join(self._held)
        self._held.clear()
        if self.mode in ("named", "required") or self._state.get("hermes"):
            scanner = self._scanner()
            if scanner.num_started:  # streamed already (a call without arguments gets {})
                parts = [
                    self._delta_chunk(ChatDelta(tool_calls=[delta]), None)
                    for i in range(scanner.num_started)
                    if i not in scanner.argued
                    for delta in [{"index": i, "function": {"arguments": NO_ARGUMENTS}}]
                ]
                finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
                return b"".join([*parts, self._delta_chunk(ChatDelta(), finish_reason)])
            parts = [super().chunk(held)] if held else []
            return b"".join([*parts, self._delta_chunk(ChatDelta(), finish_reason)])
        content, calls = self.calls_of(held) if held else (None, [])
        parts = []
        if calls:
            if content:
                parts.append(super().chunk(content))
            delta = ChatDelta(tool_calls=call_deltas(calls))
            parts.append(self._delta_chunk(delta, None))
            finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        elif held:
            parts.append(super().chunk(held))
        parts.append(self._delta_chunk(ChatDelta(), finish_reason))
        return b"".join(parts)

    def _delta_chunk(self, delta: ChatDelta, finish_reason: Any) -> bytes:
        choice = ChatChunkChoice(delta=delta, finish_reason=finish_reason)
        return sse(ChatCompletionChunk(**self._common(), choices=[choice]))

    def response(
        self,
        text: str,
        finish_reason: Any,
        num_prompt_tokens: int,
        num_completion_tokens: int,
        logprobs: list[TokenLogprob] | None = None,
        num_cached_tokens: int = 0,
    ) -> dict[str, Any]:
        content, calls = self.calls_of(text)
        if calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        body = super().response(
            text,
            finish_reason,
            num_prompt_tokens,
            num_completion_tokens,
            logprobs,
            num_cached_tokens,
        )
        message = body["choices"][0]["message"]
        message["content"] = content
        if calls:
            message["tool_calls"] = [call.model_dump() for call in calls]
        return body


def _partial_tag_len(text: str) -> int:
    """The length of the longest end of text that is a proper start of the <tool_call> tag."""
    for n in range(min(len(text), len(TOOL_CALL_OPEN) - 1), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-n:]):
            return n
    return 0


def chat_frame(frame: ResponseFrame, tool_mode: str, function_name: str | None) -> ResponseFrame:
    """frame itself, or the tool-call frame over it when tools may be called."""
    if frame.endpoint != "chat" or tool_mode == "none":
        return frame
    return ToolCallFrame(
        frame.endpoint,
        frame.request_id,
        frame.model,
        created=frame.created,
        system_fingerprint=frame.system_fingerprint,
        mode=tool_mode,
        function_name=function_name,
    )


def tool_answer(request: Any) -> tuple[str, str | None]:
    """(tool mode, forced function name) of a parsed request; completions call no tools."""
    if not isinstance(request, ToolFields):  # a completions request: no tool fields (no getattr
        return "none", None  # miss through pydantic, on every completions request)
    tool_mode = request.tool_mode
    named = request.named_tool()
    return tool_mode(), None if named is None else named.name
