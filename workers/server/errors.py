"""One error shape for every failure a worker answers: the OpenAI error body.

    ProtocolError / ValueError from validation -> 400 invalid_request_error (param names the field)
    unknown route / method                     -> 404 / 405 in OpenAI shape
    APIError(503, retry_after_s=..)            -> 503 with Retry-After (not ready, overloaded)
    anything else                              -> 500 without internals; traceback to the log

Handlers raise pdrouter.wire.errors.APIError (the one error type router and workers share);
`install_error_handlers(app)` maps. FastAPI's default 422 for malformed bodies
is replaced by a 400, because OpenAI clients expect 400 for every bad input.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdrouter.common.allow import allowed_methods
from pdrouter.wire.errors import APIError, bad_request, not_found
from pdrouter.wire.openai import ProtocolError

log = logging.getLogger(__name__)


def to_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers() or None)


def install_error_handlers(app: FastAPI) -> None:
    """Map every exception a request can raise to the OpenAI error body."""

    async def on_api_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return to_response(exc)

    async def on_protocol_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ProtocolError)
        return to_response(bad_request(exc.message, exc.param))

    async def on_validation_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        first = exc.errors()[0] if exc.errors() else {"msg": "invalid request", "loc": ()}
        param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        return to_response(bad_request(str(first.get("msg")), param))

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
            return to_response(not_found(message, code="unknown_url"))
        if exc.status_code == 405:
            message = f"method {request.method} not allowed on {request.url.path}"
            allow = {"Allow": allowed_methods(app.router.routes, request.scope)}
            return to_response(APIError(405, message, "invalid_request_error", extra_headers=allow))
        err_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return to_response(APIError(exc.status_code, str(exc.detail), err_type))

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        message = "internal server error; the worker log has the details"
        return to_response(APIError(500, message, "server_error"))

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(ProtocolError, on_protocol_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected)
