"""Requests of several sequences: batched prompts, `n` > 1, `best_of`, and scoring requests.

Such a request runs as sequences of one prompt and one choice each, the same document as a
plain request (so P, D and the mixed worker serve each as before), and their answers merge
into one:

    prompt i of k, sequence j of m (m = best_of, else n)  ->  sub-request i * m + j:
        body with prompt = prompts[i], n = 1, no best_of, seed = choice_seed(seed, j)
    answer: choices indexed i * n + (rank of j), usage summed (prompt tokens once per prompt,
            completion tokens of every sequence run); streamed: every sub-stream's chunks
            as they come, each with its choice's index, then usage (if asked) and [DONE]

Sequence 0 of a seeded request samples with the request's seed, so n = 1 and a plain request
agree; sequence j > 0 with a seed derived from it, the same on the router and on a mixed
worker: PD equals mixed choice for choice. best_of ranks a prompt's sequences by cumulative
log probability (of the whole answer: an echoed prompt adds the same to each) and keeps the
n best; it asks its sub-requests for logprobs (top 0) and drops them when the client did not.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from pdrouter.wire.openai import ChatCompletionRequest, CompletionRequest

# Completions without max_tokens generate at most this many tokens (OpenAI's and vLLM's).
DEFAULT_COMPLETION_MAX_TOKENS = 16
_SEED_STEP = 0x9E3779B97F4A7C15  # the golden-ratio increment: derived seeds far apart
_SEED_MASK = (1 << 63) - 1


def choice_seed(seed: int | None, sequence: int) -> int | None:
    """The seed of a request's sequence `sequence` (0: the request's own)."""
    if seed is None or sequence == 0:
        return seed
    return (seed + sequence * _SEED_STEP) & _SEED_MASK


def sequence_seeds(seed: int | None, indexes: Iterable[int]) -> tuple[int | None, ...]:
    """The engine seeds of a request's sequences (seed: the request's, as parsed), as a
    sub-request of choice_seed's seed gets it (workers.server.prepare: unsigned)."""
    seeds = (choice_seed(seed, index) for index in indexes)
    return tuple(None if s is None else s % 2**64 for s in seeds)


def num_sequences(body: dict[str, Any]) -> int:
    """The sequences a request's one prompt runs as one group (best_of, else n); 1 for a
    request with echo or max_tokens 0 (each of its sequences computes its prompt)."""
    if body.get("echo") or body.get("max_tokens") == 0:
        return 1
    return int(body.get("best_of") or body.get("n") or 1)


@dataclass(frozen=True)
class ChoicePlan:
    """How a request of several sequences runs (plan_choices)."""

    num_prompts: int
    n: int
    num_sequences_per_prompt: int  # best_of, else n
    wants_logprobs: bool  # the client asked for logprobs
    include_usage: bool  # stream: the client asked for a usage chunk
    echo: bool = False  # completions: the prompt echoed (pdrouter.wire.scoring)
    score_only: bool = False  # completions: max_tokens 0

    @property
    def forks(self) -> bool:
        """A prompt's sequences run as one group that computes it once and forks (n > 1 or
        best_of without echo: an echoed sequence computes its prompt for its logprobs)."""
        return self.num_sequences_per_prompt > 1 and not (self.echo or self.score_only)

    @property
    def num_sub_requests(self) -> int:
        return self.num_prompts * self.num_sequences_per_prompt

    @property
    def num_prefill_calls(self) -> int:
        """Prefill calls it may make at once: one per prompt's group, else per sub-request."""
        return self.num_prompts if self.forks else self.num_sub_requests

    def prompt_of(self, sub: int) -> int:
        return sub // self.num_sequences_per_prompt


def plan_choices(request: CompletionRequest | ChatCompletionRequest) -> ChoicePlan | None:
    """The plan of a request that runs as sub-requests; None for one prompt, one choice,
    no echo and max_tokens > 0 (served as one request, as before)."""
    echo = score_only = False
    if isinstance(request, CompletionRequest):
        num_prompts, best_of = len(request.prompts()), request.best_of or request.n
        echo, score_only = request.echo, request.max_tokens == 0
        wants_logprobs = request.logprobs is not None
    else:
        num_prompts, best_of, wants_logprobs = 1, request.n, request.logprobs
    if num_prompts == 1 and best_of == 1 and not (echo or score_only):
        return None
    return ChoicePlan(
        num_prompts,
        request.n,
        best_of,
        wants_logprobs,
        request.include_usage_in_stream(),
        echo,
        score_only,
    )


def sub_bodies(body: dict[str, Any], plan: ChoicePlan) -> list[dict[str, Any]]:
    """The body of each sub-request, in sub-request order (body: the client's, validated)."""
    prompts, seed = _prompts(body), _seed(body)
    return [_sequence_body(body, plan, prompts, seed, sub) for sub in range(plan.num_sub_requests)]


def group_bodies(body: dict[str, Any], plan: ChoicePlan) -> list[dict[str, Any]]:
    """The body of each prompt's group (ChoicePlan.forks), in prompt order: its first
    sequence's with its n and best_of, so the request's seed (each sequence derives its own:
    sequence_seeds)."""
    prompts, seed, m = _prompts(body), _seed(body), plan.num_sequences_per_prompt
    groups = []
    for i in range(plan.num_prompts):
        one = _sequence_body(body, plan, prompts, seed, i * m)
        one["n"] = plan.n
        if m > plan.n:
            one["best_of"] = m
        groups.append(one)
    return groups


