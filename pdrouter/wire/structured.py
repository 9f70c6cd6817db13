"""Structured output and tools on the wire: response_format, tools, tool_choice, tool calls.

The request models the router and the workers parse (with `pdrouter.wire.openai`), and the
one decision both sides derive from them, `output_constraint`: the JSON schema the answer must
match, if any, and the parameter to name when that schema cannot be compiled:

    response_format {"type": "json_object"}                -> any JSON object
    response_format {"type": "json_schema", json_schema}   -> json_schema.schema
    tools + tool_choice {"type": "function", ...}          -> that function's parameters
    tools + tool_choice "required"                         -> a list of calls, one or more
                                                              (one when parallel_tool_calls
                                                              is false), each a tool's name and
                                                              its parameters
    tools + tool_choice "auto" (the default) | "none"      -> free text (auto: tool calls are
                                                              parsed from it afterwards)

The workers compile the schema into a grammar (workers.engine.grammar); how tool calls are
rendered and parsed is `pdrouter.wire.tool_calls`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from pdrouter.wire.protocol_error import ProtocolError
from pdrouter.wire.strict import Strict

# OpenAI's rule for function and schema names.
NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
# The request models here, by the names the OpenAPI document gives them (null allowed there).
STRUCTURED_REQUEST_SCHEMAS = (
    "ResponseFormat",
    "JsonSchemaFormat",
    "Tool",
    "FunctionDefinition",
    "NamedToolChoice",
    "FunctionName",
    "ToolCall",
    "FunctionCall",
)
# The required choice's answer: [{"name": ..., "parameters": {...}}, ...].
CALL_NAME_KEY, CALL_ARGUMENTS_KEY = "name", "parameters"


class JsonSchemaFormat(Strict):
    name: str = Field("response", pattern=NAME_PATTERN)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema")
        return self


class FunctionDefinition(Strict):
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def parameters_schema(self) -> dict[str, Any]:
        """The arguments' schema; a function without parameters takes an empty object."""
        if self.parameters is None:
            return {"type": "object", "properties": {}}
        return self.parameters


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ToolFields(Strict):
    """The chat request's tool fields (mixed into ChatCompletionRequest)."""

    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True

    @field_validator("tools")
    @classmethod
    def _distinct_names(cls, tools: list[Tool] | None) -> list[Tool] | None:
        names = [t.function.name for t in tools or ()]
        if len(set(names)) != len(names):
            raise ValueError("tools must have distinct function names")
        return tools

    def tool_mode(self) -> str:
        """none | auto | required | named: what tool_choice asks, tools considered."""
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            return "named"
        if not self.tools:
            return "none"
        return choice or "auto"

    def check_tools(self) -> None:
        """A ProtocolError for a tool_choice the tools cannot satisfy."""
        choice = self.tool_choice
        if choice == "required" and not self.tools:
            raise ProtocolError("tool_choice 'required' needs at least one tool", "tool_choice")
        if isinstance(choice, NamedToolChoice) and self.named_tool() is None:
            raise ProtocolError(
                f"tool_choice names function {choice.function.name!r}, which is not in tools",
                "tool_choice",
            )

    def named_tool(self) -> FunctionDefinition | None:
        choice = self.tool_choice
        if not isinstance(choice, NamedToolChoice):
            return None
        wanted = choice.function.name
        return next((t.function for t in self.tools or () if t.function.name == wanted), None)

    def rendered_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template sees them (OpenAI's shape); None: none to render."""
        if self.tool_mode() == "none":
            return None
        return [t.model_dump(by_alias=True, exclude_none=True) for t in self.tools or ()]


@dataclass(frozen=True)
class OutputConstraint:
    """The JSON schema an answer must match, and the parameter that asked for it."""

    schema_json: str  # compact JSON, properties in the given order: the compile cache key
    param: str


def output_constraint(
    response_format: ResponseFormat | None, tools: ToolFields | None
) -> OutputConstraint | None:
    """What the grammar must enforce for this request; None: free text."""
    if tools is not None:
        mode = tools.tool_mode()
        named = tools.named_tool()
        if named is not None:
            return _constraint(named.parameters_schema(), "tool_choice")
        if mode == "required":
            return _constraint(required_calls_schema(tools), "tools")
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return _constraint({"type": "object"}, "response_format")
    assert response_format.json_schema is not None  # checked at parse time
    return _constraint(response_format.json_schema.schema_, "response_format.json_schema.schema")


def required_calls_schema(tools: ToolFields) -> dict[str, Any]:
    """A non-empty list of calls of the given tools (one at most without parallel calls)."""
    one_of_calls = [
        {
            "type": "object",
            "properties": {
                CALL_NAME_KEY: {"const": t.function.name},
                CALL_ARGUMENTS_KEY: t.function.parameters_schema(),
            },
            "required": [CALL_NAME_KEY, CALL_ARGUMENTS_KEY],
            "additionalProperties": False,
        }
        for t in tools.tools or ()
    ]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": one_of_calls}, "minItems": 1}
    if not tools.parallel_tool_calls:
        schema["maxItems"] = 1
    return schema


def _constraint(schema: dict[str, Any], param: str) -> OutputConstraint:
    return OutputConstraint(json.dumps(schema, separators=(",", ":")), param)
