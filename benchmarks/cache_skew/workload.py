"""The skew and scale workload: many conversations over a few system prompts, one of them
carrying most of the traffic, driven by concurrent users through the router.

    system prompts   num_prompts of prompt_chars characters; a conversation takes prompt 0
                     with probability hot_share, else one of the others uniformly
    conversations    turns each: a user message, the answer appended (the chat API as a client
                     sends it); users threads run conversations from one queue, each
                     conversation's turns in order
    P loads          a sampler reads the router's pdrouter_instance_in_flight of each prefill
                     instance every sample_interval_s

Prompts are printable bytes, one token each (the benchmark model's byte-level tokenizer),
from a seeded generator: every case sends the same requests in the same order per user.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from benchmarks.cache.workloads import BY_SOURCE, MODEL, _timed_stream, text

IN_FLIGHT = "pdrouter_instance_in_flight"


@dataclass(frozen=True)
class SkewSettings:
    num_prompts: int = 4
    hot_share: float = 0.7
    prompt_chars: int = 1000
    conversations: int = 32
    turns: int = 3
    user_chars: int = 40
    users: int = 8
    max_tokens: int = 8
    seed: int = 7
    sample_interval_s: float = 0.05


@dataclass(frozen=True)
class Turn:
    conversation: int
    turn: int
    hot: bool
    start_s: float  # since the workload started
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int


@dataclass
class SkewResult:
    turns: list[Turn] = field(default_factory=list)
    loads: list[tuple[float, dict[str, float]]] = field(default_factory=list)  # (t, P -> load)
    by_source: dict[str, float] = field(default_factory=dict)  # prompt tokens by source
    wall_s: float = 0.0


def metric_values(router_url: str) -> tuple[dict[str, float], dict[str, float]]:
    """(in flight per prefill URL, prompt tokens by source) from the router's /metrics."""
    loads: dict[str, float] = {}
    sources = dict.fromkeys(("device", "pool", "computed"), 0.0)
    for line in httpx.get(f"{router_url}/metrics", timeout=30).text.splitlines():
        if line.startswith(IN_FLIGHT + "{") and 'role="prefill"' in line:
            name, value = line.rsplit(" ", 1)
            loads[name.split('url="')[1].split('"')[0]] = float(value)
        elif line.startswith(BY_SOURCE + "{"):
            name, value = line.rsplit(" ", 1)
            sources[name.split('source="')[1].split('"')[0]] = float(value)
    return loads, sources


def _sample(
    router_url: str,
    interval_s: float,
    t0: float,
    stop: threading.Event,
    out: list[tuple[float, dict[str, float]]],
) -> None:
    while not stop.wait(interval_s):
        out.append((time.perf_counter() - t0, metric_values(router_url)[0]))


def _questions(s: SkewSettings, rng: random.Random) -> list[dict]:
    """The user messages of one conversation (answers are appended as they come)."""
    return [{"role": "user", "content": text(s.user_chars, rng)} for _ in range(s.turns)]


def _run_user(
    api: Any, todo: queue.Queue, s: SkewSettings, t0: float, out: list[Turn], lock: threading.Lock
) -> None:
    while True:
        try:
            index, hot, system, questions = todo.get_nowait()
        except queue.Empty:
            return
        messages: list[dict] = [{"role": "system", "content": system}]
        for turn, question in enumerate(questions):
            messages.append(question)
            start = time.perf_counter() - t0
            ttft_s, answer, usage = _timed_stream(
                api.chat.completions.create,
                chat=True,
                model=MODEL,
                messages=messages,
                max_tokens=s.max_tokens,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            messages.append({"role": "assistant", "content": answer})
            cached = usage.prompt_tokens_details.cached_tokens
            with lock:
                out.append(Turn(index, turn + 1, hot, start, ttft_s, usage.prompt_tokens, cached))


def run(router_url: str, s: SkewSettings) -> SkewResult:
    """The workload once through router_url (module doc)."""
    import openai

    rng = random.Random(s.seed)
    systems = [text(s.prompt_chars, rng) for _ in range(s.num_prompts)]
    todo: queue.Queue = queue.Queue()
    for index in range(s.conversations):
        hot = rng.random() < s.hot_share or s.num_prompts == 1
        system = systems[0] if hot else systems[1 + rng.randrange(s.num_prompts - 1)]
        todo.put((index, hot, system, _questions(s, rng)))
    result = SkewResult()
    before = metric_values(router_url)[1]
    stop, lock = threading.Event(), threading.Lock()
    t0 = time.perf_counter()
    sampler = threading.Thread(
        target=_sample, daemon=True, args=(router_url, s.sample_interval_s, t0, stop, result.loads)
    )
    sampler.start()
    api = openai.OpenAI(base_url=f"{router_url}/v1", api_key="bench", max_retries=0, timeout=600)
    users = [
        threading.Thread(target=_run_user, args=(api, todo, s, t0, result.turns, lock))
        for _ in range(s.users)
    ]
    for user in users:
        user.start()
    for user in users:
        user.join()
    result.wall_s = time.perf_counter() - t0
    stop.set()
    sampler.join()
    after = metric_values(router_url)[1]
    result.by_source = {k: after[k] - before[k] for k in after}
    return result
