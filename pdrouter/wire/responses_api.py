"""The Responses API request (`POST /v1/responses`) and its translation to a chat request.

A Responses turn is served by the chat path itself (pdrouter.common.responses_route): the
request becomes the chat completions body below, runs through PD (or a mixed worker) as any
chat request does, and the chat answer is written back as a Response
(pdrouter.wire.responses_output). So every chat feature, limit and error applies alike.

    instructions                          -> {"role": "system", "content": instructions} first
    input: "text"                         -> {"role": "user", "content": "text"}
    input item {role, content}            -> {role, content: [text parts]}
      (content parts input_text / output_text; images and files are refused)
    input item function_call              -> an assistant message's tool_calls (consecutive
      {call_id, name, arguments}             calls join one message, as a parallel call)
    input item function_call_output       -> {"role": "tool", "tool_call_id", "content"}
    max_output_tokens                     -> max_completion_tokens
    tools [{type: function, name, ...}]   -> [{type: function, function: {name, ...}}]
    tool_choice {type: function, name}    -> {type: function, function: {name}}
    text.format json_schema / json_object -> response_format
    include message.output_text.logprobs  -> logprobs: true, top_logprobs (0 when not given);
      (top_logprobs alone asks for nothing, as in vLLM: the include is what turns them on)
    temperature, top_p, parallel_tool_calls, user, and the chat extensions (EXTENSIONS) as given

What cannot be honoured is refused with a 400 naming it (REFUSED: stored state such as
previous_response_id, hosted tools, reasoning effort), never ignored; parameters that change
nothing about the answer (store, metadata, include of nothing, ...) are accepted.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ConfigDict, Field

from pdrouter.wire.errors import clip
from pdrouter.wire.logprobs import MAX_TOP_LOGPROBS
from pdrouter.wire.openai import parse_request
from pdrouter.wire.protocol_error import ProtocolError
from pdrouter.wire.strict import Strict

RESPONSES_PATH = "/v1/responses"
OUTPUT_LOGPROBS = "message.output_text.logprobs"  # the include that asks for them

# Chat parameters a Responses body may carry as they are (vLLM's Responses route takes them).
EXTENSIONS = (
    "seed",
    "top_k",
    "min_p",
    "min_tokens",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "cache_salt",
)
# parameter -> the values accepted because they change nothing (None: no value is)
REFUSED: dict[str, tuple[Any, ...]] = {
    "previous_response_id": (),  # nothing is stored
    "conversation": (),
    "prompt": (),  # stored prompt templates
    "background": (False,),
    "reasoning": ({},),
    "truncation": ("disabled",),
}
_TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(Strict):
    """POST /v1/responses. Types are strict and null means omitted; the chat extensions
    (seed, top_k, min_p, the penalties, ...) are taken beside these fields as they are."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    stream: bool = False
    store: bool | None = None
    metadata: dict[str, str] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    user: str | None = None

    def extension(self, name: str) -> Any:
        return (self.model_extra or {}).get(name)

    def check_supported(self) -> None:
        """Raise ProtocolError for what this server cannot honour (REFUSED)."""
        for name, noops in REFUSED.items():
            value = self.extension(name)
            if value is not None and not any(type(value) is type(n) and value == n for n in noops):
                raise ProtocolError(f"{name} is not supported by this server; omit it", name)

    @property
    def output_logprobs(self) -> bool:
        """Whether the answer's text carries its tokens' logprobs."""
        return OUTPUT_LOGPROBS in (self.include or ())


def parse_responses_request(body: bytes) -> ResponsesRequest:
    """Parse and check a Responses body; every problem is a ProtocolError naming the field."""
    return parse_request(ResponsesRequest, body)  # type: ignore[type-var]


