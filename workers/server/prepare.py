"""From a parsed OpenAI request to what the engine runs: prompt token ids and SamplingParams.

Shared by every role: the mixed server runs the result itself, the prefill role (PD) runs it
with prefill_only, and the usage it reports counts exactly these prompt token ids.

Context checks, in the order a user would want to hear about them:

    prompt empty                               -> 400 param prompt | messages
    prompt_tokens >= max_model_len             -> 400 param prompt | messages (no room to answer)
    prompt_tokens + max_tokens > max_model_len -> 400 param max_tokens
    max_tokens not given                       -> chat: whatever room the context leaves;
                                                  completions: 16 within that room
    max_tokens 0 (completions)                 -> the prompt scored: the engine samples one
                                                  token the answer drops (wire.scoring)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol

from pdrouter.wire.choices import DEFAULT_COMPLETION_MAX_TOKENS
from pdrouter.wire.errors import bad_request, clip
from pdrouter.wire.openai import ChatCompletionRequest, CompletionRequest
from pdrouter.wire.structured import OutputConstraint
from pdrouter.wire.tool_calls import with_tools_in_text
from pdrouter.wire.tool_stream import tool_answer
from workers.engine.api import EngineRequest, SamplingParams
from workers.server.structured import request_constraint

RequestKind = Literal["completion", "chat"]


class PromptTokenizer(Protocol):
    """The part of workers.engine.tokenizer.Tokenizer that prompt preparation uses."""

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    @property
    def renders_tools(self) -> bool: ...
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str: ...


@dataclass(frozen=True)
class PreparedRequest:
    """A validated request, ready for the engine; `model` is the name echoed in responses."""

    request_id: str
    kind: RequestKind
    model: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    stream: bool
    include_usage: bool
    # The prefix cache scope the engine hashes its blocks under (pdrouter.wire.pd.cache_scope).
    cache_scope: str | None = None
    # (tool mode, forced function): how the answer becomes tool calls (tool_stream.tool_answer).
    tools: tuple[str, str | None] = ("none", None)
    # Completions' echo: the prompt as text (a token prompt decoded); None without echo.
    echo_text: str | None = None
    score_only: bool = False  # completions' max_tokens 0
    # The schema the answer must match (None: free text). params.grammar stays None until
    # structured.with_grammar compiles it (awaited: the compile is budgeted, off every loop).
    constraint: OutputConstraint | None = None

    @property
    def scoring(self) -> bool:
        return self.echo_text is not None or self.score_only

    def engine_request(self) -> EngineRequest:
        """The engine request that runs it (one sequence; no grammar state yet)."""
        return EngineRequest(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            params=self.params,
            cache_scope=self.cache_scope,
        )


def check_model_name(requested: str, served_names: tuple[str, ...]) -> None:
    """400 model_not_found unless one of ours (the issue asks 400 where OpenAI answers 404)."""
    if requested not in served_names:
        raise bad_request(
            f"The model {clip(requested)!r} does not exist; "
            f"this server serves {list(served_names)}",
            "model",
            "model_not_found",
        )


def completion_prompt_ids(request: CompletionRequest, tokenizer: PromptTokenizer) -> list[int]:
    """Token ids of a completion prompt (text is encoded with the tokenizer's special tokens)."""
    prompt = request.single_prompt()
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_special_tokens=True) if prompt else []
    bad = [t for t in prompt if not 0 <= t < tokenizer.vocab_size]
    if bad:
        raise bad_request(
            f"prompt token ids must be in [0, {tokenizer.vocab_size}); got {bad[:5]}", "prompt"
        )
    return list(prompt)


def chat_prompt_ids(request: ChatCompletionRequest, tokenizer: PromptTokenizer) -> list[int]:
    """Token ids of the chat template rendered over the messages."""
    from jinja2.exceptions import TemplateError

    messages, tools = request.message_dicts(), request.rendered_tools()
    if not tokenizer.renders_tools:
        messages, tools = with_tools_in_text(messages, tools), None
    try:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=request.add_generation_prompt, tools=tools
        )
    except (TemplateError, ValueError) as exc:
        raise bad_request(f"the chat template rejected the messages: {exc}", "messages") from None
    # The template spells out bos and the role markers itself.
    return tokenizer.encode(text, add_special_tokens=False)


