"""pdrouter.wire.openapi: the router's document describes the OpenAI routes, every status each
route can answer (with the error body) and /metrics as text; every 405 carries Allow."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from pdrouter.common.proc import find_free_port
from pdrouter.router.config import RouterConfig
from pdrouter.wire.openapi import ANY_ROUTE_STATUSES, ROUTER_STATUSES, component_schemas
from pdrouter.wire.unsupported import UNSUPPORTED_NOOP_VALUES
from tests.pdrouter.router.in_process_router import in_process_router


@pytest.fixture
async def router() -> AsyncIterator[httpx.AsyncClient]:
    cfg = RouterConfig(
        prefill_urls=(f"http://127.0.0.1:{find_free_port()}",),
        decode_urls=(f"http://127.0.0.1:{find_free_port()}",),
    )
    async for client in in_process_router(cfg, timeout_s=5.0):
        yield client


async def test_openai_routes_are_described_with_both_media_types(
    router: httpx.AsyncClient,
) -> None:
    doc = (await router.get("/openapi.json")).json()
    for path, request, response in (
        ("/v1/completions", "CompletionRequest", "CompletionResponse"),
        ("/v1/chat/completions", "ChatCompletionRequest", "ChatCompletionResponse"),
    ):
        operation = doc["paths"][path]["post"]
        body = operation["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{request}"}
        ok = operation["responses"]["200"]["content"]
        assert ok["application/json"]["schema"] == {"$ref": f"#/components/schemas/{response}"}
        assert ok["text/event-stream"]["schema"] == {"type": "string"}
        statuses = {int(s) for s in operation["responses"]} - {200}
        assert statuses == {400, 401, 404, 408, 409, 413, 429, 431, 500, 502, 503}
    assert {"ChatCompletionChunk", "ErrorResponse", "ChatMessage"} <= set(
        doc["components"]["schemas"]
    )


async def test_every_route_declares_its_errors_with_the_error_body(
    router: httpx.AsyncClient,
) -> None:
    doc = (await router.get("/openapi.json")).json()
    for path, operations in doc["paths"].items():
        for method, operation in operations.items():
            expected = set(ROUTER_STATUSES.get(path, {}).get(method, ())) | set(ANY_ROUTE_STATUSES)
            for status in expected:
                content = operation["responses"][str(status)]["content"]
                ref = content["application/json"]["schema"]["$ref"]
                assert ref == "#/components/schemas/ErrorResponse", (path, method, status)
    assert set(ROUTER_STATUSES) <= set(doc["paths"])
    metrics = doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain"]


def test_request_schemas_accept_null_and_only_noop_values() -> None:
    schemas = component_schemas()
    chat = schemas["ChatCompletionRequest"]
    assert set(chat["required"]) == {"model", "messages"}
    for name, prop in chat["properties"].items():
        if name not in chat["required"]:
            assert {"type": "null"} in prop["anyOf"], name
    functions = chat["properties"]["functions"]["anyOf"][0]
    assert (functions["type"], functions["maxItems"]) == ("array", 0)
    penalty = schemas["CompletionRequest"]["properties"]["presence_penalty"]["anyOf"][0]
    assert (penalty["minimum"], penalty["maximum"]) == (-2, 2)
    bias = schemas["CompletionRequest"]["properties"]["logit_bias"]["anyOf"][0]
    value = bias["patternProperties"]["^[0-9]{1,18}$"]
    assert (value["minimum"], value["maximum"]) == (-100, 100)
    assert "suffix" in schemas["CompletionRequest"]["properties"]
    assert set(UNSUPPORTED_NOOP_VALUES) <= set(chat["properties"]) | {"suffix"}


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("TRACE", "/health", "GET"),
        ("DELETE", "/v1/models", "GET"),
        ("PATCH", "/instances", "GET, POST"),  # two routes on one path: the union
        ("GET", "/instances/x/drain", "POST"),
        ("TRACE", "/v1/chat/completions", "POST"),
        ("PUT", "/v1/completions", "POST"),
    ],
)
async def test_every_405_carries_allow(
    router: httpx.AsyncClient, method: str, path: str, allow: str
) -> None:
    resp = await router.request(method, path)
    assert resp.status_code == 405, resp.text
    assert resp.headers["Allow"] == allow
    assert resp.json()["error"]["type"] == "invalid_request_error"
