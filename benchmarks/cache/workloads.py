"""The three workloads of the cache benchmark, each through the router with the openai client,
one request at a time (TTFT is then the request's own, not a queue's).

    multi_turn     N conversations of T turns; each shares a ~1,000-token system prompt; a
                   turn adds a user message and the previous answer (the chat API, as a client
                   sends it)
    shared_doc     one ~3,000-token document, short questions about it (completions)
    no_reuse       unique prompts (completions): what the cache costs when nothing repeats

Every prompt is made of printable bytes, one token each (the byte-level tokenizer of the
benchmark model), drawn from a seeded generator: the same run, the same prompts, every case.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

MODEL = "bench-large"
MAX_TOKENS = 16
BY_SOURCE = "pdrouter_prompt_tokens_by_source_total"


@dataclass
class Sample:
    """One request: its turn (or question) index, TTFT and usage."""

    index: int
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int


@dataclass
class WorkloadResult:
    name: str
    samples: list[Sample] = field(default_factory=list)
    by_source: dict[str, float] = field(default_factory=dict)  # router counts, this workload


def text(num_chars: int, rng: random.Random) -> str:
    return "".join(chr(33 + rng.randrange(90)) for _ in range(num_chars))


def _client(base_url: str) -> Any:
    import openai

    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="bench", max_retries=0, timeout=600)


def _timed_stream(create: Any, chat: bool, **kwargs: Any) -> tuple[float, str, Any]:
    """(seconds from sending to the first content chunk, the whole text, usage) of
    create(**kwargs) streamed (create returns once the headers are in, which the router sends
    with P's first token: the clock starts before it)."""
    t0 = time.perf_counter()
    stream = create(stream=True, stream_options={"include_usage": True}, **kwargs)
    first = None
    parts: list[str] = []
    usage = None
    for chunk in stream:
        for choice in chunk.choices:
            piece = (choice.delta.content or "") if chat else choice.text
            if piece and first is None:
                first = time.perf_counter() - t0
            parts.append(piece)
        usage = chunk.usage or usage
    assert usage is not None, "no usage chunk"
    return (first if first is not None else time.perf_counter() - t0), "".join(parts), usage


def _by_source(router_url: str) -> dict[str, float]:
    values = dict.fromkeys(("device", "pool", "computed"), 0.0)
    for line in httpx.get(f"{router_url}/metrics", timeout=30).text.splitlines():
        if line.startswith(BY_SOURCE + "{"):
            name, value = line.rsplit(" ", 1)
            values[name.split('source="')[1].split('"')[0]] = float(value)
    return values


def _measured(name: str, router_url: str, run: Any) -> WorkloadResult:
    before = _by_source(router_url)
    result = WorkloadResult(name, run())
    after = _by_source(router_url)
    result.by_source = {k: after[k] - before[k] for k in after}
    return result


def multi_turn(router_url: str, seed: int, conversations: int, turns: int) -> WorkloadResult:
    rng = random.Random(seed)
    system = text(1000, rng)
    api = _client(router_url)

    def run() -> list[Sample]:
        samples = []
        for _ in range(conversations):
            messages = [{"role": "system", "content": system}]
            for turn in range(turns):
                messages.append({"role": "user", "content": text(40, rng)})
                ttft_s, answer, usage = _timed_stream(
                    api.chat.completions.create, chat=True, model=MODEL, messages=messages,
                    max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True},
                )  # fmt: skip
                messages.append({"role": "assistant", "content": answer})
                cached = usage.prompt_tokens_details.cached_tokens
                samples.append(Sample(turn + 1, ttft_s, usage.prompt_tokens, cached))
        return samples

    return _measured("multi_turn", router_url, run)


def completions(router_url: str, prompts: list[str]) -> list[Sample]:
    api = _client(router_url)
    samples = []
    for i, prompt in enumerate(prompts):
        ttft_s, _, usage = _timed_stream(
            api.completions.create, chat=False, model=MODEL, prompt=prompt,
            max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True},
        )  # fmt: skip
        cached = usage.prompt_tokens_details.cached_tokens
        samples.append(Sample(i + 1, ttft_s, usage.prompt_tokens, cached))
    return samples


def shared_doc(router_url: str, seed: int, questions: int) -> WorkloadResult:
    rng = random.Random(seed + 1)
    document = text(3000, rng)
    prompts = [f"{document}\nQ{i}: {text(24, rng)}\nA:" for i in range(questions)]
    return _measured("shared_doc", router_url, lambda: completions(router_url, prompts))


def no_reuse(router_url: str, seed: int, requests: int, num_tokens: int) -> WorkloadResult:
    # Another seed per case's run is not wanted: every case sees the same unique prompts,
    # each unique within the run (and each case runs on a fresh cluster and pool).
    rng = random.Random(seed + 2)
    prompts = [text(num_tokens, rng) for _ in range(requests)]
    return _measured("no_reuse", router_url, lambda: completions(router_url, prompts))
