"""The OpenAPI document of the router and of a worker: every route, its schemas, every status.

FastAPI describes the routes it serves, with its default 200 and 422 only. This module
completes that document (`install_openapi(app, statuses)`):

- the two OpenAI routes (`POST /v1/completions`, `/v1/chat/completions`) with their request
  schema (from `pdrouter.wire.openai`, as parsed: JSON null is "omitted" for every optional
  field; an unsupported parameter accepts only its no-op values) and their answers:
  `application/json` or `text/event-stream` (`stream: true`);
- per operation, every error status it can answer, each with the OpenAI error body
  (`ErrorResponse`); statuses are given by the app (ROUTER_STATUSES, WORKER_STATUSES), plus
  those every route can answer (ANY_ROUTE_STATUSES: a malformed or slow request head, 500);
- `GET /metrics` as `text/plain` (the Prometheus text format);
- per operation whose path the server's door locks (pdrouter.common.doors), the credentials
  it accepts (`security`: a bearer key, or the router's secret header), so that a client, and
  schemathesis, know a 401 is the answer without them (to a wrong method too: the key is
  checked before the method).

Tested by schemathesis against the live servers (tests/e2e/api/test_schemathesis.py).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, Protocol

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from pdrouter.wire.errors import ErrorResponse
from pdrouter.wire.openai import (
    MAX_BATCH_PROMPTS,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
)
from pdrouter.wire.responses_api import RESPONSES_PATH, ResponsesRequest
from pdrouter.wire.structured import STRUCTURED_REQUEST_SCHEMAS
from pdrouter.wire.unsupported import UNSUPPORTED_NOOP_VALUES, noop_schema

REF = "#/components/schemas/{model}"
# The security schemes of the credentials a door accepts (pdrouter.common.auth.Credential).
SECURITY_SCHEMES = {
    "bearer": {"type": "http", "scheme": "bearer"},
    "internalSecret": {"type": "apiKey", "in": "header", "name": "X-PD-Internal-Secret"},
}
_SCHEME_OF = {"client": "bearer", "admin": "bearer", "internal": "internalSecret"}


class Door(Protocol):
    """What the document needs of a server's door (pdrouter.common.auth.AuthGate)."""

    def accepted(self, path: str) -> frozenset[Any]: ...


ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}

# The reason phrase of each status a route may document.
STATUS_TEXT = {
    400: "Malformed or unsupported request (the error's param names the field)",
    401: "Missing or wrong bearer key",
    404: "Unknown model, instance or request id",
    405: "Method not allowed (the Allow header lists the allowed ones)",
    408: "The request head or body did not arrive in time",
    409: "Conflict (a request id already in flight, an instance URL already registered)",
    413: "Request body too large",
    429: "Too many requests in flight (Retry-After says when to retry)",
    431: "Request header fields too large or too many",
    500: "Internal error (the server's log has the details)",
    502: "A worker failed the request",
    503: "Not ready, overloaded or no worker available (Retry-After when known)",
    504: "A worker did not answer in time",
}
# Statuses any route can answer, before (or whatever) its handler does.
ANY_ROUTE_STATUSES = (408, 431, 500)

