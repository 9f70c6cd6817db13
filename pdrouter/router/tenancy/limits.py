"""Per-key limits: requests per minute, tokens per minute, concurrent requests.

Each rate is a token bucket holding at most a minute's worth and refilling continuously, so a
key may burst up to its per-minute limit and then runs at the limit's pace. A request's
tokens are charged at admission as its whole bound (prompt estimate + max_tokens, or what the
context leaves, times its sequences) and settled at its end against what it used (prompt +
output tokens as they were relayed, its client gone mid-stream included): the unused part
comes back, and a key whose requests used more than estimated pays the difference from the
next ones. A request whose bound exceeds the bucket's capacity could never pass: 400 naming
both numbers. Past a limit: 429, `Retry-After` (seconds until the bucket holds enough again)
and an OpenAI error naming the limit.

Limits are per router replica: with N replicas behind a load balancer, each enforces the
whole limit on the traffic it sees (set each key's limits to its share, limit / N, when the
balancer spreads keys evenly). No shared counter store is used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pdrouter.router.tenancy.keys_file import ApiKey
from pdrouter.wire.errors import APIError

_MINUTE_S = 60.0


class Bucket:
    """A token bucket of capacity units refilled at capacity per minute."""

    __slots__ = ("capacity", "level", "updated_s")

    def __init__(self, capacity: int, now_s: float) -> None:
        self.capacity = capacity
        self.level = float(capacity)
        self.updated_s = now_s

    def refill(self, now_s: float) -> None:
        rate_per_s = self.capacity / _MINUTE_S
        self.level = min(self.capacity, self.level + (now_s - self.updated_s) * rate_per_s)
        self.updated_s = now_s

    def wait_s(self, amount: float, now_s: float) -> float:
        """Seconds until amount (at most the capacity: the caller refuses more) can be
        taken; 0: now."""
        assert amount <= self.capacity, f"{amount} units never fit a bucket of {self.capacity}"
        self.refill(now_s)
        missing = amount - self.level
        return 0.0 if missing <= 0 else missing * _MINUTE_S / self.capacity


@dataclass
class KeyState:
    """One key's buckets and requests in flight."""

    requests: Bucket | None
    tokens: Bucket | None
    in_flight: int = 0


@dataclass
class Ticket:
    """An admitted request's charge on its key, settled at its end."""

    key: ApiKey
    num_tokens_charged: int
    settled: bool = field(default=False)


class KeyLimits:
    """Every key's usage against its limits (one per router replica)."""

    def __init__(self) -> None:
        self.id_to_state: dict[str, KeyState] = {}

    def _state(self, key: ApiKey, now_s: float) -> KeyState:
        state = self.id_to_state.get(key.key_id)
        rpm, tpm = key.requests_per_minute, key.tokens_per_minute
        if state is None or _capacity(state.requests) != rpm or _capacity(state.tokens) != tpm:
            in_flight = state.in_flight if state is not None else 0  # limits reloaded
            state = KeyState(
                Bucket(rpm, now_s) if rpm else None, Bucket(tpm, now_s) if tpm else None, in_flight
            )
            self.id_to_state[key.key_id] = state
        return state

    def admit(self, key: ApiKey, num_tokens: int, now_s: float) -> Ticket:
        """Charge one request of num_tokens (estimated) to key, or raise the 429 of the first
        limit it is past (concurrency, then requests, then tokens)."""
        state = self._state(key, now_s)
        if key.max_concurrent is not None and state.in_flight >= key.max_concurrent:
            raise _past(key, "max_concurrent", f"{key.max_concurrent} concurrent requests", 1.0)
        if state.requests is not None:
            wait_s = state.requests.wait_s(1, now_s)
            if wait_s > 0:
                raise _past(
                    key,
                    "requests_per_minute",
                    f"{key.requests_per_minute} requests per minute",
                    wait_s,
                )
        if state.tokens is not None:
            if num_tokens > state.tokens.capacity:
                raise _never_fits(key, num_tokens)
            wait_s = state.tokens.wait_s(num_tokens, now_s)
            if wait_s > 0:
                raise _past(
                    key, "tokens_per_minute", f"{key.tokens_per_minute} tokens per minute", wait_s
                )
            state.tokens.level -= num_tokens
        if state.requests is not None:
            state.requests.level -= 1
        state.in_flight += 1
        return Ticket(key, num_tokens)

    def settle(self, ticket: Ticket, num_tokens_used: int, now_s: float) -> None:
        """The request ended having used num_tokens_used: its slot back, its tokens trued up
        (a request that never reached a worker used none)."""
        if ticket.settled:
            return
        ticket.settled = True
        state = self._state(ticket.key, now_s)
        state.in_flight -= 1
        if state.tokens is not None:
            state.tokens.refill(now_s)
            state.tokens.level += ticket.num_tokens_charged - num_tokens_used


def _capacity(bucket: Bucket | None) -> int | None:
    return bucket.capacity if bucket is not None else None


def _never_fits(key: ApiKey, num_tokens: int) -> APIError:
    """The 400 for a request whose whole bound is more than its key's bucket ever holds."""
    return APIError(
        400,
        f"this request may use {num_tokens} tokens (its prompt plus max_tokens, or what the "
        f"context leaves, times its sequences), more than API key {key.key_id!r} may use in "
        f"a minute ({key.tokens_per_minute}, tokens_per_minute); lower max_tokens or n",
        "invalid_request_error",
        param="max_tokens",
        code="request_too_large",
        stage="tokens_per_minute",
    )


def _past(key: ApiKey, limit: str, what: str, wait_s: float) -> APIError:
    return APIError(
        429,
        f"API key {key.key_id!r} is past its limit of {what} ({limit}); retry later",
        "rate_limit_error",
        param=limit,
        code="rate_limit_exceeded",
        stage=limit,
        retry_after_s=max(1, math.ceil(wait_s)),
    )
