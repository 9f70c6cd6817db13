"""The stages of one prefill request, each taking what the one before produced:

    prepare   template + tokenize + validate (P is the tokenizer of record), the block keys
              under the request's cache scope (the router's; device cache, pool and D alike)
    lease     the device + pool prefix as a lease (workers/handoff/pool_prefix.py)
              (before it, worker.py asks local_decision.py whether D should prefill instead)
    generate  the engine runs the prompt (prefill_only) -> the first token and the blocks;
              each finished chunk's blocks go to the writer while the next chunk computes
    write     the blocks not handed over yet; wait for every write -> the KV handle
    result    the metrics and the PrefillResult

Errors, as the router sees them: bad input and a request id the engine already holds -> 400;
no staging slots -> 503 staging_full; the pool failing a put is not an error (D recomputes
what it cannot read).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdrouter.wire.choices import num_sequences, sequence_seeds
from pdrouter.wire.errors import bad_request
from pdrouter.wire.logprobs import TokenLogprob
from pdrouter.wire.openai import ChatCompletionRequest, CompletionRequest, parse_request
from pdrouter.wire.pd import FirstToken, KVHandle, PrefillRequest
from pdrouter.wire.scoring import EchoedPrompt
from workers.engine.api import EngineRequest, RequestOutput, SamplingParams
from workers.handoff.pool_prefix import PoolPrefix, PoolPrefixReader, PrefixReadLimits
from workers.handoff.writer import ChunkedWrite, WriteOutcome
from workers.pool.keys import block_keys
from workers.server.logprobs import echoed_prompt, wire_logprobs
from workers.server.pd_worker import PDSeam
from workers.server.prepare import PreparedRequest, check_model_name, prepare_request
from workers.server.structured import with_grammar, with_matcher


@dataclass(frozen=True)
class PrefillPlan:
    """A prepared request: what the engine runs and the keys its blocks go under."""

    prepared: PreparedRequest
    engine_req: EngineRequest
    keys: tuple[str, ...]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prepared.prompt_token_ids)


@dataclass(frozen=True)
class Generated:
    """What the engine answered: the first token, its text and logprobs, the prompt's blocks."""

    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[Any, ...]
    block_ids: tuple[int, ...]
    num_cached_tokens: int
    compute_s: float  # from the start of the request to the first token
    num_host_cached_tokens: int = 0  # of num_cached_tokens, swapped in from the host tier
    prompt_logprobs: tuple[Any, ...] | None = None  # the engine's, when asked (echo)
    # Of compute_s, the engine's part: its queue (given to the engine -> first scheduled),
    # then its compute (-> the first token).
    engine_queue_s: float = 0.0
    engine_compute_s: float = 0.0
    # A group's sequences 1..m-1: the event of each one's first token, in sequence order.
    others: tuple[RequestOutput, ...] = ()


@dataclass(frozen=True)
class Written:
    """The write stage's answer: how the request ends after one token (None: D continues)."""

    finish_reason: str | None
    first_text: str
    kv: KVHandle | None
    outcome: WriteOutcome
    num_early_blocks: int  # handed to the writer while later chunks computed
    wait_s: float  # of the write, the time waited after the first token
    # A group's sequences 1..m-1: (finish reason, first text) of each, as for sequence 0.
    others: tuple[tuple[str | None, str], ...] = ()


def prepare_pd_request(
    served_model_names: tuple[str, ...],
    tokenizer: Any,
    max_model_len: int,
    endpoint: str,
    body: dict[str, Any],
    request_id: str,
) -> PreparedRequest:
    """The OpenAI body as the engine will run it (a CPU-thread helper)."""
    request_cls = ChatCompletionRequest if endpoint == "chat" else CompletionRequest
    parsed = parse_request(request_cls, json.dumps(body).encode())
    check_model_name(parsed.model, served_model_names)
    return prepare_request(parsed, request_id, tokenizer, max_model_len)


async def prepare(seam: PDSeam, req: PrefillRequest, request_id: str) -> PrefillPlan:
    """Template and tokenize on the CPU threads (the event loop keeps serving /health)."""
    identity = seam.identity
    prepared = await seam.cpu.run(
        prepare_pd_request,
        identity.served_model_names,
        seam.engine.tokenizer,
        identity.max_model_len,
        req.endpoint,
        req.body,
        request_id,
    )
    params = await with_grammar(prepared.params, prepared.constraint, seam.engine.grammars)
    prepared = dataclasses.replace(prepared, params=params)
    engine_req = EngineRequest(
        request_id=request_id,
        prompt_token_ids=prepared.prompt_token_ids,
        params=params,
        prefill_only=True,
        report_progress=seam.settings.write_while_computing,
        cache_scope=req.cache_scope,
        sequence_seeds=group_seeds(req.body, prepared.params),
    )
    try:
        seam.engine.validate(engine_req)
    except ValueError as exc:
        raise bad_request(str(exc)) from None
    engine_req = await with_matcher(engine_req, seam.engine, seam.cpu)
    keys = block_keys(
        identity.fingerprint,
        prepared.prompt_token_ids,
        identity.block_size,
        scope=req.cache_scope,
    )
    return PrefillPlan(prepared, engine_req, tuple(keys))


