"""The internal prefill/decode wire contract: the one module both the router and workers import.

    router -> P   POST /internal/prefill   PrefillRequest  -> PrefillResult (JSON)
                                                              | LocalPrefill (prefill on D)
    router -> D   POST /internal/decode    DecodeRequest   -> SSE stream of DecodeEvent
    router -> D   POST /internal/prefetch  PrefetchRequest -> 202 PrefetchAnswer (or 503)
    router -> D   DELETE /internal/prefetch/{request_id}   -> 204 (held or not)

The OpenAI body travels unchanged (as validated JSON) so that P and D build the exact same
prompt and sampling parameters from it; P is the tokenizer of record and returns the prompt
token ids that D uses for keys and for any recompute. No Paddle here.

The cache scope (cache_scope below) travels beside the body: P's lookup and write, D's read
and write-back and both device prefix caches hash a scoped request's blocks under it
(workers.pool.keys), so a tenant's or a salt's blocks never serve another's request.
"""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, model_validator

from pdrouter.wire.logprobs import TokenLogprob
from pdrouter.wire.scoring import EchoedPrompt

Endpoint = Literal["completions", "chat"]
MissingKVPolicy = Literal["recompute", "fail"]
# finish reasons a client may see (the engine's "prefill_done" never leaves P)
ClientFinishReason = Literal["stop", "length", "abort", "grammar_error"]

PREFILL_PATH = "/internal/prefill"
DECODE_PATH = "/internal/decode"
PREFETCH_PATH = "/internal/prefetch"  # DELETE PREFETCH_PATH/{request_id} releases one
REQUEST_ID_HEADER = "X-Request-Id"


_TENANT_TAG = b"pdrouter:tenant:v1\0"
_SCOPE_TAG = "pdrouter:cache-scope:v1"
# 64 hex digits: what cache_scope returns; the internal messages accept nothing else.
CACHE_SCOPE_PATTERN = r"^[0-9a-f]{64}$"


def tenant_of_key(api_key: str) -> str:
    """The tenant an API key names, as hex: sha256 of a tag and the key, never the key itself.

    A plain digest, not an HMAC under a server secret, so that the router and a worker serving
    /v1 directly name one key's tenant alike (its blocks shared between the two paths) with or
    without --internal-secret. It only lets someone who saw it test guesses of the key
    offline, and the keys are random secrets (the launcher draws 32 bytes); it never leaves
    the internal hops and is never logged."""
    return hashlib.sha256(_TENANT_TAG + api_key.encode()).hexdigest()