def to_chat_body(request: ResponsesRequest) -> dict[str, Any]:
    """The chat completions body that serves this Responses request."""
    messages: list[dict[str, Any]] = []
    if request.instructions is not None:
        messages.append({"role": "system", "content": request.instructions})
    if isinstance(request.input, str):
        messages.append({"role": "user", "content": request.input})
    else:
        messages.extend(input_messages(request.input))
    body: dict[str, Any] = {"model": request.model, "messages": messages}
    if request.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}  # response.completed carries usage
    optional = {
        "max_completion_tokens": request.max_output_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "parallel_tool_calls": request.parallel_tool_calls,
        "user": request.user,
        "tools": None if request.tools is None else chat_tools(request.tools),
        "tool_choice": chat_tool_choice(request.tool_choice),
        "response_format": response_format(request.text),
        "logprobs": True if request.output_logprobs else None,
        "top_logprobs": (request.top_logprobs or 0) if request.output_logprobs else None,
        **{name: request.extension(name) for name in EXTENSIONS},
    }
    body.update({k: v for k, v in optional.items() if v is not None})
    return body


def input_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages of a list of input items (see the module docstring)."""
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, f"input[{i}]"))
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", f"input[{i}]"),
                "type": "function",
                "function": {
                    "name": _string(item, "name", f"input[{i}]"),
                    "arguments": _string(item, "arguments", f"input[{i}]"),
                },
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            content = _text(output, f"input[{i}].output") if isinstance(output, list) else output
            if not isinstance(content, str):
                raise ProtocolError(f"input[{i}].output must be a string", f"input[{i}].output")
            call_id = _string(item, "call_id", f"input[{i}]")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": content})
        else:
            raise ProtocolError(
                f"input[{i}]: items of type {_shown(kind)} are not supported (messages, "
                "function_call and function_call_output are)",
                f"input[{i}].type",
            )
    return messages


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("system", "developer", "user", "assistant"):
        raise ProtocolError(
            f"{where}.role must be system, developer, user or assistant", f"{where}.role"
        )
    content = item.get("content")
    if isinstance(content, list):
        content = _text(content, f"{where}.content")
    if not isinstance(content, str):
        raise ProtocolError(
            f"{where}.content must be a string or a list of text parts", f"{where}.content"
        )
    return {"role": role, "content": content}


def _text(parts: list[Any], where: str) -> str:
    """The text parts joined as the chat path joins them; any other part is refused."""
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type") not in (*_TEXT_PARTS, "refusal"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ProtocolError(
                f"{where}[{j}] has type {_shown(kind)}; only text parts are supported",
                f"{where}[{j}]",
            )
        text = part.get("refusal") if part["type"] == "refusal" else part.get("text")
        if not isinstance(text, str):
            raise ProtocolError(f"{where}[{j}] needs a string text", f"{where}[{j}]")
        texts.append(text)
    return "\n".join(texts)


def _shown(value: Any) -> str:
    """A client's value as an error message quotes it: JSON, clipped (a 150 KB item type was
    echoed whole)."""
    return clip(json.dumps(value))


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise ProtocolError(f"{where}.{key} must be a string", f"{where}.{key}")
    return value


def chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses function tools ({type, name, description, parameters, strict}) as chat's
    ({type, function: {...}}); hosted tools (web search, files, ...) are refused."""
    converted = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise ProtocolError(
                f"tools[{i}]: tools of type {_shown(tool.get('type'))} are not supported "
                "(only function tools are)",
                f"tools[{i}].type",
            )
        function = {k: v for k, v in tool.items() if k != "type" and v is not None}
        converted.append({"type": "function", "function": function})
    return converted


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if not isinstance(choice, dict):
        return choice  # "none", "auto", "required" mean the same on both APIs
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise ProtocolError(
            "tool_choice: only {type: function, name} names a tool here", "tool_choice"
        )
    return {"type": "function", "function": {"name": choice["name"]}}


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """text.format as chat's response_format: json_schema's fields move under json_schema."""
    fmt = (text or {}).get("format")
    if fmt is None or not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        return fmt
    return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
