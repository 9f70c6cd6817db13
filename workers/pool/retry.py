"""The retries of one batch: keys that failed with a retryable code are tried again.

    put: pool full (eviction lags allocation)      get: still being written (not ready)

Retries start retry_backoff_s after the first try and double, within retry_budget_s; the whole
call, retries included, within call_timeout_s (keys still unanswered then get TIMEOUT).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from workers.pool.client_config import PoolClientConfig
from workers.pool.errors import (
    OBJECT_ALREADY_EXISTS,
    TIMEOUT_CODE,
    BatchResult,
    PoolError,
    PoolTimeoutError,
)


def retry_failed_keys(
    keys: tuple[str, ...],
    first: list[int],
    attempt: Callable[[list[int], float], list[int]],
    op: str,
    retry_codes: frozenset[int],
    start: float,
    c: PoolClientConfig,
) -> BatchResult:
    """The per-key outcome from the first try's codes (first), after retrying the keys
    that failed with retry_codes (attempt(their indices, timeout_s)).

    Retries start retry_backoff_s later and double, within retry_budget_s; the whole call,
    retries included, within call_timeout_s from start (keys still unanswered then get
    TIMEOUT).
    """
    deadline = start + c.call_timeout_s
    retry_deadline = min(deadline, start + c.retry_budget_s)
    backoff_s = c.retry_backoff_s
    codes = [0] * len(keys)
    pending = list(range(len(keys)))
    sub_codes = first
    while True:
        if len(sub_codes) != len(pending):
            raise PoolError(
                f"{op}: Mooncake answered {len(sub_codes)} codes for {len(pending)} keys"
            )
        for i, code in zip(pending, sub_codes, strict=True):
            codes[i] = 0 if (op == "put" and code == OBJECT_ALREADY_EXISTS) else int(code)
        pending = [i for i in pending if codes[i] in retry_codes]
        if not pending or time.monotonic() + backoff_s > retry_deadline:
            break
        time.sleep(backoff_s)
        backoff_s *= 2
        sub_codes = answered(attempt, pending, deadline - time.monotonic())
    return BatchResult.from_codes(keys, codes)


def answered(
    attempt: Callable[[list[int], float], list[int]], idx: list[int], timeout_s: float
) -> list[int]:
    """attempt's codes for the keys at idx; TIMEOUT_CODE for each if it ran out of time."""
    try:
        return attempt(idx, timeout_s)
    except PoolTimeoutError:
        return [TIMEOUT_CODE] * len(idx)
