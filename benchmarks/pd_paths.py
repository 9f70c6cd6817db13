"""The request paths the PD benchmarks compare, all over one cluster's workers in one run.

    mixed            the cluster's mixed worker (the colocated baseline)
    pd               through a router with every option under test off
    pd+early         ... with D started beside P (the router's default; --no-early-decode off)
    pd+local         ... with conditional disaggregation (--local-prefill-below-tokens)
    pd+early+local   both

Each PD variant is its own router process (`pdrouter serve`) over the same P and D, started
next to the cluster's, so that every variant meets the same workers, the same warm caches and
the same machine load within one run. Early decode is the router's default, turned off by
`--no-early-decode`; a router without that flag has no early decode, and the two early paths
are then skipped and named, never run without it: the probe reads `pdrouter serve --help`.

Also the client both benchmarks of benchmarks/pd_matrix.py use: streamed completions over
httpx at a fixed concurrency, each request timed by its SSE events (TTFT, the first-to-second
token gap, the mean gap after the first).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx

from pdrouter.common.proc import ManagedProcess, find_free_port, wait_for_http
from pdrouter.launch.cluster import ROUTER_PREFIX, Cluster, child_env

# Every prompt counts as short for this one (no prompt of the benchmarks is this long).
ALWAYS_LOCAL_TOKENS = 1_000_000


@dataclass(frozen=True)
class Variant:
    """One path: its name, and the router flags that make it (None: the mixed worker)."""

    name: str
    router_args: tuple[str, ...] | None


def router_flags() -> str:
    """`pdrouter serve --help` of this tree: which flags its router has."""
    argv = [sys.executable, "-m", "pdrouter.cli", "serve", "--help"]
    return subprocess.run(argv, capture_output=True, text=True, check=True).stdout


def matrix_variants(local_tokens: int | None, help_text: str) -> tuple[list[Variant], list[str]]:
    """The five paths of the matrix, and why any was left out. local_tokens: the threshold of
    the `local` variants (None: the router's default)."""
    local_on = () if local_tokens is None else ("--local-prefill-below-tokens", str(local_tokens))
    local_off = ("--local-prefill-below-tokens", "0")
    # Early decode is on by default where the router has it: off must be said.
    has_early = "--no-early-decode" in help_text
    early_off = ("--no-early-decode",) if has_early else ()
    variants = [Variant("mixed", None), Variant("pd", (*early_off, *local_off))]
    skipped = []
    if has_early:
        variants.append(Variant("pd+early", local_off))
    else:
        skipped.append("pd+early and pd+early+local: this router has no early decode")
    variants.append(Variant("pd+local", (*early_off, *local_on)))
    if has_early:
        variants.append(Variant("pd+early+local", local_on))
    return variants, skipped


@contextlib.contextmanager
def extra_router(cluster: Cluster, router_args: tuple[str, ...], name: str) -> Iterator[str]:
    """A `pdrouter serve` over the cluster's P and D with router_args; its URL while open.
    It gets the cluster's secrets through the environment, as the cluster's own router."""
    port = find_free_port()
    url = f"http://{cluster.spec.host}:{port}"
    argv = [sys.executable, "-m", "pdrouter.cli", "serve", "--host", cluster.spec.host,
            "--port", str(port), "--prefill", *cluster.prefill_urls,
            "--decode", *cluster.decode_urls, *router_args]  # fmt: skip
    secrets = cluster.secrets.env(("api_key", "admin_key", "internal_secret"), ROUTER_PREFIX)
    env = child_env({**dict(cluster.spec.env), **secrets})
    log_path = cluster.log_dir / f"router-{name.replace('+', '-')}.log"
    proc = ManagedProcess(f"router {name}", argv, env=env, log_path=log_path, inherit_env=False)
    try:
        wait_for_http(f"{url}/health", 120.0, proc)
        yield url
    finally:
        proc.stop()


@dataclass(frozen=True)
class StreamTiming:
    """One streamed request as its client saw it (seconds)."""

    ttft_s: float
    ttst_s: float | None  # first-to-second token gap (None: fewer than two tokens)
    tpot_s: float | None  # mean gap between tokens after the first

    @property
    def tt2t_s(self) -> float | None:
        """Request sent -> second token: what a short answer waits for through PD (its second
        token waits for D to read the handoff) as well as through D's own prefill."""
        return None if self.ttst_s is None else self.ttft_s + self.ttst_s


# A 429 or 503 (a bound of the router or a worker) is asked again after its Retry-After, this
# many times at most; the request's TTFT counts from its first send, waits included.
MAX_REFUSALS = 60


async def _stream(client: httpx.AsyncClient, url: str, body: dict) -> StreamTiming:
    t0 = time.perf_counter()
    times: list[float] = []
    for _ in range(MAX_REFUSALS):
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            if resp.status_code in (429, 503):
                await resp.aread()
                await asyncio.sleep(float(resp.headers.get("retry-after") or 1))
                continue
            await _read_text_events(resp, times)
            break
    if not times:
        raise RuntimeError(f"{url}: a stream without text (or refused {MAX_REFUSALS} times)")
    n = len(times)
    ttst = times[1] - times[0] if n > 1 else None
    tpot = (times[-1] - times[0]) / (n - 1) if n > 1 else None
    return StreamTiming(times[0] - t0, ttst, tpot)


async def _read_text_events(resp: httpx.Response, times: list[float]) -> None:
    """Append the arrival time of every SSE event that carries text."""
    resp.raise_for_status()
    async for line in resp.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        choices = json.loads(line[6:]).get("choices") or []
        if choices and choices[0].get("text"):
            times.append(time.perf_counter())


async def _drive(url: str, bodies: list[dict], concurrency: int) -> list[StreamTiming]:
    queue = list(reversed(bodies))
    out: list[StreamTiming] = []
    async with httpx.AsyncClient(timeout=600) as client:

        async def worker() -> None:
            while queue:
                out.append(await _stream(client, url, queue.pop()))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return out


def drive(url: str, bodies: list[dict], concurrency: int) -> list[StreamTiming]:
    """Stream every body to url/v1/completions, concurrency at a time; each one's timing."""
    return asyncio.run(_drive(url, bodies, concurrency))


def fresh_prompt(num_tokens: int, salt: int) -> list[int]:
    """Printable byte-range token ids drawn from salt: prompts of different salts share no
    prefix (benchmarks.pd.make_prompt has 90 distinct ones, too few for a matrix)."""
    return random.Random(salt).choices(range(33, 123), k=num_tokens)


def completion_body(model: str, prompt: list[int], max_tokens: int) -> dict:
    """A streamed completions body of prompt (token ids), every answer max_tokens long."""
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}  # fmt: skip
