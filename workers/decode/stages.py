"""The stages of one decode request before its stream starts, each taking what the one
before produced:

    check     the body gives P's SamplingParams, its grammar compiled within the
              worker's budget (before any block is held); the KV handle matches
              this worker's fingerprint and block size and the prompt's keys
              under the request's cache scope                           else 400
    allocate  blocks for the prompt, within --pool-wait-s, preempting less
              urgent running requests for them                         else 503 kv_full
    load      the handle's keys read into them, up to the first miss
              (workers/handoff/reader.py; staging slots within --pool-wait-s, else 503 staging_full)
    admit     missing blocks: policy `recompute` frees the unfilled ones (the engine
              recomputes from there), policy `fail` answers 502 naming them; the
              EngineRequest over the filled blocks, handed to the engine (hand_over), and
              its first output awaited (first_output): an id the engine holds (still
              decoding, or a finished request not yet released)         else 400
                                                                        (then stream.py)

Both refusals come before the response starts, as a plain 400 `duplicate_request_id`: an
error event inside a 200 stream would read to the router as a D that broke the contract (a
failed attempt, a retry on another D) instead of the client's error.

Block ownership: ours from allocate until hand_over returns, and every path before that
frees them; then the engine's, also when it refuses the request in its thread (it frees
them then) or the caller goes away (closing the engine stream aborts the request).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Sequence

from pdrouter.wire.choices import sequence_seeds
from pdrouter.wire.errors import APIError, bad_request, unavailable
from pdrouter.wire.openai import ChatCompletionRequest, CompletionRequest, parse_request
from pdrouter.wire.pd import DecodeRequest, StageError, StageErrorBody
from pdrouter.wire.worker import WorkerIdentity
from workers.engine.api import EngineRequest, RequestOutput, SamplingParams
from workers.engine.request_stream import RequestStream
from workers.handoff.reader import ReadOutcome, load_blocks
from workers.handoff.tasks import finish_in_thread
from workers.pool.keys import block_keys
from workers.server.pd_worker import PDSeam
from workers.server.prepare import (
    check_model_name,
    completion_max_tokens,
    fit_max_tokens,
    sampling_params,
)
from workers.server.structured import request_constraint, with_grammar


async def decode_params(seam: PDSeam, req: DecodeRequest) -> SamplingParams:
    """The SamplingParams P ran with, from the same body and P's prompt token ids, its
    grammar compiled (structured.with_grammar: off the event loop, budgeted, cached by schema).

    P is the tokenizer of record: D never templates or tokenizes the prompt again, it sizes
    max_tokens from len(prompt_token_ids) exactly as prepare_request did on P.
    """
    parsed, max_tokens = _sized_request(seam.identity, req)
    # The prompt's logprobs are P's work (it computed the prompt): D never recomputes them.
    params = dataclasses.replace(sampling_params(parsed, max_tokens), prompt_logprobs=None)
    return await with_grammar(params, request_constraint(parsed), seam.engine.grammars)


def _sized_request(
    identity: WorkerIdentity, req: DecodeRequest
) -> tuple[ChatCompletionRequest | CompletionRequest, int]:
    """The parsed body and the max_tokens P ran it with."""
    request_cls = ChatCompletionRequest if req.endpoint == "chat" else CompletionRequest
    parsed = parse_request(request_cls, json.dumps(req.body).encode())
    check_model_name(parsed.model, identity.served_model_names)
    max_len = identity.max_model_len
    if isinstance(parsed, ChatCompletionRequest):
        requested, param = parsed.requested_max_tokens(), "messages"
    else:
        requested, param = (
            completion_max_tokens(parsed, len(req.prompt_token_ids), max_len),
            "prompt",
        )
    return parsed, fit_max_tokens(len(req.prompt_token_ids), requested, max_len, param)


def check_handle(identity: WorkerIdentity, req: DecodeRequest) -> list[str]:
    """The keys to read: recomputed from the prompt and checked against P's handle."""
    if req.kv is None:
        return []
    if req.kv.fingerprint != identity.fingerprint or req.kv.block_size != identity.block_size:
        raise bad_request(
            f"KV handle of fingerprint {req.kv.fingerprint} (block size {req.kv.block_size}) "
            f"cannot load into this decode worker ({identity.fingerprint}, block size "
            f"{identity.block_size})",
            "kv",
        )
    keys = block_keys(
        identity.fingerprint, req.prompt_token_ids, identity.block_size, scope=req.cache_scope
    )
    if req.kv.keys != keys or req.kv.num_tokens != len(req.prompt_token_ids):
        raise bad_request("KV handle keys do not match prompt_token_ids", "kv")
    return keys


