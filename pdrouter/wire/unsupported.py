"""OpenAI request parameters this server does not implement: refused, never silently ignored.

A client that asks for legacy functions and gets prose back with a 200 has been misled; so
each such parameter is refused with a 400 naming it, unless
its value is one that changes nothing (the OpenAI default, or an explicit "off"), which
UNSUPPORTED_NOOP_VALUES lists. JSON null is "omitted" and never reaches this check (see
`pdrouter.wire.openai`).
"""

from __future__ import annotations

import json
from typing import Any

from pdrouter.wire.protocol_error import ProtocolError

# parameter -> the values that leave generation exactly as if it were omitted
UNSUPPORTED_NOOP_VALUES: dict[str, tuple[Any, ...]] = {
    "functions": ([],),
    "function_call": ("none",),
    "suffix": ("",),  # completions only
}


def _is_noop(name: str, value: Any) -> bool:
    for noop in UNSUPPORTED_NOOP_VALUES[name]:
        # bool is an int in Python: True must not pass as the number 1, nor 0 as False.
        if type(value) is bool or type(noop) is bool:
            if type(value) is type(noop) and value == noop:
                return True
        elif value == noop:
            return True
    return False


def check_unsupported(values: dict[str, Any]) -> None:
    """Raise ProtocolError for the first parameter set to a value this server cannot honour.

    values: the unsupported parameters the request carried (omitted and null ones left out).
    """
    for name, value in values.items():
        if value is not None and not _is_noop(name, value):
            raise ProtocolError(
                f"{name} is not supported by this server; omit it "
                f"(or send a value that changes nothing: {_noops(name)})",
                name,
            )


def _noops(name: str) -> str:
    return " or ".join(json.dumps(v) for v in UNSUPPORTED_NOOP_VALUES[name])


def noop_schema(name: str) -> dict[str, Any]:
    """The JSON schema of the values of name that this server accepts (the no-ops), for the
    OpenAPI document: a client generating requests from it never sends a value it refuses."""
    alternatives: list[dict[str, Any]] = []
    for noop in UNSUPPORTED_NOOP_VALUES[name]:
        if noop == [] and isinstance(noop, list):
            alternatives.append({"type": "array", "maxItems": 0})
        elif noop == {} and isinstance(noop, dict):
            alternatives.append({"type": "object", "maxProperties": 0})
        elif isinstance(noop, dict):
            props = {key: {"const": value} for key, value in noop.items()}
            exact = {"properties": props, "required": list(noop), "additionalProperties": False}
            alternatives.append({"type": "object", **exact})
        elif type(noop) is int:
            alternatives.append({"type": "number", "minimum": noop, "maximum": noop})
        elif type(noop) is bool:
            alternatives.append({"type": "boolean", "const": noop})
        else:
            alternatives.append({"type": "string", "const": noop})
    schema = alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}
    return {**schema, "description": f"Not supported: only {_noops(name)} (a no-op) is accepted."}
