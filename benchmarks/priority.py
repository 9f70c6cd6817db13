"""Priorities under overload: high-priority TTFT with a flood of low-priority requests, against
the same requests on an idle cluster (target: p90 within 1.5x).

    OMP_NUM_THREADS=1 python -m benchmarks.priority [--probes 40] [--low-clients 48]

One cluster (master, pool owner, 1 P, 1 D of the tiny model, router). The router holds
--max-in-flight requests (by default D's own bound: two engine batches), queues the rest by
priority (--max-queued-requests) and keeps --urgent-reserve slots for urgent requests; the
workers run small batches, so the flood fills the router's limit and D's engine seats with low
streams. First the probes run alone: high-priority (priority -10: urgent) streamed completions
one after another. Then --low-clients clients stream low-priority (priority 10) completions
back to back while the same probes run again: each probe starts in the reserve, and the
engines preempt a low stream for it. TTFT is request sent -> first token text; a refused low
request (429) is counted and retried after 0.1 s.

Two configurations in one run (--configs): `shared`, every process and the clients on every
core; `pinned`, P's processes on the first core alone and everything else (D, router, pool, and this
process with its clients) on the other cores (`pdrouter launch --cpu-affinity`): a deployment
where P has a device of its own. The gap between the two is what the cores shared by P, D, the
router and the clients cost, not what scheduling does. Writes its tables between the markers
of docs/benchmarks/priority.md (benchmarks.table_file; the prose around them is kept;
--output '' to skip).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from dataclasses import dataclass

import httpx

from benchmarks.table_file import publish_section
from pdrouter.launch.cluster import Cluster
from pdrouter.launch.spec import ClusterSpec

HIGH, LOW = -10, 10
# P's own timings of a request, from the router's timeline (/debug/requests/{id}): where a
# high-priority TTFT goes (the first token is P's).
P_STAGES = ("queue_compute_s", "pool_lookup_s", "put_s", "write_wait_s", "total_s")
Probes = tuple[list[float], list[dict[str, float]]]  # TTFTs, P's timings of each


async def ttft_s(client: httpx.AsyncClient, url: str, priority: int, max_tokens: int,
                 salt: int) -> float | None:  # fmt: skip
    """One streamed completion at priority: seconds to its first token's text (None: 429)."""
    body = {"model": "tiny", "prompt": f"request {salt}: tell me something", "stream": True,
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "priority": priority}  # fmt: skip
    headers = {"X-Request-Id": f"probe-{salt}"} if priority == HIGH else {}
    t0 = time.perf_counter()
    first = None
    async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as resp:
        if resp.status_code == 429 and priority != HIGH:
            return None  # the flood past every bound: counted by the caller
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if first is None and line.startswith("data: {"):
                choices = json.loads(line[6:]).get("choices") or [{}]
                if choices[0].get("text"):
                    first = time.perf_counter() - t0
    assert first is not None, "a stream without a token"
    return first


async def probes(url: str, admin_key: str, num: int, max_tokens: int, salt: int
                 ) -> Probes:  # fmt: skip
    """num high-priority requests one after another: their TTFTs and P's timings of each."""
    ttfts, timings = [], []
    auth = {"Authorization": f"Bearer {admin_key}"}
    async with httpx.AsyncClient(timeout=600) as client:
        for i in range(num):
            ttft = await ttft_s(client, url, HIGH, max_tokens, salt + i)
            assert ttft is not None  # (a probe is never refused: it raises)
            ttfts.append(ttft)
            timeline = await client.get(f"{url}/debug/requests/probe-{salt + i}", headers=auth)
            timings.append(timeline.json()["prefill"])
    return ttfts, timings


async def overload(url: str, admin_key: str, num_probes: int, num_low: int, max_tokens: int
                   ) -> tuple[Probes, list[float], int]:  # fmt: skip
    """The probes (as probes()) while num_low clients stream low-priority requests, the low
    requests' TTFTs, and how many of them were refused."""
    low: list[float] = []
    refused = [0]
    stop = asyncio.Event()
    limits = httpx.Limits(max_connections=num_low + 4)

    async def flood(client: httpx.AsyncClient, n: int) -> None:
        i = 0
        while not stop.is_set():
            ttft = await ttft_s(client, url, LOW, 4 * max_tokens, 10_000 * (n + 1) + i)
            i += 1
            if ttft is None:
                refused[0] += 1
                await asyncio.sleep(0.1)
            else:
                low.append(ttft)

    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        tasks = [asyncio.ensure_future(flood(client, n)) for n in range(num_low)]
        await asyncio.sleep(2.0)  # the queues fill
        high = await probes(url, admin_key, num_probes, max_tokens, salt=1_000_000)
        stop.set()
        await asyncio.gather(*tasks)
    return high, low, refused[0]


def p(values: list[float], q: int) -> float:
    """The q-th percentile of values."""
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


@dataclass(frozen=True)
class Run:
    """One configuration's measurements."""

    idle: Probes
    high: Probes
    low: list[float]
    num_refused: int

    @property
    def ratio(self) -> float:
        return p(self.high[0], 90) / p(self.idle[0], 90)


CONFIGS = {
    "shared": "shared cores",
    "pinned": "P on a core of its own",
}