async def allocate(seam: PDSeam, num_blocks: int, priority: int = 0) -> list[int]:
    """num_blocks engine blocks within --pool-wait-s, else 503 kv_full (the router tries another
    D); running requests less urgent than priority are preempted for them. Each try waits
    for the engine thread between two steps, off the event loop."""
    if num_blocks == 0:
        return []
    wait_s = seam.settings.wait_s
    deadline_s = time.monotonic() + wait_s
    delay_s = 0.002
    while True:
        block_ids = await seam.engine.allocate_blocks(num_blocks, priority)
        if block_ids is not None:
            return block_ids
        if time.monotonic() + delay_s > deadline_s:
            raise unavailable(f"no {num_blocks} free KV blocks within {wait_s:.0f}s", "kv_full")
        await asyncio.sleep(delay_s)
        delay_s = min(delay_s * 2, 0.05)


async def load(
    seam: PDSeam, keys: Sequence[str], block_ids: Sequence[int], priority: int = 0
) -> ReadOutcome:
    """The handle's keys read into block_ids up to the first miss, on a handoff thread by
    priority (the request's), awaited to its end even if the caller is cancelled (the copy
    writes the blocks the caller frees)."""
    if not keys:
        return ReadOutcome()
    pool = seam.open_pool()
    settings = seam.settings
    return await finish_in_thread(
        load_blocks,
        pool,
        seam.engine.kv_caches,
        keys,
        block_ids,
        group_blocks=settings.transfer_batch_blocks,
        wait_s=settings.wait_s,
        priority=priority,
    )


def missing_blocks_error(num_keys: int, loaded: ReadOutcome) -> StageErrorBody:
    """The 502 body of policy `fail`: how many blocks could not be read, and which keys."""
    missing = list(loaded.missing_keys)
    message = (
        f"{num_keys - loaded.num_loaded} of {num_keys} KV blocks could not be read from the "
        f"pool (policy fail); first missing: {', '.join(missing[:8])}"
    )
    return StageErrorBody(error=StageError(message=message, missing_keys=missing))


def admit(
    seam: PDSeam,
    req: DecodeRequest,
    params: SamplingParams,
    block_ids: Sequence[int],
    loaded: ReadOutcome,
) -> EngineRequest:
    """The engine request over the filled blocks (the unfilled ones go back first); 400 if
    the engine cannot run it (then the caller still owns the filled blocks)."""
    seam.engine.free_blocks(block_ids[loaded.num_loaded :])
    num_computed = min(loaded.num_loaded * seam.identity.block_size, len(req.prompt_token_ids))
    engine_req = EngineRequest(
        request_id=req.request_id,
        prompt_token_ids=tuple(req.prompt_token_ids),
        params=params,
        output_token_ids=tuple(req.output_token_ids),
        preallocated_block_ids=tuple(block_ids[: loaded.num_loaded]),
        num_computed_tokens=num_computed,
        cache_scope=req.cache_scope,
    )
    if req.sequences is not None:  # a group: loaded once, forked at the prompt's end
        seeds = sequence_seeds(params.seed, (s.index for s in req.sequences))
        if len(seeds) == 1:  # one sequence left (a resume): a plain request with its seed
            engine_req = dataclasses.replace(
                engine_req, params=dataclasses.replace(params, seed=seeds[0])
            )
        else:
            outputs = tuple(tuple(s.output_token_ids) for s in req.sequences[1:])
            engine_req = dataclasses.replace(
                engine_req, sequence_seeds=seeds, sequence_output_token_ids=outputs
            )
    try:
        seam.engine.validate(engine_req)
    except ValueError as exc:
        raise bad_request(str(exc)) from None
    return engine_req


def refused(error: ValueError) -> APIError:
    """The 400 of a request id the engine holds: the client's (or the router's) error."""
    return bad_request(
        f"the decode engine refused the request: {error}", "request_id", "duplicate_request_id"
    )


def engine_failed(error: Exception) -> APIError:
    """The 503 of an engine that died or gave no output in time: the worker's fault, and
    another D may serve the request."""
    return unavailable(f"the decode engine could not run the request: {error}", "engine_failed")


def hand_over(seam: PDSeam, engine_req: EngineRequest) -> RequestStream:
    """The engine's stream of engine_req, added now. Raises 400 for an id still decoding
    here and 503 for a dead engine; the caller then still owns the blocks."""
    try:
        return seam.engine.generate(engine_req)
    except ValueError as exc:
        raise refused(exc) from None
    except RuntimeError as exc:  # EngineDeadError
        raise engine_failed(exc) from None


async def first_output(outputs: RequestStream) -> RequestOutput:
    """The request's first output, awaited before the response starts: 400 when the engine
    thread refused the id (held by a finished request not yet released; the engine freed
    the blocks), 503 when the engine died or gave nothing in time. outputs is closed
    whenever this raises (a cancelled caller aborts the request)."""
    try:
        return await anext(outputs)
    except ValueError as exc:
        raise refused(exc) from None
    except (RuntimeError, TimeoutError) as exc:
        raise engine_failed(exc) from None
