"""RouterError: one failure the router reports to its client, with the stage that failed."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Protocol

from pdrouter.wire.openai import error_body
from pdrouter.wire.pd import StageErrorBody


class ReadAnswer(Protocol):
    """A worker's answer whose body was read: the upstream clients' responses, httpx's."""

    status_code: int

    @property
    def content(self) -> bytes: ...

    @property
    def text(self) -> str: ...

    @property
    def headers(self) -> Mapping[str, str]: ...


class RouterError(Exception):
    """An HTTP status and an OpenAI error body for the client.

    stage names the hop that failed (`router`, `prefill`, `decode`) so that a 502/503 says
    where; retry_after_s adds a Retry-After header (overload, nothing reachable), and
    extra_headers any other (Allow on a 405).
    """

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

    @classmethod
    def from_upstream(cls, stage: str, url: str, resp: ReadAnswer) -> RouterError:
        """Relay a worker's error answer: its status and message, naming stage and instance.

        A worker's 4xx is the client's fault and passes through as is (P is the tokenizer of
        record, so it is P that rejects a prompt that is too long); 5xx names the hop.
        """
        try:
            err = StageErrorBody.model_validate(json.loads(resp.content)).error
            message, err_type, param, code = err.message, err.type, err.param, err.code
            if err.missing_keys:
                message = f"{message} (missing keys: {', '.join(err.missing_keys)})"
        except ValueError:
            message = resp.text[:500] or f"HTTP {resp.status_code}"
            err_type, param, code = "server_error", None, None
        if resp.status_code == 401:
            # A worker refusing the router is a deployment error, never the client's 401.
            return cls(
                502,
                f"{stage} instance {url} refused the router ({message}); give the router and "
                "the workers the same --internal-secret",
                stage=stage,
            )
        if resp.status_code < 500:
            return cls(resp.status_code, message, err_type, param, code, stage=stage)
        retry_after = resp.headers.get("Retry-After")
        return cls(
            resp.status_code,
            f"{stage} instance {url} failed: {message}",
            err_type,
            param,
            code,
            stage=stage,
            retry_after_s=int(retry_after) if retry_after and retry_after.isdigit() else None,
        )