# Route -> method -> error statuses of its handler, beyond ANY_ROUTE_STATUSES.
Statuses = Mapping[str, Mapping[str, tuple[int, ...]]]
_OPENAI_ROUTER = (400, 401, 404, 409, 413, 429, 502, 503)
ROUTER_STATUSES: Statuses = {
    "/v1/completions": {"post": _OPENAI_ROUTER},
    "/v1/chat/completions": {"post": _OPENAI_ROUTER},
    RESPONSES_PATH: {"post": _OPENAI_ROUTER},
    "/v1/models": {"get": (401,)},
    "/v1/models/{model_id}": {"get": (401, 404)},
    "/tokenize": {"post": (400, 401, 502, 503)},
    "/detokenize": {"post": (400, 401, 502, 503)},
    "/tokenizer_info": {"get": (401, 502, 503)},
    "/health": {"get": (503,)},
    "/debug/requests/{request_id}": {"get": (401, 404)},
    "/instances": {"get": (401,), "post": (400, 401, 409)},
    "/instances/{instance_id}": {"get": (401, 404), "delete": (401, 404)},
    "/instances/{instance_id}/heartbeat": {"put": (401, 404)},
    "/instances/{instance_id}/drain": {"post": (401, 404)},
    "/instances/{instance_id}/undrain": {"post": (401, 404)},
}
_OPENAI_WORKER = (400, 404, 409, 413, 503)
WORKER_STATUSES: Statuses = {
    "/v1/completions": {"post": _OPENAI_WORKER},
    "/v1/chat/completions": {"post": _OPENAI_WORKER},
    RESPONSES_PATH: {"post": _OPENAI_WORKER},
    "/health": {"get": (503,)},
    "/v1/models/{model_id}": {"get": (404,)},
    "/tokenize": {"post": (400, 503)},
    "/detokenize": {"post": (400, 503)},
    "/tokenizer_info": {"get": (503,)},
    "/internal/prefill": {"post": (400, 401, 404, 409, 413, 503)},
    "/internal/decode": {"post": (400, 401, 404, 409, 413, 503)},
}

OPENAI_ROUTES = {
    "/v1/completions": ("Completions", CompletionRequest, CompletionResponse, CompletionResponse),
    "/v1/chat/completions": (
        "Chat completions",
        ChatCompletionRequest,
        ChatCompletionResponse,
        ChatCompletionChunk,
    ),
}
_MODES: list[tuple[type[BaseModel], Any]] = [
    (CompletionRequest, "validation"),
    (ChatCompletionRequest, "validation"),
    (CompletionResponse, "serialization"),
    (ChatCompletionResponse, "serialization"),
    (ChatCompletionChunk, "serialization"),
    (ErrorResponse, "serialization"),
    (ResponsesRequest, "validation"),
]
_REQUEST_SCHEMAS = (
    "CompletionRequest",
    "ChatCompletionRequest",
    "ChatMessage",
    "StreamOptions",
    "ResponsesRequest",
    *STRUCTURED_REQUEST_SCHEMAS,
)


def _allows_null(schema: dict[str, Any]) -> bool:
    if schema.get("type") == "null" or "$ref" in schema:
        return schema.get("type") == "null"
    return any(_allows_null(s) for s in schema.get("anyOf", ()))


def _as_parsed(name: str, schema: dict[str, Any]) -> None:
    """A request schema as parse_request reads it: null allowed for every optional field;
    an unsupported parameter limited to its no-op values."""
    required = set(schema.get("required", ()))
    for field, prop in list(schema.get("properties", {}).items()):
        if field in UNSUPPORTED_NOOP_VALUES:
            prop = noop_schema(field)
        if field not in required and not _allows_null(prop):
            prop = {"anyOf": [prop, {"type": "null"}]}
        schema["properties"][field] = prop
    if name == "CompletionRequest":
        # a batch: at least one prompt, at most MAX_BATCH_PROMPTS
        for alternative in schema["properties"]["prompt"]["anyOf"]:
            if alternative.get("type") == "array" and alternative["items"].get("type") != (
                "integer"
            ):
                alternative["minItems"], alternative["maxItems"] = 1, MAX_BATCH_PROMPTS


def component_schemas() -> dict[str, Any]:
    """The schemas of the OpenAI bodies, named as components."""
    _, defs = models_json_schema(_MODES, ref_template=REF)
    schemas = defs["$defs"]
    for name in _REQUEST_SCHEMAS:
        _as_parsed(name, schemas[name])
    return schemas


def _error_responses(statuses: tuple[int, ...]) -> dict[str, Any]:
    responses: dict[str, Any] = {}
    for status in sorted(set(statuses) | set(ANY_ROUTE_STATUSES)):
        responses[str(status)] = {
            "description": STATUS_TEXT[status],
            "content": {"application/json": {"schema": ERROR_REF}},
        }
    return responses


