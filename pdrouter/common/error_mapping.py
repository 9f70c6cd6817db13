"""One error mapping for every HTTP server the project runs (the router, every worker): whatever
a request raises, the caller gets the OpenAI error body, one status per kind of failure.

    APIError                  its status, body and headers (Retry-After, Allow)
    ProtocolError             400 invalid_request_error, param naming the field
    RequestValidationError    400 invalid_request_error, param naming the parameter (FastAPI's
                              422 {"detail": [...]} replaced: OpenAI clients expect 400)
    HTTPException             404 unknown_url and 405 with Allow, naming method and path;
                              any other status as is
    ValueError, anything else 500 server_error without internals; the traceback to the log

A stray ValueError is a 500, not a 400. Input is validated where it is read (parse_request,
the wire models, the handlers), and that code raises ProtocolError or APIError(400) naming the
field; a ValueError that gets here escaped from the server's own code (misuse). Calling it the
client's fault would also hide it: the router passes a worker's 4xx through to the client and
counts the worker as working.

`api_error(exc, server, where)` is the mapping. The FastAPI apps install it with
`install_error_handlers(app, server)`; the router's plain-ASGI OpenAI routes call api_error
themselves (pdrouter.router.service). ValueError has a handler of its own, next to the one for
every other exception: Starlette runs that last one outside the app's middleware and then
raises the exception again for the server to log a second time; the ValueError handler
answers inside it, with the request id, and logs once.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from pdrouter.common.allow import allowed_methods
from pdrouter.wire.errors import APIError, bad_request, clip, not_found
from pdrouter.wire.openai import ProtocolError
from pdrouter.wire.pd import REQUEST_ID_HEADER

logger = logging.getLogger(__name__)


def api_error(exc: Exception, server: str, where: str) -> APIError:
    """The APIError that exc answers as; an unexpected one (a 500) is logged with its
    traceback, as `where: unhandled error`. server names the process in the client's
    message (`router`, `worker`). HTTPException: see install_error_handlers."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ProtocolError):
        return bad_request(exc.message, exc.param)
    if isinstance(exc, RequestValidationError):
        return _validation_error(exc)
    logger.error("%s: unhandled error", where, exc_info=exc)
    return APIError(500, f"internal {server} error; the {server} log has the details")


def _validation_error(exc: RequestValidationError) -> APIError:
    """FastAPI's first complaint, naming the parameter (`if_drained`, `messages.0.role`)."""
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request")
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ())]
    # loc starts with where the parameter was: body, query, path, header or cookie.
    param = ".".join(loc[1:]) or None
    message = str(first.get("msg", "invalid value"))
    return bad_request(f"{param}: {message}" if param else message, param)


def error_response(exc: APIError, request_id: str | None = None) -> JSONResponse:
    headers = exc.headers()
    if request_id:
        headers[REQUEST_ID_HEADER] = request_id
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers or None)


def install_error_handlers(app: FastAPI, server: str) -> None:
    """Answer every exception a request of app raises with api_error's body (server names the
    process in a 500's message)."""

    async def on_error(request: Request, exc: Exception) -> JSONResponse:
        where = f"{clip(request.method)} {clip(request.url.path)}"
        err = api_error(exc, server, where)
        return error_response(err, getattr(request.state, "request_id", None))

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        status = exc.status_code
        where = f"{clip(request.method)} {clip(request.url.path)}"
        if status == 404:
            err = not_found(f"no route {where}", code="unknown_url")
        elif status == 405:
            allow = {"Allow": allowed_methods(app.router.routes, request.scope)}
            message = f"method {clip(request.method)} not allowed on {clip(request.url.path)}"
            err = APIError(405, message, "invalid_request_error", extra_headers=allow)
        else:
            err_type = "invalid_request_error" if status < 500 else "server_error"
            headers = dict(exc.headers or {})
            err = APIError(status, f"{exc.detail}: {where}", err_type, extra_headers=headers)
        return error_response(err, getattr(request.state, "request_id", None))

    for exc_class in (APIError, ProtocolError, RequestValidationError, ValueError, Exception):
        app.add_exception_handler(exc_class, on_error)
    app.add_exception_handler(HTTPException, on_http_error)
