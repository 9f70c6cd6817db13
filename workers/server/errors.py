"""One error shape for every failure a worker answers: the OpenAI error body.

    ProtocolError / ValueError from validation -> 400 invalid_request_error (param names the field)
    unknown route / method                     -> 404 / 405 in OpenAI shape
    ServiceError(status=503, retry_after_s=..) -> 503 with Retry-After (not ready, overloaded)
    anything else                              -> 500 without internals; traceback to the log

Handlers raise; `install_error_handlers(app)` maps. FastAPI's default 422 for malformed bodies
is replaced by a 400, because OpenAI clients expect 400 for every bad input.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdrouter.wire.openai import ProtocolError, error_body

log = logging.getLogger(__name__)


class ServiceError(Exception):
    """A failure with a definite HTTP status and OpenAI error type."""

    def __init__(
        self,
        status_code: int,
        message: str,
        err_type: str,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.err_type = err_type
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def to_response(self) -> JSONResponse:
        headers = {"Retry-After": str(self.retry_after_s)} if self.retry_after_s else None
        body = error_body(self.message, self.err_type, self.param, self.code)
        return JSONResponse(body, status_code=self.status_code, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ServiceError:
    return ServiceError(400, message, "invalid_request_error", param, code)


def not_found(message: str, param: str | None = None, code: str | None = None) -> ServiceError:
    return ServiceError(404, message, "invalid_request_error", param, code)


def unavailable(message: str, code: str, retry_after_s: int = 1) -> ServiceError:
    return ServiceError(503, message, "service_unavailable", None, code, retry_after_s)


def from_protocol_error(exc: ProtocolError) -> ServiceError:
    return bad_request(exc.message, exc.param)


def install_error_handlers(app: FastAPI) -> None:
    """Map every exception a request can raise to the OpenAI error body."""

    async def on_service_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ServiceError)
        return exc.to_response()

    async def on_protocol_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ProtocolError)
        return from_protocol_error(exc).to_response()

    async def on_validation_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        first = exc.errors()[0] if exc.errors() else {"msg": "invalid request", "loc": ()}
        param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        return bad_request(str(first.get("msg")), param).to_response()

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
            return not_found(message, code="unknown_url").to_response()
        if exc.status_code == 405:
            message = f"method {request.method} not allowed on {request.url.path}"
            return ServiceError(405, message, "invalid_request_error").to_response()
        err_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return ServiceError(exc.status_code, str(exc.detail), err_type).to_response()

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        message = "internal server error; the worker log has the details"
        return ServiceError(500, message, "server_error").to_response()

    app.add_exception_handler(ServiceError, on_service_error)
    app.add_exception_handler(ProtocolError, on_protocol_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected)
