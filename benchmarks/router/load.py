"""The router benchmark's load generator: C streaming clients, each checked token for token.

aiohttp rather than httpx or the openai client: on a 2-core machine the load generator shares
the CPU with the router under test, and aiohttp's client costs several times less CPU per
streamed chunk, which leaves more of the machine to what is measured.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from benchmarks.router.mock_backend import token_text


class StreamBroken(RuntimeError):
    """A stream that did not arrive whole: wrong status, lost, duplicated or damaged tokens."""


@dataclass
class LoadResult:
    latencies_s: list[float] = field(default_factory=list)  # request sent -> [DONE]
    ttfts_s: list[float] = field(default_factory=list)  # request sent -> first token text
    elapsed_s: float = 0.0
    cpu_s: float | None = None  # the serving process group's CPU, where it was measured

    @property
    def requests_per_s(self) -> float:
        return len(self.latencies_s) / self.elapsed_s if self.elapsed_s else 0.0


def _aiohttp() -> Any:
    try:
        import aiohttp
    except ImportError:
        raise SystemExit(
            "the router benchmark's load generator needs aiohttp: .venv/bin/pip install aiohttp"
        ) from None
    return aiohttp


def _text_of(payload: dict[str, Any]) -> str:
    choices = payload.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "text" in choice:
        return choice["text"] or ""
    return (choice.get("delta") or {}).get("content") or ""


async def stream_once(session: Any, url: str, model: str, num_tokens: int) -> tuple[float, float]:
    """One streamed completion of num_tokens; (latency_s, ttft_s). Raises StreamBroken unless
    the text is exactly the mock's num_tokens token texts in order, followed by [DONE]."""
    body = {"model": model, "prompt": "Say something.", "max_tokens": num_tokens,
            "temperature": 0, "stream": True}  # fmt: skip
    t0 = time.perf_counter()
    ttft_s = 0.0
    texts: list[str] = []
    done = False
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise StreamBroken(f"{url}: HTTP {resp.status}: {(await resp.text())[:300]}")
        async for line in resp.content:
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                continue
            text = _text_of(json.loads(data))
            if text:
                if not texts:
                    ttft_s = time.perf_counter() - t0
                texts.append(text)
    latency_s = time.perf_counter() - t0
    expected = "".join(token_text(k) for k in range(num_tokens))
    if not done or "".join(texts) != expected:
        got = "".join(texts)
        raise StreamBroken(
            f"{url}: stream damaged (done={done}): expected {num_tokens} tokens, got "
            f"{got.count(' w')} ({got[:80]!r}...{got[-80:]!r})"
        )
    return latency_s, ttft_s


async def run_load(
    url: str,
    model: str,
    concurrency: int,
    num_tokens: int,
    window_s: float,
    num_requests: int | None = None,
) -> LoadResult:
    """concurrency clients issuing streams back to back for window_s (or num_requests in all).

    Requests still running when the window closes are finished and counted, and the elapsed
    time runs until the last one ends, so requests/s is completed requests over real time.
    """
    aiohttp = _aiohttp()
    result = LoadResult()
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    timeout = aiohttp.ClientTimeout(total=60)
    left = [num_requests if num_requests is not None else -1]

    async def client(session: Any, deadline: float) -> None:
        while True:
            if num_requests is None and time.perf_counter() >= deadline:
                return
            if num_requests is not None:
                if left[0] <= 0:
                    return
                left[0] -= 1
            latency_s, ttft_s = await stream_once(session, url, model, num_tokens)
            result.latencies_s.append(latency_s)
            result.ttfts_s.append(ttft_s)

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(session, t0 + window_s) for _ in range(concurrency)))
        result.elapsed_s = time.perf_counter() - t0
    return result


async def run_interleaved(
    urls: dict[str, str],
    model: str,
    num_tokens: int,
    window_s: float,
    cpu: Callable[[str], float | None] | None = None,
) -> dict[str, LoadResult]:
    """One request at a time, the cases taking turns request by request (the order rotating
    every turn) for window_s in all, so that whatever the machine does meanwhile falls on
    every case alike: the paired way to compare latencies on a noisy machine. A case's
    elapsed_s is the sum of its own requests' latencies (one client, back to back), so its
    requests/s stays what a window of its own would give. cpu(case) -> seconds (None where a
    case has no process of its own), read before and after the whole run, gives cpu_s."""
    aiohttp = _aiohttp()
    cases = list(urls)
    results = {case: LoadResult() for case in cases}
    cpu_before = {case: cpu(case) for case in cases} if cpu is not None else {}
    sessions = {
        case: aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=1), timeout=aiohttp.ClientTimeout(total=60)
        )
        for case in cases
    }
    try:
        deadline = time.perf_counter() + window_s
        turn = 0
        while time.perf_counter() < deadline:
            for case in cases[turn % len(cases) :] + cases[: turn % len(cases)]:
                latency_s, ttft_s = await stream_once(sessions[case], urls[case], model, num_tokens)
                result = results[case]
                result.latencies_s.append(latency_s)
                result.ttfts_s.append(ttft_s)
                result.elapsed_s += latency_s
            turn += 1
    finally:
        for session in sessions.values():
            await session.close()
    if cpu is not None:
        for case, before in cpu_before.items():
            after = cpu(case)
            results[case].cpu_s = None if before is None or after is None else after - before
    return results