def _openai_operation(path: str) -> dict[str, Any]:
    summary, request, response, chunk = OPENAI_ROUTES[path]
    name = lambda model: {"$ref": REF.format(model=model.__name__)}  # noqa: E731
    return {
        "summary": summary,
        "operationId": "create_" + path.rsplit("/", 1)[1].replace(".", "_"),
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": name(request)}},
        },
        "responses": {
            "200": {
                "description": "The answer: one JSON body, or (stream: true) server-sent "
                f"events, each `data: <{chunk.__name__}>`, ending with `data: [DONE]`",
                "content": {
                    "application/json": {"schema": name(response)},
                    "text/event-stream": {"schema": {"type": "string"}},
                },
            }
        },
    }


def _declare_security(doc: dict[str, Any], door: Door) -> None:
    """security on every operation of a path door locks: the schemes of what it accepts."""
    used: set[str] = set()
    for path, operations in doc["paths"].items():
        schemes = sorted({_SCHEME_OF[credential] for credential in door.accepted(path)})
        for operation in operations.values():
            if schemes:
                operation["security"] = [{scheme: []} for scheme in schemes]
        used.update(schemes)
    if used:
        doc["components"]["securitySchemes"] = {name: SECURITY_SCHEMES[name] for name in used}


def complete_openapi(
    doc: dict[str, Any], statuses: Statuses, door: Door | None = None
) -> dict[str, Any]:
    """doc (FastAPI's) with the OpenAI routes, their schemas, every route's statuses and,
    given the server's door, the credentials each route needs."""
    doc = copy.deepcopy(doc)
    paths = doc.setdefault("paths", {})
    for path in OPENAI_ROUTES:
        paths.setdefault(path, {})["post"] = _openai_operation(path)
    paths.setdefault(RESPONSES_PATH, {})["post"] = responses_operation(
        REF.format(model=ResponsesRequest.__name__)
    )
    doc.setdefault("components", {}).setdefault("schemas", {}).update(component_schemas())
    for path, operations in paths.items():
        for method, operation in operations.items():
            errors = statuses.get(path, {}).get(method, ())
            operation.setdefault("responses", {}).pop("422", None)  # every one is a 400 here
            operation["responses"].update(_error_responses(errors))
            if path == "/metrics" and method == "get":
                operation["responses"]["200"] = {
                    "description": "Prometheus metrics (text exposition format)",
                    "content": {"text/plain": {"schema": {"type": "string"}}},
                }
    if door is not None:
        _declare_security(doc, door)
    return doc


def _gate_middleware_door(app: FastAPI) -> Door | None:
    """The door of app's GateMiddleware (a worker's), if it has one."""
    for middleware in app.user_middleware:
        door = middleware.kwargs.get("gate")
        if door is not None:
            return door  # type: ignore[no-any-return]
    return None


def install_openapi(app: FastAPI, statuses: Statuses, door: Door | None = None) -> None:
    """Make app.openapi() (and /openapi.json, /docs) return the complete document. door: the
    server's (default: that of its GateMiddleware, when it has one), for `security`."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            base = get_openapi(
                title=app.title, version=app.version, routes=app.routes, description=None
            )
            found = door if door is not None else _gate_middleware_door(app)
            app.openapi_schema = complete_openapi(base, statuses, found)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def responses_operation(request_ref: str) -> dict[str, Any]:
    """The OpenAPI operation of POST /v1/responses (its errors are added with the others)."""
    response = {
        "type": "object",
        "required": ["id", "object", "created_at", "status", "model", "output"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "response"},
            "created_at": {"type": "number"},
            "status": {"enum": ["completed", "incomplete"]},
            "model": {"type": "string"},
            "output": {"type": "array", "items": {"type": "object"}},
            "usage": {"type": "object"},
        },
    }
    return {
        "summary": "Responses (served by the chat completions path; nothing is stored)",
        "operationId": "create_response",
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": request_ref}}},
        },
        "responses": {
            "200": {
                "description": "The Response, or (stream: true) server-sent events, each "
                "`event: <type>` and `data: <event>`, from response.created to response.completed",
                "content": {
                    "application/json": {"schema": response},
                    "text/event-stream": {"schema": {"type": "string"}},
                },
            }
        },
    }
