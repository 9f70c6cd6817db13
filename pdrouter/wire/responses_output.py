"""A chat completions answer written back as a Response (the Responses API's output side).

Not streamed: one chat.completion -> one Response: the message (output_text) and a
function_call item per tool call, usage as input/output tokens, status "incomplete" with
incomplete_details {reason: max_output_tokens} when the chat answer ended on length, and
{reason: grammar_error} when its grammar reached a dead end (the text is not valid JSON).

Output logprobs (asked with include message.output_text.logprobs): chat's logprobs.content
entries, one per token, are the output_text part's `logprobs` ({token, bytes, logprob,
top_logprobs: [{token, bytes, logprob}]}); streamed, each output_text.delta carries those of
its chunk and output_text.done all of them, in the events' shape ({token, logprob,
top_logprobs: [{token, logprob}]}). A chunk whose tokens have no text yet (a stop string or a
character still held back) still gets its delta, empty, so no token's logprob is lost.

Streamed: ResponseEvents turns the chat chunks, in order, into the Responses events (each an
SSE `event:` + `data:` pair with a growing sequence_number):

    response.created, response.in_progress                       at start()
    response.output_item.added (message), response.content_part.added    first text
    response.output_text.delta ...                               each text delta
    response.output_item.added (function_call),                  each tool call, as its
    response.function_call_arguments.delta ...                   deltas arrive
    response.output_text.done, response.content_part.done,       at finish(), for each
    response.function_call_arguments.done, response.output_item.done    item opened
    response.completed | response.incomplete (with usage)
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from pdrouter.wire.responses_api import ResponsesRequest


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def usage_of(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """Chat usage as the Responses API counts it."""
    if chat_usage is None:
        return None
    details = chat_usage.get("prompt_tokens_details") or {}
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        # cache_write_tokens: OpenAI bills prompt-cache writes; this server bills none.
        "input_tokens_details": {
            "cached_tokens": details.get("cached_tokens", 0),
            "cache_write_tokens": 0,
        },
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat_usage["total_tokens"],
    }


def response_object(
    request: ResponsesRequest,
    response_id: str,
    created_at: float,
    output: list[dict[str, Any]],
    finish_reason: str | None = None,
    usage: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The Response; finish_reason None: still in progress."""
    status = "in_progress" if finish_reason is None else status_of(finish_reason)
    reason = INCOMPLETE_REASONS.get(finish_reason or "")
    incomplete = None if reason is None else {"reason": reason}
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "error": None,
        "incomplete_details": incomplete,
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "model": request.model,
        "output": output,
        "parallel_tool_calls": request.parallel_tool_calls is not False,
        "previous_response_id": None,
        "reasoning": None,
        "store": False,  # nothing is kept: a response cannot be retrieved later
        "temperature": request.temperature,
        "text": request.text or {"format": {"type": "text"}},
        "tool_choice": request.tool_choice or "auto",
        "tools": request.tools or [],
        "top_p": request.top_p,
        "top_logprobs": request.top_logprobs,
        "truncation": "disabled",
        "usage": usage,
        "user": request.user,
        "metadata": request.metadata or {},
    }


def text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """An output_text part; logprobs: chat's logprobs.content entries of its tokens."""
    return {
        "type": "output_text",
        "text": text,
        "annotations": [],
        "logprobs": [part_logprob(entry) for entry in logprobs or ()],
    }


def part_logprob(entry: dict[str, Any]) -> dict[str, Any]:
    """A chat logprobs.content entry as the output_text part's logprob (bytes required)."""

    def one(e: dict[str, Any]) -> dict[str, Any]:
        raw = e.get("bytes")
        return {
            "token": e["token"],
            "bytes": list(e["token"].encode()) if raw is None else raw,
            "logprob": e["logprob"],
        }

    return {**one(entry), "top_logprobs": [one(t) for t in entry.get("top_logprobs") or ()]}