def render(runs: dict[str, Run], args: argparse.Namespace) -> str:
    """The tables of every configuration run."""
    ttft_rows = [
        (CONFIGS[name], label, values)
        for name, run in runs.items()
        for label, values in (
            ("high priority, idle", run.idle[0]),
            ("high priority, overloaded", run.high[0]),
            ("low priority, overloaded", run.low),
        )
    ]
    lines = [
        f"`OMP_NUM_THREADS=1 python -m benchmarks.priority --probes {args.probes} "
        f"--low-clients {args.low_clients}` ({os.cpu_count()} cores, load average "
        f"{os.getloadavg()[0]:.1f} at the end). Router `--max-in-flight {args.max_in_flight} "
        f"--urgent-reserve {args.urgent_reserve} --max-queued-requests 1024 "
        f"--batches-in-flight-per-instance {batches(args)}`, workers `--max-num-seqs "
        f"{args.max_num_seqs}`.",
        "",
        "| cores | requests | n | TTFT p50 ms | TTFT p90 ms |",
        "|---|---|---:|---:|---:|",
        *(
            f"| {config} | {label} | {len(v)} | {1000 * p(v, 50):.1f} | {1000 * p(v, 90):.1f} |"
            for config, label, v in ttft_rows
        ),
        "",
        "| cores | high p90 overloaded / idle (target <= 1.5x) | low requests refused (429) |",
        "|---|---:|---:|",
        *(
            f"| {CONFIGS[name]} | **{run.ratio:.2f}x** ({'met' if run.ratio <= 1.5 else 'missed'})"
            f" | {run.num_refused} |"
            for name, run in runs.items()
        ),
        "",
        "P's own timings of the high-priority requests (their first token is P's), mean ms:",
        "",
        "| cores | high priority | " + " | ".join(P_STAGES) + " |",
        "|---|---|" + "---:|" * len(P_STAGES),
        *(
            f"| {CONFIGS[name]} | {label} | "
            + " | ".join(f"{1000 * statistics.mean(t[k] for t in timings):.1f}" for k in P_STAGES)
            + " |"
            for name, run in runs.items()
            for label, (_, timings) in (("idle", run.idle), ("overloaded", run.high))
        ),
    ]
    return "\n".join(lines)


def batches(args: argparse.Namespace) -> float:
    """--batches-in-flight-per-instance: D's bound holds the limit and the reserve, so that a
    low request is not refused at D's door while urgent ones are in flight."""
    return (args.max_in_flight + args.urgent_reserve) / args.max_num_seqs


def pinning(config: str) -> tuple[tuple[tuple[str, str], ...], set[int] | None]:
    """The cluster's --cpu-affinity and this process's CPUs for config (pinned: P on the
    first core, the rest and the clients on the others)."""
    if config == "shared":
        return (), None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("--configs pinned needs at least 2 cores")
    p_cpu, rest = str(cpus[0]), ",".join(map(str, cpus[1:]))
    return (("prefill", p_cpu), ("decode", rest), ("router", rest), ("pool", rest)), set(cpus[1:])


def run_config(config: str, args: argparse.Namespace) -> Run:
    """Start the cluster of config, warm it, then the idle probes and the overload."""
    affinity, own_cpus = pinning(config)
    spec = ClusterSpec(
        model="tiny", num_prefill=1, num_decode=1, pool_size="256MiB", cpu_affinity=affinity,
        worker_args=("--max-num-seqs", str(args.max_num_seqs), "--max-model-len", "512"),
        router_args=("--max-in-flight", str(args.max_in_flight), "--urgent-reserve",
                     str(args.urgent_reserve), "--max-queued-requests", "1024",
                     "--max-queue-wait-s", "600", "--local-prefill-below-tokens", "0",
                     "--batches-in-flight-per-instance", str(batches(args))),
        startup_timeout_s=600.0,
    )  # fmt: skip
    all_cpus = os.sched_getaffinity(0)
    if own_cpus is not None:  # the clients share the cores of D and the router, never P's
        os.sched_setaffinity(0, own_cpus)
    try:
        with Cluster(spec) as cluster:
            url, key = cluster.router_url, cluster.admin_key
            asyncio.run(probes(url, key, 4, args.max_tokens, salt=-100))  # warm every path
            idle = asyncio.run(probes(url, key, args.probes, args.max_tokens, salt=0))
            high, low, num_refused = asyncio.run(
                overload(url, key, args.probes, args.low_clients, args.max_tokens)
            )
    finally:
        os.sched_setaffinity(0, all_cpus)
    return Run(idle, high, low, num_refused)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.priority",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--probes", type=int, default=40, help="high-priority requests per phase")
    parser.add_argument("--low-clients", type=int, default=48, help="low-priority clients")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per probe")
    parser.add_argument("--max-num-seqs", type=int, default=4, help="each engine's batch")
    parser.add_argument(
        "--max-in-flight",
        type=int,
        default=None,
        help="the router's bound (default: two engine batches, D's bound)",
    )
    parser.add_argument(
        "--urgent-reserve",
        type=int,
        default=4,
        help="the router's slots for urgent requests beyond it",
    )
    parser.add_argument(
        "--configs",
        nargs="+",
        choices=tuple(CONFIGS),
        default=list(CONFIGS),
        help="shared: every core for every process; pinned: P on a core alone",
    )
    parser.add_argument("--output", default="docs/benchmarks/priority.md")
    args = parser.parse_args(argv)
    if args.max_in_flight is None:
        args.max_in_flight = 2 * args.max_num_seqs
    runs = {config: run_config(config, args) for config in args.configs}
    text = render(runs, args)
    if args.output:
        publish_section(args.output, "priority-run", text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
