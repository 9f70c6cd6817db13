"""A worker's tokenizer routes (pdrouter.wire.tokenize, vLLM's shapes): its own tokenizer, on
the CPU threads (a long prompt never holds the event loop). P's answer is the router's."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from pdrouter.wire.errors import bad_request
from pdrouter.wire.tokenize import (
    DETOKENIZE_PATH,
    TOKENIZE_PATH,
    TOKENIZER_INFO_PATH,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    TokenizerInfo,
)
from workers.server.prepare import check_model_name


def _tokenize(
    tokenizer: Any, body: TokenizeCompletionRequest | TokenizeChatRequest, max_model_len: int
) -> TokenizeResponse:
    if isinstance(body, TokenizeChatRequest):
        messages = [
            {"role": "system" if m.role == "developer" else m.role, "content": m.content or ""}
            for m in body.messages
        ]
        text = tokenizer.apply_chat_template(messages, body.add_generation_prompt)
    else:
        text = body.prompt
    tokens = tokenizer.encode(text, add_special_tokens=body.add_special_tokens)
    strs = None
    if body.return_token_strs:
        strs = [tokenizer.decode([t], skip_special_tokens=False) for t in tokens]
    return TokenizeResponse(
        count=len(tokens), max_model_len=max_model_len, tokens=tokens, token_strs=strs
    )


def _detokenize(tokenizer: Any, tokens: list[int]) -> str:
    bad = [t for t in tokens if not 0 <= t < tokenizer.vocab_size]
    if bad:
        raise bad_request(
            f"token ids must be in [0, {tokenizer.vocab_size}); got {bad[:5]}", "tokens"
        )
    return str(tokenizer.decode(tokens, skip_special_tokens=False))


def install_tokenize_routes(app: FastAPI, state: Any) -> None:
    """/tokenize, /detokenize and /tokenizer_info over the worker's engine tokenizer (state:
    the app's WorkerState)."""

    def tokenizer_of(model: str | None) -> Any:
        """The engine's tokenizer once loaded (503 before); 400 for a model not served."""
        state.require_service()
        if model is not None:
            check_model_name(model, state.config.served_model_names)
        return state.engine.tokenizer

    @app.post(TOKENIZE_PATH)
    async def tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        tokenizer = tokenizer_of(body.model)
        max_len = state.identity.max_model_len
        return await state.cpu.run(_tokenize, tokenizer, body, max_len)  # type: ignore[no-any-return]

    @app.post(DETOKENIZE_PATH)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        tokenizer = tokenizer_of(body.model)
        return DetokenizeResponse(prompt=await state.cpu.run(_detokenize, tokenizer, body.tokens))

    @app.get(TOKENIZER_INFO_PATH)
    async def tokenizer_info() -> TokenizerInfo:
        tokenizer = tokenizer_of(None)
        return TokenizerInfo(
            eos_token=tokenizer.eos_token or None,
            bos_token=tokenizer.bos_token or None,
            chat_template=tokenizer.chat_template,
            model_max_length=state.identity.max_model_len,
        )
