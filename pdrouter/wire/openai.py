"""The OpenAI wire shapes (pydantic v2), shared by the router and the workers.

No Paddle, no engine: the router imports this module. Requests are parsed from raw bytes with
`parse_request`, which turns every way a body can be wrong (malformed JSON, wrong types,
out-of-range values, unsupported options) into one `ProtocolError` naming the field, so that
both sides answer it with the same 400 body:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens",
               "code": null}}

Types are strict (a JSON string "5" is not an integer), unknown fields are ignored as
OpenAI-compatible servers do, and JSON null means "omitted" for every optional field (OpenAI
and vLLM accept `"n": null`). Parameters this server does not implement are refused with a 400
naming them unless their value changes nothing (`pdrouter.wire.unsupported`). Extensions beyond
OpenAI: top_k, stop_token_ids, ignore_eos, and those of pdrouter.wire.sampling_controls.
JSON numbers must be finite and stop strings are bounded (pdrouter.wire.request_bounds).
"""

from __future__ import annotations

import time
from typing import Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, Field, ValidationError, field_validator, model_serializer

from pdrouter.wire.logprobs import MAX_TOP_LOGPROBS, ChatLogprobs, CompletionLogprobs
from pdrouter.wire.protocol_error import ProtocolError
from pdrouter.wire.request_bounds import (
    check_stop_strings,
    check_stop_token_ids,
    refuse_non_finite,
)
from pdrouter.wire.sampling_controls import SamplingControls
from pdrouter.wire.strict import Strict
from pdrouter.wire.structured import ResponseFormat, ToolCall, ToolFields
from pdrouter.wire.tool_calls import template_message
from pdrouter.wire.unsupported import check_unsupported

# Choices one request may ask for (n, best_of), and prompts (and sequences: prompts x n or
# best_of) one request may carry.
MAX_CHOICES = 16
MAX_BATCH_PROMPTS = 64

ChatRole = Literal["system", "developer", "user", "assistant", "tool"]
# grammar_error: a constrained answer reached a dead end of its schema; it is not valid JSON
# for it (docs/design/structured_output.md).
FinishReason = Literal["stop", "length", "abort", "tool_calls", "grammar_error"]


# ---------------------------------------------------------------------------- requests


_Strict = Strict  # the base of every request model here (pdrouter.wire.strict)


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingRequest(_Strict, SamplingControls):
    """Fields shared by completions and chat completions (the penalties, logit_bias, min_p
    and min_tokens in pdrouter.wire.sampling_controls)."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    # Extension: 0 (or -1, vLLM's spelling) means no top-k cut.
    top_k: int | None = Field(None, ge=-1)
    # Sampling keys a 64-bit counter-based generator with it: any signed or unsigned 64-bit
    # value, as OpenAI and vLLM take; -1 is vLLM's "no seed" (a random one).
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension
    ignore_eos: bool = False  # extension
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(
        1, ge=1, le=MAX_CHOICES, description="Choices per prompt (pdrouter.wire.choices)"
    )
    user: str | None = None
    cache_salt: str | None = Field(None, min_length=1)  # vLLM's: a prefix cache scope of its own
    # vLLM's: lower is served first (the router's queue, the engines' schedulers); 32 bits.
    priority: int | None = Field(None, ge=-(2**31), lt=2**31)
    response_format: ResponseFormat | None = None  # pdrouter.wire.structured
    # Not implemented: refused unless their value changes nothing (pdrouter.wire.unsupported).
    UNSUPPORTED: ClassVar[tuple[str, ...]] = ()

    @field_validator("seed")
    @classmethod
    def _minus_one_is_unseeded(cls, seed: int | None) -> int | None:
        return None if seed == -1 else seed

    @field_validator("stop")
    @classmethod
    def _stop_strings_bounded(cls, stop: str | list[str] | None) -> str | list[str] | None:
        check_stop_strings([stop] if isinstance(stop, str) else (stop or []))
        return stop

    @field_validator("stop_token_ids")
    @classmethod
    def _token_ids_bounded(cls, ids: list[int] | None) -> list[int] | None:
        check_stop_token_ids(ids or [])
        return ids

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise ProtocolError(
                "stream_options is only allowed when stream is true", "stream_options"
            )

    def _check_unsupported(self, max_tokens: int | None) -> None:
        check_unsupported({name: getattr(self, name) for name in self.UNSUPPORTED})
        if (problem := self.check_min_tokens(max_tokens)) is not None:
            raise ProtocolError(problem, "min_tokens")


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions. A prompt (a string or token ids) or a batch (a list of either):
    one choice per prompt and n; echo, best_of and max_tokens 0 (scoring) are served by
    pdrouter.wire.choices."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0, description="Default 16; 0 scores the prompt alone")
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # top-k per token
    best_of: int | None = Field(
        None, ge=1, le=MAX_CHOICES, description="At least n; more than n is not streamed."
    )
    suffix: Any = None

    UNSUPPORTED: ClassVar[tuple[str, ...]] = (*_SamplingRequest.UNSUPPORTED, "suffix")

    def prompts(self) -> list[str | list[int]]:
        """The prompts this request carries, one or a batch (each a string or token ids)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            return list(prompt)  # type: ignore[arg-type]
        return [prompt]  # type: ignore[list-item]

    def single_prompt(self) -> str | list[int]:
        """The prompt of a request of one prompt (the workers get one per sub-request)."""
        prompts = self.prompts()
        if len(prompts) != 1:
            raise ProtocolError(f"expected one prompt, got {len(prompts)}", "prompt")
        return prompts[0]

    def check_supported(self) -> None:
        """Raise ProtocolError for options this server does not implement."""
        self._check_stream_options()
        self._check_unsupported(self.max_tokens)
        num_prompts = len(self.prompts())
        if num_prompts * max(self.best_of or 1, self.n) > MAX_BATCH_PROMPTS:
            raise ProtocolError(
                f"at most {MAX_BATCH_PROMPTS} sequences per request (prompts x n or best_of)",
                "prompt" if num_prompts > 1 else "n",
            )
        if self.best_of is not None and self.best_of < self.n:
            raise ProtocolError(
                f"best_of ({self.best_of}) must be at least n ({self.n})", "best_of"
            )
        if self.stream and (self.best_of or self.n) > self.n:
            raise ProtocolError("best_of larger than n cannot be streamed", "best_of")

    def num_logprobs(self) -> int | None:
        """How many most likely tokens to report per generated token; None: no logprobs."""
        return self.logprobs