def cache_scope(tenant: str | None, cache_salt: str | None) -> str | None:
    """The prefix cache scope of a request: None (the shared cache) when it has neither a
    tenant (tenant_of_key; None when keys share the cache) nor a cache_salt, else a digest of
    both, so that equal (tenant, salt) pairs, and only they, share blocks."""
    if tenant is None and cache_salt is None:
        return None
    canonical = json.dumps([_SCOPE_TAG, tenant, cache_salt], separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid")


class KVHandle(_Message):
    """Where the prompt's KV lives in the pool: one key per block, in sequence order.

    keys[i] holds tokens [i * block_size, (i + 1) * block_size) of the prompt; the last key is a
    partial-block key (`:partial:n`) when num_tokens is not a multiple of block_size.
    """

    fingerprint: str
    block_size: int = Field(ge=1)
    num_tokens: int = Field(ge=0)
    keys: list[str]


class PrefillTimings(_Message):
    """Seconds spent in each part of P's work, measured on P."""

    queue_compute_s: float = 0.0  # from engine add to the first token (waiting + prefill)
    # Of it, the engine's queue (given to the engine -> first scheduled) and its compute
    # (-> the first token); the rest was P's preparation and prefix lookup and load.
    engine_queue_s: float = 0.0
    engine_compute_s: float = 0.0
    d2h_s: float = 0.0  # swap_cache_layout device -> host into staging
    put_s: float = 0.0  # pool exists + batch put
    # Of the write (d2h_s + put_s), what P waited for after the first token; the rest ran
    # while later prefill chunks computed.
    write_wait_s: float = 0.0
    pool_lookup_s: float = 0.0  # prefix cache: exists() after the device match
    pool_load_s: float = 0.0  # prefix cache: get + host -> device of the pool hit
    total_s: float = 0.0


class DecodeTimings(_Message):
    """Seconds spent by D before its first new token, measured on D."""

    alloc_wait_s: float = 0.0  # waiting for free KV blocks
    get_s: float = 0.0  # pool batch get into staging
    h2d_s: float = 0.0  # swap_cache_layout host -> device
    ttft_s: float = 0.0  # from request arrival to the first token D emits


class PrefillRequest(_Message):
    request_id: str
    endpoint: Endpoint
    body: dict[str, Any]  # the OpenAI request body as the client sent it (plus a fixed seed)
    # The prefix cache scope (cache_scope): the pool keys and the device cache hash under it.
    cache_scope: str | None = Field(default=None, pattern=CACHE_SCOPE_PATTERN)
    # Conditional disaggregation: when fewer prompt tokens than this are missing from P's
    # caches (device and pool), P answers LocalPrefill at once and D prefills the prompt
    # itself; 0 never (the router's --local-prefill-below-tokens).
    local_prefill_below_tokens: int = Field(default=0, ge=0)


class FirstToken(_Message):
    """A sequence's first token, sampled by P from its prompt's last logits with the
    sequence's own seed (PrefillResult.sequences)."""

    token_id: int
    text: str
    logprobs: list[TokenLogprob] | None = None
    finish_reason: ClientFinishReason | None = None  # the first token ends this sequence


class PrefillResult(_Message):
    """P's answer: the prompt as tokenized, the first sampled token and where its KV went."""

    request_id: str
    prompt_token_ids: list[int] = Field(min_length=1)
    first_token_id: int
    # Text delta of the first token as an incremental detokenizer emits it ('' when the token
    # ends inside a multi-byte character: D's detokenizer, primed with it, emits the rest).
    first_text: str
    # The first token's logprobs when the request asks for them (pdrouter.wire.logprobs).
    first_logprobs: list[TokenLogprob] | None = None
    # Completions' echo: the prompt's text and, with logprobs, its tokens' (P computed the
    # whole prompt for them); None without echo.
    echo: EchoedPrompt | None = None
    # Set when the first token already ends the request (max_tokens == 1, a stop token or a stop
    # string): the router answers without a decode hop and kv is None.
    finish_reason: ClientFinishReason | None = None
    kv: KVHandle | None = None
    num_blocks_written: int = 0
    num_blocks_skipped: int = 0  # already present in the pool (a shared prefix)
    num_bytes_written: int = 0
    # Prompt tokens whose KV came from a cache on P (device or pool): the client's
    # usage.prompt_tokens_details.cached_tokens. Of them, num_pool_cached_tokens were read
    # from the pool and num_host_cached_tokens swapped in from P's host tier; the rest were
    # in P's device prefix cache.
    num_cached_tokens: int = Field(default=0, ge=0)
    num_pool_cached_tokens: int = Field(default=0, ge=0)
    num_host_cached_tokens: int = Field(default=0, ge=0)
    timings: PrefillTimings = Field(default_factory=PrefillTimings)
    # A group (the body's n, or best_of, sequences: pdrouter.wire.choices.ChoicePlan.forks):
    # the first tokens of sequences 1..m-1 (the fields above are sequence 0's), sampled from
    # the prompt computed once. kv is set when any sequence goes on past its first token.
    sequences: list[FirstToken] = Field(default_factory=list)

    def first_tokens(self) -> list[FirstToken]:
        """Every sequence's first token, sequence 0's first."""
        own = FirstToken(
            token_id=self.first_token_id,
            text=self.first_text,
            logprobs=self.first_logprobs,
            finish_reason=self.finish_reason,
        )
        return [own, *self.sequences]


class LocalPrefill(_Message):
    """P's answer when D should prefill the prompt itself: fewer of its tokens than the
    router's threshold are missing from P's caches, so computing them on D costs less than
    the handoff through the pool. P computed nothing; the router sends D the prompt with no
    KV handle and no first token, and D's first event carries the first token."""

    request_id: str
    prompt_token_ids: list[int] = Field(min_length=1)
    # The reason: prompt tokens neither P's device cache nor the pool held, against the
    # threshold the request carried (PrefillRequest.local_prefill_below_tokens).
    num_uncached_tokens: int = Field(ge=0)
    threshold_tokens: int = Field(ge=1)


# What P answers: its result (the usual case, tried first) or the decision to prefill on D.
PrefillAnswer = Annotated[PrefillResult | LocalPrefill, Field(union_mode="left_to_right")]
PREFILL_ANSWER = TypeAdapter(PrefillAnswer)


class DecodeSequence(_Message):
    """One sequence of a group D decodes (DecodeRequest.sequences)."""

    # The sequence's number in its request: its seed is choice_seed(seed, index)
    # (pdrouter.wire.choices), and D's events for it carry it (DecodeEvent.index).
    index: int = Field(ge=0)
    output_token_ids: list[int] = Field(min_length=1)  # the tokens the client has of it


class DecodeRequest(_Message):
    request_id: str
    endpoint: Endpoint
    body: dict[str, Any]
    prompt_token_ids: list[int] = Field(min_length=1)
    # Tokens the client already has (the first token from P; more on a resume). They count
    # towards max_tokens and are never sent again. Empty only without a KV handle: D
    # prefills the prompt itself and samples the first token (LocalPrefill).
    output_token_ids: list[int]
    kv: KVHandle | None = None
    missing_kv_policy: MissingKVPolicy | None = None  # None: the decode worker's default
    # P's cache scope: D reads, caches and writes back the prompt's blocks under it.
    cache_scope: str | None = Field(default=None, pattern=CACHE_SCOPE_PATTERN)
    # A group: the sequences still going on, decoded as one request (the prompt loaded once,
    # then forked: workers/engine/sequence_group.py; one left: a plain request with its
    # sequence's seed); output_token_ids are sequences[0]'s. None: one sequence.
    sequences: list[DecodeSequence] | None = None

    @model_validator(mode="after")
    def _first_token_with_handle(self) -> DecodeRequest:
        if self.kv is not None and not self.output_token_ids:
            raise ValueError("a KV handle comes with P's first token in output_token_ids")
        if self.sequences is not None and (
            not self.sequences or self.sequences[0].output_token_ids != self.output_token_ids
        ):
            raise ValueError("a group has sequences, output_token_ids the first one's")
        return self


class PrefetchRequest(PrefillRequest):
    """Sent to the chosen D beside the PrefillRequest, the same document: D templates and
    tokenizes the prompt, reserves its blocks and reads P's writes into them as they land,
    so that the DecodeRequest of the same request_id finds most of its KV loaded (D ignores
    local_prefill_below_tokens: the decision is P's)."""


class PrefetchAnswer(_Message):
    """D's 202: what it reserved for the request (one block per prompt key)."""

    request_id: str
    num_prompt_tokens: int
    num_blocks_reserved: int


class DecodeEvent(_Message):
    """One SSE `data:` payload of D's stream: the tokens produced since the previous event."""

    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: ClientFinishReason | None = None
    num_output_tokens: int  # total so far, including output_token_ids of the request
    logprobs: list[TokenLogprob] | None = None  # of token_ids, when the request asks for them
    # Final event only: how the prompt KV was obtained.
    num_blocks_loaded: int | None = None
    num_tokens_recomputed: int | None = None
    num_bytes_read: int | None = None
    # Of num_blocks_loaded, those read while P still computed (the request's prefetch).
    num_blocks_loaded_ahead: int | None = None
    timings: DecodeTimings | None = None
    # Final event of a request D prefilled itself (no KV handle): the prompt tokens it took
    # from a cache (its device cache or the pool; the client's cached_tokens), and of them
    # those read from the pool and those swapped in from D's host tier.
    num_cached_tokens: int | None = None
    num_pool_cached_tokens: int | None = None
    num_host_cached_tokens: int | None = None
    # A group's (DecodeRequest.sequences): the sequence this event is about, and on its final
    # event whether others still go on (the stream ends with the last one's final event).
    index: int = 0
    more: bool = False

    @property
    def ends_stream(self) -> bool:
        return self.finished and not self.more

    @property
    def num_token_ids(self) -> int:
        """len(token_ids), which TokenEvent counts without parsing its ids."""
        return len(self.token_ids)


def decode_event_sse(event: DecodeEvent) -> bytes:
    """One event of D's stream as D writes it: fields at their defaults left out (a token's
    event is its ids, text and count; the final event adds what it sets), so every relayed
    token costs D, the router and the wire a third of the bytes of the full document."""
    return b"data: " + event.model_dump_json(exclude_defaults=True).encode() + b"\n\n"


class StageError(BaseModel):
    """Error body of the internal endpoints and of D's stream (an `error` SSE event).

    The OpenAI error shape plus missing_keys; unknown fields are ignored so that any worker's
    OpenAI error body parses.
    """

    model_config = ConfigDict(extra="ignore")

    message: str
    type: str = "server_error"
    param: str | None = None
    code: str | None = None
    missing_keys: list[str] | None = None


class StageErrorBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    error: StageError


# -- the router's side of the two requests, as bytes ------------------------------------------

_json_string = json.encoder.encode_basestring_ascii  # type: ignore[attr-defined]
_compact = json.JSONEncoder(separators=(",", ":")).encode


def _nullable(text: str | None) -> bytes:
    """A string or null as JSON; the fields that are null on most requests skip the encoder."""
    return b"null" if text is None else _json_string(text).encode()


def _ints(values: list[int]) -> bytes:
    """Token ids as compact JSON: the same bytes as the encoder's, in a third of its time."""
    return b"[" + ",".join(map(str, values)).encode() + b"]"


def prefill_request_json(
    request_id: str,
    endpoint: Endpoint,
    body_json: bytes,
    cache_scope: str | None = None,
    local_prefill_below_tokens: int = 0,
) -> bytes:
    """A PrefillRequest as the router sends it: body_json (the client's body, validated, seed
    fixed) spliced in as the JSON it already is, not parsed and encoded again per hop. The
    same document as PrefillRequest(...).model_dump_json()
    (tests/pdrouter/router/test_worker_payloads.py)."""
    return b'{"request_id":%s,"endpoint":%s,"body":%s,"cache_scope":%s,%s}' % (
        _json_string(request_id).encode(),
        _json_string(endpoint).encode(),
        body_json,
        _nullable(cache_scope),
        b'"local_prefill_below_tokens":%d' % local_prefill_below_tokens,
    )


def decode_request_json(
    request_id: str,
    endpoint: Endpoint,
    body_json: bytes,
    prompt_token_ids: list[int],
    output_token_ids: list[int],
    kv: KVHandle | None,
    missing_kv_policy: MissingKVPolicy | None,
    cache_scope: str | None = None,
    sequences: list[DecodeSequence] | None = None,
) -> bytes:
    """A DecodeRequest as the router sends it, body_json spliced in as for prefill."""
    return b"".join(
        (
            b'{"request_id":',
            _json_string(request_id).encode(),
            b',"endpoint":',
            _json_string(endpoint).encode(),
            b',"body":',
            body_json,
            b',"prompt_token_ids":',
            _ints(prompt_token_ids),
            b',"output_token_ids":',
            _ints(output_token_ids),
            b',"kv":',
            b"null" if kv is None else kv.model_dump_json().encode(),
            b',"missing_kv_policy":',
            _nullable(missing_kv_policy),
            b',"cache_scope":',
            _nullable(cache_scope),
            b',"sequences":',
            b"null"
            if sequences is None
            else _compact([seq.model_dump() for seq in sequences]).encode(),
            b"}",
        )
    )
