"""Priorities under overload: high-priority TTFT with a flood of low-priority requests, against
the same requests on an idle cluster (target: p90 within 1.5x).

    OMP_NUM_THREADS=1 python -m benchmarks.priority [--probes 40] [--low-clients 48]

One cluster (master, pool owner, 1 P, 1 D of the tiny model, router), the router with a
priority admission queue (--max-in-flight, --max-queued-requests) and the workers with small
batches, so that the flood queues both in the router and in the engines. First the probes run
alone: high-priority (priority -10) streamed completions one after another. Then
--low-clients clients stream low-priority (priority 10) completions back to back while the
same probes run again. TTFT is request sent -> first token text. Writes its table to
docs/benchmarks/priority.md (--output '' to skip).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path

import httpx

from pdrouter.launch.cluster import Cluster
from pdrouter.launch.spec import ClusterSpec

HIGH, LOW = -10, 10


async def ttft_s(client: httpx.AsyncClient, url: str, priority: int, max_tokens: int,
                 salt: int) -> float:  # fmt: skip
    """One streamed completion at priority: seconds to its first token's text."""
    body = {"model": "tiny", "prompt": f"request {salt}: tell me something", "stream": True,
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "priority": priority}  # fmt: skip
    t0 = time.perf_counter()
    first = None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if first is None and line.startswith("data: {"):
                choices = json.loads(line[6:]).get("choices") or [{}]
                if choices[0].get("text"):
                    first = time.perf_counter() - t0
    assert first is not None, "a stream without a token"
    return first


async def probes(url: str, num: int, max_tokens: int, salt: int) -> list[float]:
    async with httpx.AsyncClient(timeout=600) as client:
        return [await ttft_s(client, url, HIGH, max_tokens, salt + i) for i in range(num)]


async def overload(url: str, num_probes: int, num_low: int, max_tokens: int
                   ) -> tuple[list[float], list[float]]:  # fmt: skip
    """The probes' TTFTs while num_low clients stream low-priority requests, and theirs."""
    low: list[float] = []
    stop = asyncio.Event()
    limits = httpx.Limits(max_connections=num_low + 4)

    async def flood(client: httpx.AsyncClient, n: int) -> None:
        i = 0
        while not stop.is_set():
            low.append(await ttft_s(client, url, LOW, 4 * max_tokens, 10_000 * (n + 1) + i))
            i += 1

    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        tasks = [asyncio.ensure_future(flood(client, n)) for n in range(num_low)]
        await asyncio.sleep(2.0)  # the queues fill
        high = await probes(url, num_probes, max_tokens, salt=1_000_000)
        stop.set()
        await asyncio.gather(*tasks)
    return high, low


def p(values: list[float], q: int) -> float:
    """The q-th percentile of values."""
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def render(idle: list[float], high: list[float], low: list[float], args: argparse.Namespace) -> str:
    ratio = p(high, 90) / p(idle, 90)
    rows = [("high priority, idle cluster", idle), ("high priority, overloaded", high),
            ("low priority, overloaded", low)]  # fmt: skip
    lines = [
        "# Priorities under overload",
        "",
        f"`OMP_NUM_THREADS=1 python -m benchmarks.priority --probes {args.probes} "
        f"--low-clients {args.low_clients}` ({os.cpu_count()} cores, load average "
        f"{os.getloadavg()[0]:.1f} at the end). Router `--max-in-flight {args.max_in_flight} "
        f"--max-queued-requests 1024`, workers `--max-num-seqs {args.max_num_seqs}`.",
        "",
        "| requests | n | TTFT p50 ms | TTFT p90 ms |",
        "|---|---:|---:|---:|",
        *(
            f"| {name} | {len(v)} | {1000 * p(v, 50):.1f} | {1000 * p(v, 90):.1f} |"
            for name, v in rows
        ),
        "",
        f"High-priority TTFT p90 overloaded / idle: **{ratio:.2f}x** (target <= 1.5x: "
        f"{'met' if ratio <= 1.5 else 'missed'}).",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.priority",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--probes", type=int, default=40, help="high-priority requests per phase")
    parser.add_argument("--low-clients", type=int, default=48, help="low-priority clients")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per probe")
    parser.add_argument("--max-in-flight", type=int, default=16, help="the router's bound")
    parser.add_argument("--max-num-seqs", type=int, default=4, help="each engine's batch")
    parser.add_argument("--output", default="docs/benchmarks/priority.md")
    args = parser.parse_args(argv)
    spec = ClusterSpec(
        model="tiny", num_prefill=1, num_decode=1, pool_size="256MiB",
        worker_args=("--max-num-seqs", str(args.max_num_seqs), "--max-model-len", "512"),
        router_args=("--max-in-flight", str(args.max_in_flight), "--max-queued-requests",
                     "1024", "--max-queue-wait-s", "600", "--local-prefill-below-tokens", "0"),
        startup_timeout_s=600.0,
    )  # fmt: skip
    with Cluster(spec) as cluster:
        url = cluster.router_url
        asyncio.run(probes(url, 4, args.max_tokens, salt=-100))  # warm every path
        idle = asyncio.run(probes(url, args.probes, args.max_tokens, salt=0))
        high, low = asyncio.run(overload(url, args.probes, args.low_clients, args.max_tokens))
    text = render(idle, high, low, args)
    print(text)
    if args.output:
        Path(args.output).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
