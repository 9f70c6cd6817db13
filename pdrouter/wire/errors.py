"""APIError: the one error type of every process the project runs, with the one body.

    APIError(status, message, err_type, param, code, stage, retry_after_s, extra_headers)
        .body()     {"error": {"message", "type", "param", "code"}}  (error_body)
        .headers()  Retry-After when given (overload, nothing reachable), Allow on a 405

Router and workers raise it from their services; one mapping they share
(pdrouter.common.error_mapping) turns it, and every other exception, into the answer. stage
names the hop that failed (`router`, `prefill`, `decode`), so that a 502/503 says where.

A string the client sent (a model name, a path, a method) goes into a message through `clip`:
whole, a 190 KB model name was echoed in every 400 and logged whole on every request.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


def error_body(
    message: str,
    err_type: str = "invalid_request_error",
    param: str | None = None,
    code: str | int | None = None,
) -> dict[str, Any]:
    """The OpenAI error body as a plain dict, ready for a JSON response."""
    return ErrorResponse(
        error=ErrorInfo(message=message, type=err_type, param=param, code=code)
    ).model_dump()


# The most characters of a client's string an error message (and so a log line) quotes.
CLIP_CHARS = 64


def clip(text: str, max_chars: int = CLIP_CHARS) -> str:
    """text when short, else its first max_chars characters, an ellipsis and its length."""
    if len(text) <= max_chars:
        return text
    return f"{text[:max_chars]}... ({len(text)} characters)"


class APIError(Exception):
    """An HTTP status and an OpenAI error body for the caller."""

    def __init__(
        self,
        status: int,
        message: str,
        err_type: str = "server_error",
        param: str | None = None,
        code: str | None = None,
        stage: str = "router",
        retry_after_s: int | None = None,
        extra_headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.param = param
        self.code = code
        self.stage = stage
        self.retry_after_s = retry_after_s
        self.extra_headers = extra_headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.err_type, self.param, self.code)

    def headers(self) -> dict[str, str]:
        headers = dict(self.extra_headers) if self.extra_headers else {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(self.retry_after_s)
        return headers


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """400 invalid_request_error; param names the field."""
    return APIError(400, message, "invalid_request_error", param, code)


def not_found(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(404, message, "invalid_request_error", param, code)


def unavailable(message: str, code: str, retry_after_s: int = 1) -> APIError:
    """503 service_unavailable with Retry-After (loading, full, a dependency down)."""
    return APIError(503, message, "service_unavailable", None, code, retry_after_s=retry_after_s)