def sampling_params(
    request: CompletionRequest | ChatCompletionRequest, max_tokens: int
) -> SamplingParams:
    """OpenAI defaults: temperature 1, top_p 1; top_k 0 or -1 means off; no penalty, bias,
    min_p or min_tokens (pdrouter.wire.sampling_controls). No grammar yet: a response format
    or a forced tool call is compiled by structured.with_grammar (awaited, budgeted)."""
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        top_k=max(request.top_k or 0, 0),
        seed=None if request.seed is None else request.seed % 2**64,  # signed: two's complement
        stop=request.stop_strings(),
        stop_token_ids=tuple(request.stop_token_ids or ()),
        ignore_eos=request.ignore_eos,
        num_logprobs=request.num_logprobs(),
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        repetition_penalty=1.0
        if request.repetition_penalty is None
        else request.repetition_penalty,
        logit_bias=request.logit_bias_pairs(),
        min_tokens=request.min_tokens or 0,
        min_p=request.min_p or 0.0,
        priority=request.priority or 0,
        prompt_logprobs=request.logprobs if getattr(request, "echo", False) else None,
    )


def completion_max_tokens(
    request: CompletionRequest, num_prompt_tokens: int, max_model_len: int
) -> int:
    """The max_tokens a completion asks of the engine: 16 (OpenAI's and vLLM's default)
    within the room left when not given; 0 (the prompt scored) runs as 1, the token dropped."""
    if request.max_tokens is None:
        return max(min(DEFAULT_COMPLETION_MAX_TOKENS, max_model_len - num_prompt_tokens), 1)
    return max(request.max_tokens, 1)


def fit_max_tokens(
    num_prompt_tokens: int,
    requested_max_tokens: int | None,
    max_model_len: int,
    prompt_param: str,
    max_tokens_param: str = "max_tokens",
) -> int:
    """The max_tokens to run with, or a 400 when the prompt and the answer cannot fit."""
    if num_prompt_tokens == 0:
        raise bad_request("the prompt is empty (it encodes to zero tokens)", prompt_param)
    if num_prompt_tokens >= max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens, but the prompt "
            f"has {num_prompt_tokens} tokens (no room left for an answer)",
            prompt_param,
            "context_length_exceeded",
        )
    room = max_model_len - num_prompt_tokens
    if requested_max_tokens is None:
        return room
    if requested_max_tokens > room:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens; you requested "
            f"{num_prompt_tokens + requested_max_tokens} tokens ({num_prompt_tokens} in the "
            f"prompt, {requested_max_tokens} for the completion)",
            max_tokens_param,
            "context_length_exceeded",
        )
    return requested_max_tokens


def prepare_request(
    request: CompletionRequest | ChatCompletionRequest,
    request_id: str,
    tokenizer: PromptTokenizer,
    max_model_len: int,
) -> PreparedRequest:
    """Template, tokenize and size one request; raises APIError (400) for what cannot run."""
    if isinstance(request, ChatCompletionRequest):
        kind: RequestKind = "chat"
        prompt_ids = chat_prompt_ids(request, tokenizer)
        prompt_param = "messages"
        requested = request.requested_max_tokens()
        max_tokens_param = (
            "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        )
    else:
        kind = "completion"
        prompt_ids = completion_prompt_ids(request, tokenizer)
        prompt_param = "prompt"
        requested = completion_max_tokens(request, len(prompt_ids), max_model_len)
        max_tokens_param = "max_tokens"
    max_tokens = fit_max_tokens(
        len(prompt_ids), requested, max_model_len, prompt_param, max_tokens_param
    )
    echo_text = None
    if isinstance(request, CompletionRequest) and request.echo:
        prompt = request.single_prompt()
        echo_text = prompt if isinstance(prompt, str) else tokenizer.decode(prompt, False)
    return PreparedRequest(
        request_id=request_id,
        kind=kind,
        model=request.model,
        prompt_token_ids=tuple(prompt_ids),
        params=sampling_params(request, max_tokens),
        stream=request.stream,
        include_usage=request.include_usage_in_stream(),
        tools=tool_answer(request),
        echo_text=echo_text,
        score_only=isinstance(request, CompletionRequest) and request.max_tokens == 0,
        constraint=request_constraint(request),
    )
