"""Overload control: bounded in-flight work, refused at once instead of queued.

    client request ──► global limit (max_in_flight)       full ─► 429 Retry-After
                  ──► per-instance bound when an instance is picked
                      every usable instance full      ─► 429 Retry-After
                      nothing healthy                 ─► 503 Retry-After (the orchestrator)

By default the router keeps no queue (--max-queued-requests adds one in front of
max_in_flight, served by priority: pdrouter/router/tenancy/queue.py): a request beyond a limit
is answered 429 immediately, so the
number of requests the router holds is bounded by max_in_flight and no client waits on a
queue whose length nobody bounds. An instance's bound is the smallest of
--max-in-flight-per-instance, the capacity it registered (its --max-pending-requests: more
calls than that would only be refused by the worker, after the router spent the other side's
work on them) and what its engine holds (engine_bound): --batches-in-flight-per-instance
batches of its --max-num-seqs (from /health or registration). Its tokens in flight are bound
the same way by its KV cache (token_bound: that many times num_kv_blocks x block_size), so
that long requests are refused sooner than short ones. Beyond these, calls would only queue in
the engine for longer than a client waits: refused up front, a request costs nobody anything,
while a stream that started and then starved is lost. An instance that reports none of these
has no bound. Per-instance load (requests and tokens) is
held with `Hold` for exactly as long as the call to the instance lasts (the whole decode
stream).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdrouter.common.flags import flag
from pdrouter.router.instances.instance import Instance
from pdrouter.wire.choices import DEFAULT_COMPLETION_MAX_TOKENS
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
    batches_in_flight_per_instance: float = field(
        default=2.0,
        metadata=flag(
            "--batches-in-flight-per-instance",
            "the default in-flight bound of an instance, in engine batches: this many times "
            "its --max-num-seqs calls, and this many times its KV cache in tokens; 2 is one "
            "batch running and one queued behind it",
        ),
    )
    max_request_tokens: int | None = field(
        default=None,
        metadata=flag(
            "--max-request-tokens",
            "the most tokens one request may hold on the decode side: its prompt plus its "
            "max_tokens (else what the context leaves) times its sequences (n, best_of, "
            "prompts); beyond it 400 (none: the decode instances' whole token bound)",
        ),
    )
    retry_after_s: int = 1  # what a 429 tells the client to wait

    def __post_init__(self) -> None:
        for name in ("max_in_flight", "max_in_flight_per_instance", "max_request_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 (or unset), got {value}")
        if self.batches_in_flight_per_instance <= 0:
            raise ValueError(
                "batches_in_flight_per_instance must be > 0, got "
                f"{self.batches_in_flight_per_instance}"
            )
        if self.retry_after_s < 0:
            raise ValueError(f"retry_after_s must be >= 0, got {self.retry_after_s}")


class Admission:
    """Counts the router's client requests in flight and decides instance room."""

    def __init__(self, cfg: AdmissionConfig) -> None:
        self.cfg = cfg
        self.num_in_flight = 0
        self.num_rejected = 0

    def enter(self, extra_slots: int = 0) -> None:
        """Admit one client request or raise 429; pair with leave() once it is answered.
        extra_slots: how far beyond max_in_flight this request may go (an urgent one's
        reserve, pdrouter/router/tenancy/queue.py)."""
        limit = self.cfg.max_in_flight
        if limit is not None and self.num_in_flight >= limit + extra_slots:
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

    def bound_of(self, inst: Instance, extra_calls: int = 0) -> int | None:
        """Calls inst may get at once: the smallest of --max-in-flight-per-instance, its
        registered capacity and what its engine holds (engine_bound); None: no bound.
        extra_calls (an urgent request's reserve) raise the first and the last, never the
        capacity: the worker itself refuses calls beyond it."""
        soft = (self.cfg.max_in_flight_per_instance, self.engine_bound(inst))
        soft_bound = min((b for b in soft if b is not None), default=None)
        if soft_bound is not None:
            soft_bound += extra_calls
        bounds = (soft_bound, inst.capacity)
        return min((b for b in bounds if b is not None), default=None)

    def engine_bound(self, inst: Instance) -> int | None:
        """--batches-in-flight-per-instance batches of inst's --max-num-seqs (None until it
        reports it)."""
        if inst.max_num_seqs is None:
            return None
        return max(1, int(inst.max_num_seqs * self.cfg.batches_in_flight_per_instance))

    def token_bound(self, inst: Instance) -> int | None:
        """Tokens inst may hold in flight: --batches-in-flight-per-instance times its KV
        cache (None until it reports num_kv_blocks and block_size)."""
        if not inst.num_kv_blocks or not inst.block_size:
            return None
        kv_tokens = inst.num_kv_blocks * inst.block_size
        return max(1, int(kv_tokens * self.cfg.batches_in_flight_per_instance))

    def has_room(self, inst: Instance, extra_calls: int = 0) -> bool:
        """Whether inst is below both its bounds (bound_of, token_bound). extra_calls (an
        urgent request's reserve) raise the call bound and lift the token bound, as at the
        decode door: the engine preempts less urgent work for the urgent request."""
        bound = self.bound_of(inst, extra_calls)
        token_bound = None if extra_calls else self.token_bound(inst)
        return (bound is None or inst.in_flight < bound) and (
            token_bound is None or inst.in_flight_tokens < token_bound
        )

    def with_room(self, insts: list[Instance], extra_calls: int = 0) -> list[Instance]:
        """The instances below their bounds (has_room), in order."""
        return [inst for inst in insts if self.has_room(inst, extra_calls)]

    def instances_full(self, role: str, full: list[Instance]) -> APIError:
        """The 429 for a request whose every usable instance of role is at its bound."""
        self.num_rejected += 1
        bounds = ", ".join(self._load_of(inst) for inst in full)
        return APIError(
            429,
            f"every {role} instance is at its in-flight limit ({bounds}; the call limit is "
            "the smallest of its registered capacity, its engine's batches "
            "(--batches-in-flight-per-instance) and --max-in-flight-per-instance, the token "
            "limit as many batches of its KV cache); retry later",
            "rate_limit_error",
            code="overloaded",
            stage=role,
            retry_after_s=self.cfg.retry_after_s,
        )

    def check_request_tokens(self, num_tokens: int) -> None:
        """400 when a request's bound (num_tokens) exceeds --max-request-tokens."""
        limit = self.cfg.max_request_tokens
        if limit is not None and num_tokens > limit:
            raise APIError(
                400,
                f"this request may hold {num_tokens} tokens (its prompt plus max_tokens, or "
                f"what the context leaves, times its sequences), more than the "
                f"{limit} one request may hold (--max-request-tokens); lower max_tokens or n",
                "invalid_request_error",
                param="max_tokens",
                code="request_too_large",
            )

    def never_fits(self, role: str, num_tokens: int, total: int, num_instances: int) -> APIError:
        """The 400 for a request larger than every healthy instance of role holds at once."""
        return APIError(
            400,
            f"this request may hold {num_tokens} tokens (its prompt plus max_tokens, or what "
            f"the context leaves, times its sequences), more than the {role} side can ever "
            f"hold: {total} tokens ({num_instances} instances, each "
            f"--batches-in-flight-per-instance {self.cfg.batches_in_flight_per_instance:g} "
            "times its KV cache); lower max_tokens or n",
            "invalid_request_error",
            param="max_tokens",
            code="request_too_large",
        )

    def prompts_never_fit(
        self, role: str, num_tokens: int, total: int, num_instances: int
    ) -> APIError:
        """The 400 for a batch whose prompts at once exceed what role's instances hold."""
        return APIError(
            400,
            f"this request's prompts hold about {num_tokens} tokens at once (estimated), more "
            f"than its {num_instances} {role} instances can ever hold: {total} tokens (each "
            f"--batches-in-flight-per-instance {self.cfg.batches_in_flight_per_instance:g} "
            "times its KV cache); send fewer prompts per request",
            "invalid_request_error",
            param="prompt",
            code="request_too_large",
        )

    def calls_never_fit(
        self, role: str, num_calls: int, total: int, num_instances: int
    ) -> APIError:
        """The 400 for a batch whose calls at once exceed what role's instances take."""
        return APIError(
            400,
            f"this request makes {num_calls} {role} calls at once (one per prompt and "
            f"sequence), more than its {num_instances} {role} instances ever take at once "
            f"({total} calls); send fewer prompts per request",
            "invalid_request_error",
            param="prompt",
            code="request_too_large",
        )

    def side_full(
        self, role: str, insts: list[Instance], held: int, coming: int, total: int
    ) -> APIError:
        """The 429 when role's calls held (and coming: requests in prefill, for decode) leave
        no call for one more request."""
        self.num_rejected += 1
        loads = ", ".join(self._load_of(inst) for inst in insts)
        return APIError(
            429,
            f"every {role} instance is at its in-flight limit: {held + coming} of {total} "
            f"calls held ({held} on {role} instances, {coming} in prefill to come; {loads}; "
            "the call limit is the smallest of its registered capacity, its engine's "
            "batches (--batches-in-flight-per-instance) and --max-in-flight-per-instance); "
            "retry later",
            "rate_limit_error",
            code="overloaded",
            stage=role,
            retry_after_s=self.cfg.retry_after_s,
        )

    def tokens_full(self, role: str, reserved: int, num_tokens: int, total: int) -> APIError:
        """The 429 when the tokens reserved by requests in flight leave too few for this one."""
        self.num_rejected += 1
        return APIError(
            429,
            f"the {role} side is full: requests in flight hold {reserved} of its {total} "
            f"tokens and this request may hold {num_tokens} (its prompt plus max_tokens, or "
            "what the context leaves, times its sequences); retry later",
            "rate_limit_error",
            code="overloaded",
            stage=role,
            retry_after_s=self.cfg.retry_after_s,
        )

    def _load_of(self, inst: Instance) -> str:
        """inst's calls (and tokens, when bounded) against its bounds, for a 429's message."""
        load = f"{inst.url} {inst.in_flight}/{self.bound_of(inst)} calls"
        token_bound = self.token_bound(inst)
        if token_bound is not None:
            load += f" {inst.in_flight_tokens}/{token_bound} tokens"
        return load


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


def max_output_tokens(
    request: CompletionRequest | ChatCompletionRequest,
    max_model_len: int | None,
    prompt_tokens_estimate: int,
) -> int:
    """The most tokens one sequence of request may generate, as the worker will run it
    (workers.server.prepare): max_tokens as set; unset, completions' 16 and chat's whatever
    the context leaves (max_model_len less the prompt's estimate; 0 while no instance has
    told its context); completions' 0 (scoring): the one token the engine samples."""
    if isinstance(request, ChatCompletionRequest):
        requested = request.requested_max_tokens()
        if requested is None:
            return max(1, max_model_len - prompt_tokens_estimate) if max_model_len else 0
        return requested
    if request.max_tokens is None:
        return DEFAULT_COMPLETION_MAX_TOKENS
    return max(1, request.max_tokens)
