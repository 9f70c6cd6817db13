"""The tokenizer routes, in vLLM's shapes (the router relays them to a prefill worker, the
tokenizer of record; every worker serves them):

    POST /tokenize        {model?, prompt, add_special_tokens: true}
                          | {model?, messages, add_generation_prompt: true,
                             add_special_tokens: false}
                          -> {count, max_model_len, tokens, token_strs}
    POST /detokenize      {model?, tokens} -> {prompt}
    GET  /tokenizer_info  -> {eos_token, bos_token, pad_token, chat_template, model_max_length}

lm-eval's `tokenizer_backend=remote` (and its default backend's probe) reads these, so an
evaluation needs no tokenizer download. A model named must be one served (400 otherwise, as
on the OpenAI routes).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from pdrouter.wire.openai import ChatMessage

TOKENIZE_PATH = "/tokenize"
DETOKENIZE_PATH = "/detokenize"
TOKENIZER_INFO_PATH = "/tokenizer_info"


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None


class TokenizeCompletionRequest(_Request):
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # the chat template spells out its special tokens
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfo(BaseModel):
    eos_token: str | None = None
    bos_token: str | None = None
    pad_token: str | None = None
    chat_template: str | None = None
    model_max_length: int