def _prompts(body: dict[str, Any]) -> list[Any] | None:
    """The request's prompts (None: chat's messages), a single prompt as a list of one."""
    prompts = body.get("prompt")
    batched = isinstance(prompts, list) and prompts and isinstance(prompts[0], str | list)
    return [prompts] if prompts is not None and not batched else prompts


def _seed(body: dict[str, Any]) -> int | None:
    seed = body.get("seed")
    return None if seed == -1 else seed  # vLLM's "no seed"


def _sequence_body(
    body: dict[str, Any], plan: ChoicePlan, prompts: list[Any] | None, seed: int | None, sub: int
) -> dict[str, Any]:
    """Sub-request sub's body: its prompt, one choice, its sequence's seed."""
    one = {k: v for k, v in body.items() if k not in ("best_of", "n", "stream_options")}
    if prompts is not None:
        one["prompt"] = prompts[plan.prompt_of(sub)]
    one["seed"] = choice_seed(seed, sub % plan.num_sequences_per_prompt)
    if one["seed"] is None:
        del one["seed"]
    if plan.num_sequences_per_prompt > plan.n and not plan.wants_logprobs:
        one["logprobs"] = 0  # ranking needs each token's logprob
    if body.get("stream"):
        one["stream_options"] = {"include_usage": True}
    return one


def _cumulative_logprob(choice: dict[str, Any]) -> float:
    logprobs = choice.get("logprobs") or {}
    return sum(lp for lp in logprobs.get("token_logprobs") or () if lp is not None)


def _usage_sum(usages: list[dict[str, Any] | None], plan: ChoicePlan) -> dict[str, Any]:
    """Prompt tokens once per prompt (its first sequence's), completion tokens of all."""
    prompt = cached = completion = 0
    for sub, usage in enumerate(usages):
        if usage is None:
            continue
        completion += usage["completion_tokens"]
        if sub % plan.num_sequences_per_prompt == 0:
            prompt += usage["prompt_tokens"]
            cached += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def merge_responses(answers: list[dict[str, Any]], plan: ChoicePlan) -> dict[str, Any]:
    """The whole answer from each sub-request's (in sub-request order)."""
    choices = []
    m = plan.num_sequences_per_prompt
    for i in range(plan.num_prompts):
        ranked = [answers[i * m + j]["choices"][0] for j in range(m)]
        if m > plan.n:  # best_of: the n most likely, ties to the earlier sequence
            order = sorted(range(m), key=lambda j: -_cumulative_logprob(ranked[j]))
            ranked = [ranked[j] for j in order[: plan.n]]
        for rank, choice in enumerate(ranked):
            choice["index"] = i * plan.n + rank
            if not plan.wants_logprobs:
                choice["logprobs"] = None
            choices.append(choice)
    merged = dict(answers[0])
    merged["choices"] = choices
    merged["usage"] = _usage_sum([a.get("usage") for a in answers], plan)
    return merged


class StreamMerge:
    """Sub-streams' events as the client's stream: ids, creation time and indexes of the
    client's request; usage kept back and summed for the end."""

    def __init__(self, plan: ChoicePlan, response_id: str, created: int) -> None:
        self.plan = plan
        self.response_id = response_id
        self.created = created
        self.usages: list[dict[str, Any] | None] = [None] * plan.num_sub_requests
        self.template: dict[str, Any] = {"object": "text_completion"}  # a chunk of it
        self.error: bytes | None = None  # a sub-stream's in-band error, as the client gets it

    def part(self, sub: int, data: bytes) -> bytes:
        """A sub-stream's SSE bytes as the client gets them (b"": all kept back). An in-band
        error event ends the relay: it is kept in `error`, and nothing after it is relayed."""
        out = []
        for event in sse_events(data):
            if event is None or self.error is not None:
                continue
            if "error" in event:
                self.error = b"data: " + json.dumps(event).encode() + b"\n\n"
                continue
            if "id" not in self.template:
                self.template = event
            relayed = self.event(sub, event)
            if relayed is not None:
                out.append(relayed)
        return b"".join(out)

    def event(self, sub: int, event: dict[str, Any]) -> bytes | None:
        """One sub-stream event as the client gets it (None: kept back)."""
        if event.get("usage") is not None and not event.get("choices"):
            self.usages[sub] = event["usage"]
            return None
        event["id"], event["created"] = self.response_id, self.created
        for choice in event.get("choices") or ():
            choice["index"] = self.plan.prompt_of(sub) * self.plan.n + sub % self.plan.n
        event.pop("usage", None)
        return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"

    def usage(self) -> dict[str, Any]:
        """The whole request's usage, from each sub-stream's."""
        return _usage_sum(self.usages, self.plan)

    def usage_event(self) -> bytes:
        """The include_usage chunk of the whole request."""
        usage = self.usage()
        event = {**self.template, "id": self.response_id, "created": self.created, "choices": []}
        event["usage"] = usage
        return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


def sse_events(data: bytes) -> list[dict[str, Any] | None]:
    """The JSON events of SSE bytes, None for [DONE]."""
    events: list[dict[str, Any] | None] = []
    for block in data.split(b"\n\n"):
        block = block.strip()
        if not block.startswith(b"data:"):
            continue
        payload = block[5:].strip()
        events.append(None if payload == b"[DONE]" else json.loads(payload))
    return events