def event_logprobs(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat logprobs.content entries as the output_text.delta / .done events carry them."""
    return [
        {
            "token": e["token"],
            "logprob": e["logprob"],
            "top_logprobs": [
                {"token": t["token"], "logprob": t["logprob"]} for t in e.get("top_logprobs") or ()
            ],
        }
        for e in entries
    ]


def message_item(
    item_id: str,
    text: str | None,
    status: str,
    logprobs: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    content = [] if text is None else [text_part(text, logprobs)]
    return {
        "id": item_id,
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": content,
    }


def function_call_item(call: dict[str, Any], arguments: str, status: str) -> dict[str, Any]:
    function = call.get("function") or {}
    return {
        "id": f"fc_{call['id']}",
        "type": "function_call",
        "status": status,
        "call_id": call["id"],
        "name": function.get("name", ""),
        "arguments": arguments,
    }


def response_from_chat(
    chat: dict[str, Any], request: ResponsesRequest, response_id: str, created_at: float
) -> dict[str, Any]:
    """The Response of a chat.completion answer (not streamed)."""
    choice = chat["choices"][0]
    message = choice["message"]
    status = status_of(choice.get("finish_reason"))
    tool_calls = message.get("tool_calls") or []
    output = []
    if message.get("content") or not tool_calls:
        item_id = f"msg_{response_id.removeprefix('resp_')}"
        logprobs = (choice.get("logprobs") or {}).get("content")
        output.append(message_item(item_id, message.get("content") or "", status, logprobs))
    for call in tool_calls:
        output.append(function_call_item(call, call["function"]["arguments"], "completed"))
    return response_object(
        request,
        response_id,
        created_at,
        output,
        choice.get("finish_reason"),
        usage_of(chat.get("usage")),
    )


# The chat finish reasons a Response reports as incomplete, and the reason it gives.
INCOMPLETE_REASONS = {"length": "max_output_tokens", "grammar_error": "grammar_error"}


def status_of(finish_reason: str | None) -> str:
    """A finished Response's status for the chat answer's finish reason."""
    return "incomplete" if finish_reason in INCOMPLETE_REASONS else "completed"


def sse_event(event: dict[str, Any]) -> bytes:
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


class ResponseEvents:
    """The Responses events of one streamed chat answer (see the module docstring)."""

    def __init__(self, request: ResponsesRequest, response_id: str | None = None) -> None:
        self.request = request
        self.response_id = response_id or new_response_id()
        self.created_at = time.time()
        self.sequence_number = 0
        self.output: list[dict[str, Any]] = []  # items in output_index order, as they open
        self.message_index: int | None = None
        self.text_parts: list[str] = []
        self.logprobs: list[dict[str, Any]] = []  # chat's logprobs.content entries so far
        self.calls: dict[int, tuple[int, dict[str, Any], list[str]]] = {}  # chat index ->
        self.finish_reason: str | None = None  # (output_index, call, argument deltas)
        self.usage: dict[str, Any] | None = None

    def _event(self, kind: str, **fields: Any) -> bytes:
        event = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return sse_event(event)

    def _response(self) -> dict[str, Any]:
        return response_object(
            self.request,
            self.response_id,
            self.created_at,
            self.output,
            self.finish_reason,
            self.usage,
        )

    def start(self) -> bytes:
        response = self._response()
        return self._event("response.created", response=response) + self._event(
            "response.in_progress", response=response
        )

    def chunk(self, chunk: dict[str, Any]) -> bytes:
        """The events of one chat.completion.chunk."""
        if chunk.get("usage"):
            self.usage = usage_of(chunk["usage"])
        out = b""
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            logprobs = (choice.get("logprobs") or {}).get("content") or []
            if delta.get("content") or logprobs:
                out += self._text(delta.get("content") or "", logprobs)
            for call in delta.get("tool_calls") or ():
                out += self._call(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return out

    def _message_id(self) -> str:
        return f"msg_{self.response_id.removeprefix('resp_')}"

    def _open_message(self) -> bytes:
        """The message item and its text part, once, at the first text."""
        if self.message_index is not None:
            return b""
        self.message_index = len(self.output)
        item = message_item(self._message_id(), None, "in_progress")
        self.output.append(item)
        return self._event(
            "response.output_item.added", output_index=self.message_index, item=item
        ) + self._event(
            "response.content_part.added",
            item_id=self._message_id(),
            output_index=self.message_index,
            content_index=0,
            part=text_part(""),
        )

    def _text(self, text: str, logprobs: list[dict[str, Any]]) -> bytes:
        out = self._open_message()
        self.text_parts.append(text)
        self.logprobs.extend(logprobs)
        return out + self._event(
            "response.output_text.delta",
            item_id=self._message_id(),
            output_index=self.message_index,
            content_index=0,
            delta=text,
            logprobs=event_logprobs(logprobs),
        )

    def _call(self, delta: dict[str, Any]) -> bytes:
        out = b""
        index = delta.get("index", 0)
        if index not in self.calls:
            call = {
                "id": delta.get("id") or f"call_{uuid.uuid4().hex[:24]}",
                "function": {"name": (delta.get("function") or {}).get("name", "")},
            }
            self.calls[index] = (len(self.output), call, [])
            item = function_call_item(call, "", "in_progress")
            self.output.append(item)
            out += self._event(
                "response.output_item.added", output_index=len(self.output) - 1, item=item
            )
        output_index, call, arguments = self.calls[index]
        piece = (delta.get("function") or {}).get("arguments") or ""
        if piece:
            arguments.append(piece)
            out += self._event(
                "response.function_call_arguments.delta",
                item_id=f"fc_{call['id']}",
                output_index=output_index,
                delta=piece,
            )
        return out

    def finish(self) -> bytes:
        """Every open item closed, then response.completed (or .incomplete) with usage."""
        out = b""
        if self.message_index is None and not self.calls:
            out += self._open_message()  # an empty answer is still one (empty) message
        status = status_of(self.finish_reason)
        if self.message_index is not None:
            text = "".join(self.text_parts)
            index, item_id = self.message_index, self._message_id()
            out += self._event(
                "response.output_text.done",
                item_id=item_id,
                output_index=index,
                content_index=0,
                text=text,
                logprobs=event_logprobs(self.logprobs),
            )
            out += self._event(
                "response.content_part.done",
                item_id=item_id,
                output_index=index,
                content_index=0,
                part=text_part(text, self.logprobs),
            )
            self.output[index] = message_item(item_id, text, status, self.logprobs)
            out += self._event(
                "response.output_item.done", output_index=index, item=self.output[index]
            )
        for output_index, call, arguments in self.calls.values():
            joined = "".join(arguments)
            out += self._event(
                "response.function_call_arguments.done",
                item_id=f"fc_{call['id']}",
                output_index=output_index,
                arguments=joined,
            )
            self.output[output_index] = function_call_item(call, joined, "completed")
            out += self._event(
                "response.output_item.done",
                output_index=output_index,
                item=self.output[output_index],
            )
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        return out + self._event(kind, response=self._response())

    def error(self, error: dict[str, Any]) -> bytes:
        """The chat stream's in-band error, as the Responses `error` event."""
        return self._event(
            "error",
            code=error.get("code"),
            message=error.get("message", ""),
            param=error.get("param"),
        )
