"""The workers' error answers: the one mapping router and workers share
(pdrouter.common.error_mapping), so that every route of every worker answers every failure with
the OpenAI error body:

    APIError                          its status (503 with Retry-After: loading, full, dead)
    ProtocolError, a bad parameter    400 invalid_request_error naming the field (never
                                      FastAPI's 422)
    unknown route / method            404 / 405 (with Allow)
    ValueError, anything else         500 without internals; the traceback to the log

Handlers raise pdrouter.wire.errors.APIError (the one error type router and workers share).
"""

from __future__ import annotations

from fastapi import FastAPI

from pdrouter.common import error_mapping


def install_error_handlers(app: FastAPI) -> None:
    """Map every exception a request of app can raise to the OpenAI error body."""
    error_mapping.install_error_handlers(app, "worker")
