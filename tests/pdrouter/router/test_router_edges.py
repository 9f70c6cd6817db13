"""The router's edge refuses what it cannot serve with a 400 naming it, never a 500, and echoes
no client string whole: non-finite JSON numbers, too many stop strings, a trailing-slash
redirect built from Host, a long path; its OpenAPI document says which routes need a key."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import httpx

from pdrouter.router.config import RouterConfig
from tests.pdrouter.router.in_process_router import in_process_router

API, ADMIN = "sk-edge-api", "edge-admin"


@contextlib.asynccontextmanager
async def _router(api_key: str | None = None) -> AsyncIterator[httpx.AsyncClient]:
    cfg = RouterConfig(prefill_urls=(), decode_urls=(), admin_key=ADMIN, api_key=api_key)
    async for client in in_process_router(cfg, timeout_s=10.0):
        yield client


async def test_nan_in_an_ignored_field_with_seed_in_the_body_is_a_400() -> None:
    """The body's text spells "seed", so the router re-encodes it to add one: with a NaN in an
    unknown field that re-encoding answered 500 with a traceback."""
    async with _router() as router:
        for constant in (b"NaN", b"Infinity", b"-Infinity"):
            body = b'{"model": "tiny", "prompt": "my seed", "extra": [1, %s]}' % constant
            resp = await router.post("/v1/completions", content=body)
            assert resp.status_code == 400, resp.text
            error = resp.json()["error"]
            assert error["type"] == "invalid_request_error"
            assert error["message"] == (
                f"request body is not valid JSON: {constant.decode()} is not a JSON value "
                "(numbers are finite)"
            )
        # The same letters inside a string are text, not a number: past the parse (503: no
        # decode instance here).
        body = b'{"model": "tiny", "prompt": "NaN Infinity seed"}'
        assert (await router.post("/v1/completions", content=body)).status_code == 503


async def test_stop_strings_are_bounded() -> None:
    async with _router() as router:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                "stop": [f"stop{i}" for i in range(15_000)]}  # fmt: skip
        resp = await router.post("/v1/chat/completions", json=body)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == "stop"
        assert resp.json()["error"]["message"] == "stop: at most 16 stop strings (got 15000)"
        body["stop"] = [f"stop{i}" for i in range(16)]
        assert (await router.post("/v1/chat/completions", json=body)).status_code == 503


async def test_no_redirect_is_built_from_the_host_header() -> None:
    async with _router() as router:
        for path in ("/v1/models/", "/health/", "/instances/"):
            resp = await router.get(path, headers={"Host": "evil.example"})
            assert "location" not in resp.headers, (path, resp.headers)
            assert resp.status_code in (401, 404), (path, resp.status_code)


async def test_a_long_path_is_quoted_clipped() -> None:
    async with _router() as router:
        path = "/" + "p" * 5000
        resp = await router.get(path)
        assert resp.status_code == 404
        assert resp.json()["error"]["message"] == f"no route GET /{'p' * 63}... (5001 characters)"


async def test_the_document_declares_the_routes_a_key_opens() -> None:
    async with _router(API) as router:
        admin = {"Authorization": f"Bearer {ADMIN}"}
        doc = (await router.get("/openapi.json", headers=admin)).json()
    assert doc["components"]["securitySchemes"] == {"bearer": {"type": "http", "scheme": "bearer"}}
    secured = {
        (path, method): operation.get("security")
        for path, operations in doc["paths"].items()
        for method, operation in operations.items()
    }
    assert secured[("/health", "get")] is None
    assert secured[("/instances", "post")] == [{"bearer": []}]
    assert secured[("/v1/completions", "post")] == [{"bearer": []}]
    async with _router(None) as router:  # no API key: /v1/* open, the admin API still keyed
        doc = (await router.get("/openapi.json")).json()
    assert "security" not in doc["paths"]["/v1/completions"]["post"]
    assert doc["paths"]["/instances"]["get"]["security"] == [{"bearer": []}]