class ChatMessage(_Strict):
    """One chat message; text-part lists are joined into one string at parse time."""

    role: ChatRole
    content: str | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    @field_validator("content", mode="before")
    @classmethod
    def _join_text_parts(cls, content: Any) -> Any:
        if not isinstance(content, list):
            return content
        texts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"content part {i} has type {kind!r}; only 'text' is supported")
            text = part.get("text")
            if not isinstance(text, str):
                raise ValueError(f"content part {i} needs a string 'text'")
            texts.append(text)
        return "\n".join(texts)


class ChatCompletionRequest(ToolFields, _SamplingRequest):
    """POST /v1/chat/completions; tools, tool_choice, parallel_tool_calls: ToolFields."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    add_generation_prompt: bool = True  # extension
    functions: Any = None
    function_call: Any = None

    UNSUPPORTED: ClassVar[tuple[str, ...]] = (
        *_SamplingRequest.UNSUPPORTED,
        "functions",
        "function_call",
    )

    def check_supported(self) -> None:
        """Raise ProtocolError for options this server does not implement."""
        self._check_stream_options()
        self._check_unsupported(self.requested_max_tokens())
        self.check_tools()
        if self.top_logprobs is not None and not self.logprobs:
            raise ProtocolError("top_logprobs needs logprobs set to true", "top_logprobs")

    def num_logprobs(self) -> int | None:
        """How many most likely tokens to report per generated token; None: no logprobs."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens (the newer name) wins over max_tokens."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def message_dicts(self) -> list[dict[str, Any]]:
        """Messages as chat templates expect them; 'developer' is the new name of 'system'."""
        return [template_message(m.model_dump(exclude_none=True)) for m in self.messages]


RequestT = TypeVar("RequestT", CompletionRequest, ChatCompletionRequest)


def _param_of(loc: tuple[Any, ...]) -> str | None:
    """messages.0.content -> 'messages[0].content', dropping pydantic's union-member tags."""
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif item.isidentifier() and item not in ("str", "int", "float", "bool", "list", "dict"):
            parts.append(("." if parts else "") + item)
    return "".join(parts) or None


def parse_request(request_cls: type[RequestT], body: bytes) -> RequestT:
    """Parse and check a request body; every problem becomes a ProtocolError naming the field."""
    refuse_non_finite(body)
    try:
        request = request_cls.model_validate_json(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = _param_of(tuple(first["loc"]))
        msg = first["msg"].removeprefix("Value error, ")
        if first["type"] == "json_invalid":
            raise ProtocolError(f"request body is not valid JSON: {msg}") from None
        if first["type"] == "model_type":
            raise ProtocolError("request body must be a JSON object") from None
        where = f"{param}: " if param else ""
        raise ProtocolError(f"{where}{msg}", param) from None
    request.check_supported()
    return request


# ---------------------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    # Prompt tokens whose KV came from a cache (device or pool) on the worker that computed
    # the prompt; a decode worker's load of the prefill worker's handoff is not counted.
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> UsageInfo:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


class _Response(BaseModel):
    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None


class CompletionResponse(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _calls_only_when_made(self, handler: Any) -> dict[str, Any]:
        out = handler(self)
        if out.get("tool_calls") is None:
            out.pop("tool_calls", None)
        return out


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: UsageInfo


class ChatDelta(BaseModel):
    """A stream delta; unset keys are left out, as OpenAI does ({} on the final chunk)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # pdrouter.wire.tool_stream.call_deltas

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pdrouter"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
