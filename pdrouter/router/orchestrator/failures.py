"""What a failed call to a worker means: one classification for the prefill and decode stages.

    failure                                        kind         marks down  breaker  then
    ---------------------------------------------  -----------  ----------  -------  ---------
    refused (ConnectError)                         unreachable  yes         failure  retry
    no connection in time (ConnectTimeout)         failed       no          failure  retry (a)
    the router's own pool full (PoolTimeout)       failed       no          -        retry (a)
    no bytes in time (ReadTimeout)                 failed       no          failure  retry
    reset, cut, malformed HTTP (ReadError,         failed       yes         failure  retry
      RemoteProtocolError, other transport errors)
    given up while found down (InstanceDown)       failed       yes         failure  retry
    answer 503 `overloaded` (the worker is full)   unavailable  no          -        retry (b)
    answer 503 (loading, draining, engine down)    unavailable  no          failure  retry
    answer 5xx other than 503                      failed       no          failure  retry
    answer 200 that breaks the contract (P's       failed       no          failure  retry
      result or D's events malformed; D's
      in-band error event)
    D's 502 naming missing keys (policy `fail`)    final        no          failure  502 to the
                                                   client (the pool is shared: another D
                                                   misses the same keys)
    answer 401 (the worker refused the router)     final        no          -        502 naming
                                                   --internal-secret (the deployment's fault)
    other 4xx (the client's request)               final        no          success  the
                                                   worker's status and message

    final: no other instance is tried; the client gets Failure.final at once
    (a) the call never reached the instance: when no untried instance is left, it may get
        another try while attempts last
    (b) busy is not down: a worker at its --max-pending-requests says nothing of its health,
        so its breaker stays as it was (opening it would turn its load into refusals for
        everyone for a cooldown, long after the load is gone)

A retry goes to another instance after a short backoff; a decode attempt that fails after D
sent events resumes on another D from the tokens the client has (a failover). When the
attempts run out, the client gets, the same for both stages:

    every attempt unreachable                  503 "no {stage} instance reachable", Retry-After
    every attempt unreachable or unavailable   503 "no {stage} instance available", Retry-After
    otherwise                                  502 "{stage} failed on every instance tried"
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

import httpx

from pdrouter.router.upstream.contract import UpstreamResponse
from pdrouter.wire.errors import APIError
from pdrouter.wire.pd import StageErrorBody

FailureKind = Literal["unreachable", "unavailable", "failed"]


@dataclass(frozen=True)
class Failure:
    """One failed attempt, classified."""

    kind: FailureKind
    reason: str  # what happened, for the client's message, the logs and the timeline
    metric: str  # the kind label of pdrouter_stage_failures_total
    breaker: bool | None  # the breaker's verdict: True a failure, None none (not the instance's)
    marks_down: bool  # the instance is taken out of the rotation at once
    reached: bool = True  # False: the call never got to the instance
    final: APIError | None = None  # the client's answer at once: no other instance is tried


def transport_failure(exc: httpx.HTTPError) -> Failure:
    """A call that raised (the upstream clients raise httpx's types, see upstream.contract)."""
    reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    name = type(exc).__name__
    if isinstance(exc, httpx.ConnectError):
        return Failure("unreachable", reason, name, breaker=True, marks_down=True)
    if isinstance(exc, httpx.PoolTimeout):  # the router's own pool says nothing of the worker
        return Failure("failed", reason, name, breaker=None, marks_down=False, reached=False)
    if isinstance(exc, httpx.ConnectTimeout):
        return Failure("failed", reason, name, breaker=True, marks_down=False, reached=False)
    if isinstance(exc, httpx.TimeoutException):  # slow, not dead: it stays in the rotation
        return Failure("failed", reason, name, breaker=True, marks_down=False)
    # Reset, cut or broken mid-call, or given up while its checks find it down (InstanceDown).
    return Failure("failed", reason, name, breaker=True, marks_down=True)


def contract_broken(what: str) -> Failure:
    """A 200 whose body is not what the P/D contract says (or D's in-band error event)."""
    return Failure("failed", what, "malformed", breaker=True, marks_down=False)


def _error_of(resp: UpstreamResponse) -> tuple[str, str, str | None, str | None, list[str] | None]:
    """(message, type, param, code, missing_keys) of a worker's error answer."""
    try:
        err = StageErrorBody.model_validate(json.loads(resp.content)).error
    except ValueError:
        return resp.text[:500] or f"HTTP {resp.status_code}", "server_error", None, None, None
    return err.message, err.type, err.param, err.code, err.missing_keys


def answer_outcome(stage: str, url: str, resp: UpstreamResponse) -> Failure:
    """A non-200 answer as the attempt's Failure; a final one (the client's 4xx, the router
    refused with 401, D's missing keys under the `fail` policy) carries the client's answer."""
    status = resp.status_code
    message, err_type, param, code, missing_keys = _error_of(resp)
    reason = f"HTTP {status}: {message}"
    if status == 401:
        # A worker refusing the router is a deployment error, never the client's 401, and
        # says nothing of the instance's health: no verdict.
        final = APIError(
            502,
            f"{stage} instance {url} refused the router ({message}); give the router and "
            "the workers the same --internal-secret",
            stage=stage,
        )
        return Failure("failed", reason, "http_401", None, marks_down=False, final=final)
    if status < 500:
        # A worker's 4xx is the client's fault and passes through as is (P is the tokenizer
        # of record, so it is P that rejects a prompt that is too long): the instance worked.
        final = APIError(status, message, err_type, param, code, stage=stage)
        return Failure("failed", reason, f"http_{status}", False, marks_down=False, final=final)
    if missing_keys:
        final = APIError(
            status,
            f"{stage} instance {url} failed: {message} (missing keys: {', '.join(missing_keys)})",
            err_type,
            param,
            code,
            stage=stage,
        )
        return Failure("failed", reason, f"http_{status}", True, marks_down=False, final=final)
    if status == 503 and code == "overloaded":  # busy, not down: no verdict (b)
        return Failure("unavailable", reason, "overloaded", breaker=None, marks_down=False)
    kind: FailureKind = "unavailable" if status == 503 else "failed"
    return Failure(kind, reason, f"http_{status}", breaker=True, marks_down=False)


def stage_error(stage: str, failures: list[tuple[str, Failure]]) -> APIError:
    """The client's error once every attempt of a stage failed ((url, failure) per attempt)."""
    detail = "; ".join(f"{url}: {f.reason}" for url, f in failures)
    detail = detail or f"no {stage} instance left to try"
    kinds = {f.kind for _, f in failures}
    if kinds <= {"unreachable"}:
        return APIError(
            503, f"no {stage} instance reachable ({detail})", stage=stage, retry_after_s=1
        )
    if kinds <= {"unreachable", "unavailable"}:
        return APIError(
            503, f"no {stage} instance available ({detail})", stage=stage, retry_after_s=1
        )
    return APIError(502, f"{stage} failed on every instance tried ({detail})", stage=stage)
