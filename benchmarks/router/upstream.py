"""One call from the router to a worker, through each of the router's upstream clients.

    python -m benchmarks.router.upstream [--calls 2000] [--rounds 3] [--output FILE]

A prefill mock (`benchmarks.router.mock_backend`, a bare ASGI app on uvicorn) answers POST
/internal/prefill with a small JSON PrefillResult; this process, on uvloop like the router, calls it
through `h1` (pdrouter.router.upstream.h1) and `aiohttp` (pdrouter.router.upstream.aiohttp_client)
with the router's own headers and bounds, and reads and parses each answer as the router does. Two
paces: back to back, and one call every 3 ms, which is about how often the router calls one P when
it serves one request at a time (caches and the idle CPU cool down in between, as they do there).
Each round runs every client once at each pace, the order rotating, so that background load falls on
all of them alike. The median time per call is what one prefill hop costs the router and the worker
together; the clients differ only in the router's half.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.router.report import cpu_model, dist_version
from pdrouter.common.proc import ManagedProcess, find_free_port, wait_for_http
from pdrouter.router.upstream.contract import HopTimeout
from pdrouter.router.upstream.factory import make_upstream

CLIENTS = ("h1", "aiohttp")
PACES_S = (0.0, 0.003)
_BOUNDS = HopTimeout(connect_s=5.0, read_s=30.0)
_HEADERS = {"X-Request-Id": "bench", "Content-Type": "application/json"}


async def _calls(name: str, url: str, body: bytes, num_calls: int, pace_s: float,
                 times_s: dict[tuple[str, float], list[float]]) -> None:  # fmt: skip
    client = make_upstream(name, 64, {"X-PD-Internal-Secret": "bench"})
    try:
        for i in range(num_calls + 20):  # the first 20 open the connection and warm up
            if pace_s:
                await asyncio.sleep(pace_s)
            t0 = time.perf_counter()
            async with client.request("POST", url, body, _HEADERS, _BOUNDS) as resp:
                json.loads(await resp.read())
            if i >= 20:
                times_s[(name, pace_s)].append(time.perf_counter() - t0)
            assert resp.status_code == 200, resp.status_code
    finally:
        await client.aclose()


async def _measure(url: str, num_calls: int, rounds: int) -> dict[tuple[str, float], list[float]]:
    body = json.dumps({"request_id": "bench", "endpoint": "completions",
                       "body": {"model": "mock", "prompt": "Say something.", "max_tokens": 32,
                                "stream": True}}).encode()  # fmt: skip
    times_s: dict[tuple[str, float], list[float]] = {(c, p): [] for c in CLIENTS for p in PACES_S}
    for r in range(rounds):
        order = CLIENTS[r % len(CLIENTS) :] + CLIENTS[: r % len(CLIENTS)]
        for pace_s in PACES_S:
            for name in order:
                await _calls(name, url, body, num_calls, pace_s, times_s)
    return times_s


def _report(times_s: dict[tuple[str, float], list[float]], args: argparse.Namespace) -> str:
    versions = ", ".join(
        f"{d} {dist_version(d)}" for d in ("httptools", "aiohttp", "httpx", "uvloop")
    )
    lines = [
        "# Upstream client benchmark: one call from the router to a worker",
        "",
        "What one prefill hop costs through each of the router's clients to its workers",
        "(`benchmarks/router/upstream.py`): POST /internal/prefill to the prefill mock, the answer",
        "read and parsed, the router's headers and bounds. Median and p90 per call, in us.",
        "",
        f"- Run: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, `python -m "
        f"benchmarks.router.upstream --calls {args.calls} --rounds {args.rounds}`.",
        f"- Machine: {cpu_model()}, {os.cpu_count()} cores, {platform.system()} "
        f"{platform.release()}, Python {sys.version.split()[0]}; {versions}.",
        "",
        "| client | back to back: p50 | p90 | one call every 3 ms: p50 | p90 |",
        "|---|---:|---:|---:|---:|",
    ]
    for name in CLIENTS:
        cells = []
        for pace_s in PACES_S:
            ordered = sorted(times_s[(name, pace_s)])
            cells += [1e6 * statistics.median(ordered), 1e6 * ordered[int(0.9 * len(ordered))]]
        lines.append(f"| {name} | " + " | ".join(f"{c:.0f}" for c in cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.router.upstream",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--calls", type=int, default=2000, help="timed calls per client and pace")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", default="docs/benchmarks/upstream.md",
                        help="markdown file to write ('' to skip)")  # fmt: skip
    args = parser.parse_args(argv)
    import uvloop

    port = find_free_port()
    with tempfile.TemporaryDirectory(prefix="bench-upstream-") as tmp:
        argv_mock = [sys.executable, "-m", "benchmarks.router.mock_backend", "--role", "prefill",
                     "--port", str(port)]  # fmt: skip
        mock = ManagedProcess("mock-prefill", argv_mock, log_path=Path(tmp) / "mock.log")
        try:
            wait_for_http(f"http://127.0.0.1:{port}/health", 60.0, mock)
            url = f"http://127.0.0.1:{port}/internal/prefill"
            times_s = uvloop.run(_measure(url, args.calls, args.rounds))
        finally:
            mock.stop()
    text = _report(times_s, args)
    print(text)
    if args.output:
        Path(args.output).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