def group_seeds(body: dict[str, Any], params: SamplingParams) -> tuple[int | None, ...]:
    """The seeds of the body's group of sequences (ChoicePlan.forks), sequence 0's first; ()
    for one sequence. From the parsed seed (params.seed: -1 already read as none), as D
    derives its sequences' seeds."""
    num = num_sequences(body)
    return sequence_seeds(params.seed, range(num)) if num > 1 else ()


def prefix_reader(seam: PDSeam) -> PoolPrefixReader:
    settings = seam.settings
    limits = PrefixReadLimits(
        min_tokens=settings.pool_prefix_min_tokens,
        load_timeout_s=settings.pool_load_timeout_s,
        group_blocks=settings.transfer_batch_blocks,
        wait_s=settings.wait_s,
    )
    return PoolPrefixReader(
        seam.engine,
        seam.pool,
        seam.identity.block_size,
        limits,
        seam.cache_metrics,
        seam.background,
    )


async def lease(seam: PDSeam, plan: PrefillPlan) -> tuple[PrefillPlan, PoolPrefix]:
    """The prompt's device + pool prefix as a lease, and the plan to add over it (the caller
    owns the lease until the engine takes it); its pool calls go by the request's priority."""
    if not seam.settings.pool_prefix or plan.engine_req.params.prompt_logprobs is not None:
        return plan, PoolPrefix()  # (a prompt scored is computed whole: every row's logits)
    engine_req = plan.engine_req
    tokens, priority = plan.prepared.prompt_token_ids, engine_req.params.priority
    prefix = await prefix_reader(seam).acquire(tokens, plan.keys, engine_req.cache_scope, priority)
    if prefix.lease is None:
        return plan, prefix
    engine_req = dataclasses.replace(
        engine_req,
        preallocated_block_ids=prefix.lease.block_ids,
        num_computed_tokens=prefix.lease.num_computed_tokens,
        num_cached_tokens=prefix.lease.num_computed_tokens,
    )
    return dataclasses.replace(plan, engine_req=engine_req), prefix


class RefusedByEngine(Exception):
    """The engine did not take the request (its id is in use): nothing of it to release."""

    def __init__(self, error: ValueError) -> None:
        super().__init__(str(error))
        self.api_error = bad_request(
            f"the prefill engine refused the request: {error}", "request_id", "duplicate_request_id"
        )


async def generate(
    seam: PDSeam, plan: PrefillPlan, prefix: PoolPrefix, writer: ChunkedWrite, t_start: float
) -> Generated:
    """Run the prompt; the blocks of each finished chunk go to the writer as they come.

    Raises RefusedByEngine when the engine refuses the request id (still generating here,
    or a finished prefill not yet released): the lease was given back, the engine holds
    nothing of this request, and the other request's blocks are left alone."""
    engine = seam.engine
    t_engine = time.monotonic()
    try:
        stream = engine.generate(plan.engine_req)
    except ValueError as exc:
        if prefix.lease is not None:  # refused before the engine took it: still ours
            engine.release_lease(prefix.lease)
        raise RefusedByEngine(exc) from None
    token_ids: list[int] = []
    text_parts: list[str] = []
    logprobs: list[Any] = []
    block_ids: tuple[int, ...] = ()
    num_cached = num_host = 0
    prompt_logprobs = None
    got_output = False
    scheduled_s = 0.0
    others: dict[int, RequestOutput] = {}
    try:
        async with contextlib.aclosing(stream) as outputs:
            async for out in outputs:
                got_output = True
                if out.sequence_index:  # a group's other sequence: its first token
                    others[out.sequence_index] = out
                    continue
                if out.ready_block_ids:  # a chunk's blocks: out while the next one computes
                    writer.add(out.ready_from_block, out.ready_block_ids)
                token_ids.extend(out.new_token_ids)
                text_parts.append(out.new_text)
                logprobs.extend(out.new_logprobs)
                num_cached, num_host = out.num_cached_tokens, out.num_host_cached_tokens
                scheduled_s = out.scheduled_s
                if out.prompt_logprobs is not None:
                    prompt_logprobs = out.prompt_logprobs
                if out.finished:
                    block_ids = out.block_ids
    except ValueError as exc:  # refused in the engine thread, which freed the blocks
        if got_output:
            raise
        raise RefusedByEngine(exc) from None
    if not token_ids:
        raise RuntimeError(f"prefill of {plan.engine_req.request_id} ended without a token")
    now_s = time.monotonic()
    scheduled_s = min(max(scheduled_s, t_engine), now_s)  # 0.0 (not reported): no queue
    return Generated(
        tuple(token_ids),
        "".join(text_parts),
        tuple(logprobs),
        block_ids,
        num_cached,
        now_s - t_start,
        num_host,
        prompt_logprobs,
        engine_queue_s=scheduled_s - t_engine,
        engine_compute_s=now_s - scheduled_s,
        others=tuple(others[index] for index in sorted(others)),
    )


