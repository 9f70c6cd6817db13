"""The router's error answers on its FastAPI routes: every failure in the one OpenAI shape.

    APIError        -> its status and body (Retry-After, Allow where it says so)
    ProtocolError      -> 400 invalid_request_error naming the field
    HTTPException      -> its status (404 unknown route, 405 method) in the OpenAI shape
    anything else      -> 500 without internals; the traceback goes to the router's log

The two OpenAI POST routes answer their errors themselves (service.py), with the same bodies.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdrouter.common.allow import allowed_methods
from pdrouter.wire.errors import APIError
from pdrouter.wire.openai import ProtocolError
from pdrouter.wire.pd import REQUEST_ID_HEADER

logger = logging.getLogger(__name__)


def error_response(exc: APIError, request_id: str | None = None) -> JSONResponse:
    headers = exc.headers()
    if request_id:
        headers[REQUEST_ID_HEADER] = request_id
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    async def on_router_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return error_response(exc, getattr(request.state, "request_id", None))

    async def on_protocol_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ProtocolError)
        return error_response(APIError(400, exc.message, "invalid_request_error", exc.param))

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        message = f"{exc.detail}: {request.method} {request.url.path}"
        err_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            headers["Allow"] = allowed_methods(app.router.routes, request.scope)
        return error_response(APIError(exc.status_code, message, err_type, extra_headers=headers))

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        err = APIError(500, "internal router error; the router log has the details")
        return error_response(err, getattr(request.state, "request_id", None))

    app.add_exception_handler(APIError, on_router_error)
    app.add_exception_handler(ProtocolError, on_protocol_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected)
