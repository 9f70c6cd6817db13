"""Tool calls in text: how tools reach the prompt and how calls are read back from the answer.

Rendering. A chat template that knows tools (it reads a `tools` variable: Qwen2's and
Hermes' `<tool_call>` templates, Llama 3.1's JSON one, Mistral's `[TOOL_CALLS]`) gets them as
it expects; a template that does not (the demo model's, the plain one) gets them as a system
message in the Hermes style (`tools_system_prompt`), so any model sees them. An assistant's
earlier calls and `tool` messages pass through in OpenAI's shape, arguments as objects (the
templates `tojson` them); a template without tools gets the calls as Hermes text.

Parsing (`parse_tool_calls`), by what tool_choice asked (`ToolFields.tool_mode`):

    named      the whole answer is the arguments (the grammar forced the function's schema)
    required   the whole answer is [{"name", "parameters"}, ...] (forced by the grammar)
    auto       Hermes tags <tool_call>{"name", "arguments"}</tool_call> anywhere (Qwen2,
               and the system-prompt fallback), else an answer that is one JSON call or a
               list of them ({"name", "arguments" | "parameters"}: Llama 3, Mistral, whose
               markers are special tokens the detokenizer drops); text before the first
               tag stays the message's content
    none       no parsing

Used by the mixed worker and the router alike (`pdrouter.wire.tool_stream` for streams), and
by any other API layer that renders tools or reads calls.
"""

from __future__ import annotations

import contextlib
import json
import re
import secrets
from typing import Any

from pdrouter.wire.call_scanner import written_arguments
from pdrouter.wire.structured import CALL_ARGUMENTS_KEY, CALL_NAME_KEY, FunctionCall, ToolCall

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
# Markers some families put before a JSON call, when the detokenizer keeps them.
_JSON_CALL_PREFIXES = ("<|python_tag|>", "[TOOL_CALLS]")


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """One parsed message as chat templates take it: 'developer' is the new name of
    'system', content is a string, an earlier call's arguments are an object."""
    out = dict(message)
    if out["role"] == "developer":
        out["role"] = "system"
    out["content"] = out.get("content") or ""
    if out.get("tool_calls"):
        out["tool_calls"] = [_template_call(call) for call in out["tool_calls"]]
    return out


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    function = dict(call["function"])
    # Not JSON: the template gets the text as it came.
    with contextlib.suppress(json.JSONDecodeError, TypeError):
        function["arguments"] = json.loads(function["arguments"])
    return {**call, "function": function}


def tools_system_prompt(tools: list[dict[str, Any]]) -> str:
    """Hermes' tool prompt, for a template that does not render tools itself."""
    signatures = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return (
        "You may call one or more functions to assist with the user query.\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{signatures}\n</tools>\n"
        "For each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def with_tools_in_text(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """Messages for a template that knows nothing of tools: the tools as a system message
    (merged into a leading one) and earlier calls as Hermes text in the assistant's content."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            text = "".join(
                f"{TOOL_CALL_OPEN}\n"
                + json.dumps(
                    {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                )
                + f"\n{TOOL_CALL_CLOSE}"
                for c in calls
            )
            message = {**message, "content": (message.get("content") or "") + text}
            message.pop("tool_calls")
        out.append(message)
    if tools:
        prompt = tools_system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def parse_tool_calls(text: str, mode: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of an answer under the tool mode (see the module docstring).
    named: the caller names the function (`named_call`); here it yields no call."""
    if mode == "required":
        calls = _json_calls(text)
        return (None, _as_written(calls, text, "required")) if calls else (text, [])
    if mode != "auto":
        return text, []
    if TOOL_CALL_OPEN in text:
        head = text[: text.index(TOOL_CALL_OPEN)]
        calls = [c for body in _HERMES_CALL.findall(text) if (c := _call_of(_loads(body)))]
        if calls:
            return head.strip() or None, _as_written(calls, text[len(head) :], "hermes")
        return text, []
    stripped = text.strip()
    for prefix in _JSON_CALL_PREFIXES:
        stripped = stripped.removeprefix(prefix).lstrip()
    calls = _json_calls(stripped) if stripped[:1] in ("{", "[") else []
    return (None, calls) if calls else (text, [])


def named_call(name: str, text: str) -> ToolCall:
    """The forced call of a named tool_choice: the answer is its arguments."""
    return ToolCall(id=new_call_id(), function=FunctionCall(name=name, arguments=text))


def _as_written(calls: list[ToolCall], text: str, mode: str) -> list[ToolCall]:
    """calls with their arguments as the answer wrote them (what a stream of it sends,
    pdrouter.wire.call_scanner), not re-serialized."""
    written = written_arguments(text, mode)
    if [name for name, _ in written] != [call.function.name for call in calls]:
        return calls
    return [
        ToolCall(id=call.id, function=FunctionCall(name=call.function.name, arguments=arguments))
        for call, (_, arguments) in zip(calls, written, strict=True)
    ]


def _json_calls(text: str) -> list[ToolCall]:
    value = _loads(text)
    items = value if isinstance(value, list) else [value]
    calls = [_call_of(item) for item in items]
    return [c for c in calls if c is not None] if all(calls) else []


def _call_of(value: Any) -> ToolCall | None:
    if not isinstance(value, dict) or not isinstance(value.get(CALL_NAME_KEY), str):
        return None
    arguments = value.get("arguments", value.get(CALL_ARGUMENTS_KEY, {}))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    name = value[CALL_NAME_KEY]
    return ToolCall(id=new_call_id(), function=FunctionCall(name=name, arguments=arguments))


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None
