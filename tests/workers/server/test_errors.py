"""The workers install the one error mapping router and workers share
(workers.server.errors over pdrouter.common.error_mapping): every failure of every route in the
OpenAI error body. In-process, on a small app with the worker's handlers installed."""

from __future__ import annotations

import logging

import httpx
import pytest
from fastapi import FastAPI

from pdrouter.wire.errors import unavailable
from pdrouter.wire.openai import ProtocolError
from workers.server.errors import install_error_handlers


def _app() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/raises/{kind}")
    async def raises(kind: str, flag: bool = False) -> dict[str, bool]:
        if kind == "value":
            raise ValueError("a bug")
        if kind == "protocol":
            raise ProtocolError("n must be 1", "n")
        if kind == "busy":
            raise unavailable("the engine is full", "kv_full", retry_after_s=2)
        return {"flag": flag}

    return app


async def _get(path: str) -> httpx.Response:
    transport = httpx.ASGITransport(app=_app(), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://worker") as client:
        return await client.get(path)


def _error(
    message: str, err_type: str, param: str | None = None, code: str | None = None
) -> dict[str, dict[str, str | None]]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


async def test_a_bad_parameter_is_a_400_naming_it() -> None:
    resp = await _get("/raises/none?flag=maybe")
    assert resp.status_code == 400
    assert resp.json() == _error(
        "flag: Input should be a valid boolean, unable to interpret input",
        "invalid_request_error",
        "flag",
    )


async def test_a_stray_value_error_is_a_500_without_internals(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.ERROR):
        resp = await _get("/raises/value")
    assert resp.status_code == 500
    message = "internal worker error; the worker log has the details"
    assert resp.json() == _error(message, "server_error")
    logged = [r.getMessage() for r in caplog.records if r.exc_info is not None]
    assert logged == ["GET /raises/value: unhandled error"]


async def test_protocol_errors_api_errors_and_unknown_routes_keep_their_status() -> None:
    resp = await _get("/raises/protocol")
    assert (resp.status_code, resp.json()) == (
        400, _error("n must be 1", "invalid_request_error", "n"))  # fmt: skip
    resp = await _get("/raises/busy")
    assert (resp.status_code, resp.headers["Retry-After"]) == (503, "2")
    assert resp.json() == _error("the engine is full", "service_unavailable", code="kv_full")
    resp = await _get("/nowhere")
    missing = _error("no route GET /nowhere", "invalid_request_error", code="unknown_url")
    assert (resp.status_code, resp.json()) == (404, missing)
