"""Overload control: bounded in-flight work, refused at once instead of queued.

    client request ──► global limit (max_in_flight)       full ─► 429 Retry-After
                  ──► per-instance bound when an instance is picked
                      every usable instance full      ─► 429 Retry-After
                      nothing healthy                 ─► 503 Retry-After (the orchestrator)

The router keeps no queue: a request beyond a limit is answered 429 immediately, so the
number of requests the router holds is bounded by max_in_flight and no client waits on a
queue whose length nobody bounds. An instance's bound is the smaller of
--max-in-flight-per-instance and the capacity it registered (its --max-pending-requests: more
calls than that would only be refused by the worker, after the router spent the other side's
work on them); an instance with neither has none. Per-instance load (requests and tokens) is
held with `Hold` for exactly as long as the call to the instance lasts (the whole decode
stream).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdrouter.common.flags import flag
from pdrouter.router.instances.instance import Instance
from pdrouter.wire.errors import APIError
from pdrouter.wire.openai import ChatCompletionRequest, CompletionRequest

# Rough characters per token of English text; only used to rank P instances by pending
# prompt work before P has tokenized the prompt (P is the tokenizer of record).
_CHARS_PER_TOKEN = 4


@dataclass(frozen=True)
class AdmissionConfig:
    max_in_flight: int | None = field(
        default=None,
        metadata=flag(
            "--max-in-flight",
            "client requests served at once; beyond it 429 with Retry-After (none: no cap)",
        ),
    )
    max_in_flight_per_instance: int | None = field(
        default=None,
        metadata=flag(
            "--max-in-flight-per-instance",
            "calls one prefill or decode instance gets at once, "
            "at most its registered capacity (its --max-pending-requests); when every instance "
            "is at its bound, 429 with Retry-After (none: the registered capacity alone)",
        ),
    )
    retry_after_s: int = 1  # what a 429 tells the client to wait

    def __post_init__(self) -> None:
        for name in ("max_in_flight", "max_in_flight_per_instance"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 (or unset), got {value}")
        if self.retry_after_s < 0:
            raise ValueError(f"retry_after_s must be >= 0, got {self.retry_after_s}")


class Admission:
    """Counts the router's client requests in flight and decides instance room."""

    def __init__(self, cfg: AdmissionConfig) -> None:
        self.cfg = cfg
        self.num_in_flight = 0
        self.num_rejected = 0

    def enter(self) -> None:
        """Admit one client request or raise 429; pair with leave() once it is answered."""
        limit = self.cfg.max_in_flight
        if limit is not None and self.num_in_flight >= limit:
            self.num_rejected += 1
            raise APIError(
                429,
                f"router overloaded: {self.num_in_flight} requests in flight "
                f"(--max-in-flight {limit}); retry later",
                "rate_limit_error",
                code="overloaded",
                retry_after_s=self.cfg.retry_after_s,
            )
        self.num_in_flight += 1

    def leave(self) -> None:
        assert self.num_in_flight > 0, "Admission.leave without a matching enter"
        self.num_in_flight -= 1

    def bound_of(self, inst: Instance) -> int | None:
        """Calls inst may get at once: the smaller of --max-in-flight-per-instance and its
        registered capacity (None: no bound)."""
        limit = self.cfg.max_in_flight_per_instance
        if inst.capacity is None:
            return limit
        return inst.capacity if limit is None else min(limit, inst.capacity)

    def with_room(self, insts: list[Instance]) -> list[Instance]:
        """The instances below their bound (bound_of), in order."""
        room: list[Instance] = []
        for inst in insts:
            bound = self.bound_of(inst)
            if bound is None or inst.in_flight < bound:
                room.append(inst)
        return room

    def instances_full(self, role: str, full: list[Instance]) -> APIError:
        """The 429 for a request whose every usable instance of role is at its bound."""
        self.num_rejected += 1
        bounds = ", ".join(f"{inst.url} {inst.in_flight}/{self.bound_of(inst)}" for inst in full)
        return APIError(
            429,
            f"every {role} instance is at its in-flight limit (calls/limit: {bounds}; the "
            "limit is its registered capacity or --max-in-flight-per-instance, the smaller); "
            "retry later",
            "rate_limit_error",
            code="overloaded",
            stage=role,
            retry_after_s=self.cfg.retry_after_s,
        )


class Hold:
    """Counts one call and its tokens on inst for the duration of the with-block (a class
    rather than a generator-based context manager: every call to a worker enters one)."""

    __slots__ = ("inst", "num_tokens")

    def __init__(self, inst: Instance, num_tokens: int) -> None:
        self.inst = inst
        self.num_tokens = num_tokens

    def __enter__(self) -> Hold:
        self.inst.in_flight += 1
        self.inst.in_flight_tokens += self.num_tokens
        return self

    def __exit__(self, *exc: object) -> None:
        self.inst.in_flight -= 1
        self.inst.in_flight_tokens -= self.num_tokens


def _text_chars(value: Any) -> int:
    """Characters of text in a prompt (a string, token ids, or a list of either)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        # A list of token ids counts as that many tokens' worth of characters.
        return sum(_CHARS_PER_TOKEN if isinstance(v, int) else _text_chars(v) for v in value)
    return 0


def estimate_prompt_tokens(request: CompletionRequest | ChatCompletionRequest) -> int:
    """A cheap estimate of a request's prompt tokens (P's load before it has tokenized)."""
    if isinstance(request, ChatCompletionRequest):
        chars = sum(len(message.content or "") for message in request.messages)
    else:
        chars = _text_chars(request.prompt)
    return chars // _CHARS_PER_TOKEN + 1


def max_output_tokens(request: CompletionRequest | ChatCompletionRequest) -> int:
    """The request's output budget as the client set it (0 when unset)."""
    if isinstance(request, ChatCompletionRequest):
        return request.requested_max_tokens() or 0
    return request.max_tokens or 0