def first_token_finish(
    token_id: int,
    text: str,
    params: SamplingParams,
    eos_token_ids: tuple[int, ...],
    decode: Callable[[list[int]], str],
) -> tuple[str | None, str]:
    """(finish reason, text) when the first token already ends the request, else (None, text).

    The engine ends a prefill_only request with "prefill_done" whatever the token; the stop
    rules the decode engine would apply to it are applied here, so that a request that is
    over after one token never takes a decode hop.
    """
    if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in eos_token_ids):
        return "stop", ""
    full_text = decode([token_id])
    for stop in params.stop if params.min_tokens == 0 else ():  # the engine's StopChecker rule
        cut = full_text.find(stop)
        if cut >= 0:
            return "stop", full_text[:cut]
    if params.max_tokens <= 1:
        return "length", text
    return None, text


async def write(
    seam: PDSeam, plan: PrefillPlan, generated: Generated, writer: ChunkedWrite
) -> Written:
    """The blocks not handed over yet, then every write awaited: the handle D reads from (no
    handle when the first token already ends the request)."""
    t0 = time.monotonic()
    tokenizer = seam.engine.tokenizer
    eos_token_ids = tuple(tokenizer.eos_token_ids)
    params = plan.prepared.params
    ends = [
        first_token_finish(token_ids[0], text, params, eos_token_ids, tokenizer.decode)
        for token_ids, text in [
            (generated.token_ids, generated.text),
            *((o.new_token_ids, o.new_text) for o in generated.others),
        ]
    ]
    finish, first_text = ends[0]
    # The handle goes out while any sequence goes on past its first token.
    goes_on = any(end is None for end, _ in ends)
    num_early = writer.next_block
    keys = plan.keys
    if goes_on:
        if len(generated.block_ids) < len(keys):
            raise RuntimeError(
                f"engine returned {len(generated.block_ids)} blocks for {len(keys)} prompt blocks"
            )
        writer.add(num_early, generated.block_ids[num_early : len(keys)])
    outcome = await writer.finish()
    identity = seam.identity
    kv = None
    if goes_on:
        kv = KVHandle(
            fingerprint=identity.fingerprint,
            block_size=identity.block_size,
            num_tokens=plan.num_prompt_tokens,
            keys=list(keys),
        )
    return Written(
        finish, first_text, kv, outcome, num_early, time.monotonic() - t0, tuple(ends[1:])
    )


def first_logprobs(
    seam: PDSeam, plan: PrefillPlan, generated: Generated
) -> list[TokenLogprob] | None:
    if plan.prepared.params.num_logprobs is None:
        return None
    return wire_logprobs(seam.engine.tokenizer, list(generated.logprobs[:1]))


def other_first_tokens(
    seam: PDSeam, plan: PrefillPlan, generated: Generated, written: Written
) -> list[FirstToken]:
    """A group's sequences 1..m-1, as PrefillResult.sequences gives them."""
    with_logprobs = plan.prepared.params.num_logprobs is not None
    return [
        FirstToken(
            token_id=out.new_token_ids[0],
            text=text,
            logprobs=(
                wire_logprobs(seam.engine.tokenizer, list(out.new_logprobs[:1]))
                if with_logprobs
                else None
            ),
            finish_reason=finish,  # type: ignore[arg-type]  # stop | length | None
        )
        for out, (finish, text) in zip(generated.others, written.others, strict=True)
    ]


def echoed(seam: PDSeam, plan: PrefillPlan, generated: Generated) -> EchoedPrompt | None:
    """The prompt as completions' echo gives it (text, and logprobs when asked); None
    without echo."""
    prepared = plan.prepared
    if prepared.echo_text is None:
        return None
    return echoed_prompt(
        seam.engine.tokenizer,
        prepared.echo_text,
        prepared.prompt_token_ids,
        generated.prompt_logprobs,
    )
