"""Serving benchmark of one mixed worker over HTTP: the engine's decode rate as a client sees it.

    .venv/bin/python -m benchmarks.server                       # starts its own tiny worker
    .venv/bin/python -m benchmarks.server --url http://127.0.0.1:8100/v1 --model NAME

For each concurrency level, that many streaming completions (greedy, ignore_eos, a fixed
number of tokens each) run at once through the official async openai client; it reports the
aggregate token rate, the time to first token and the mean gap between tokens per stream.
Compare with `python -m benchmarks.engine` (the engine alone) to see what HTTP, SSE and
the asyncio hop cost.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class StreamResult:
    num_tokens: int
    ttft_s: float
    tpot_s: float


@dataclass(frozen=True)
class LevelResult:
    num_streams: int
    num_tokens: int
    wall_s: float
    ttft_p50_s: float
    ttft_max_s: float
    tpot_mean_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.wall_s


async def _one_stream(client: object, model: str, index: int, max_tokens: int) -> StreamResult:
    start = time.perf_counter()
    first = last = None
    num_tokens = 0
    stream = await client.completions.create(  # type: ignore[attr-defined]
        model=model, prompt=f"benchmark stream {index}:", max_tokens=max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.choices and chunk.choices[0].text:
            first = first or now
            last = now
        if chunk.usage is not None:
            num_tokens = chunk.usage.completion_tokens
    assert first is not None and last is not None, "the stream produced no text"
    tpot_s = (last - first) / max(num_tokens - 1, 1)
    return StreamResult(num_tokens, first - start, tpot_s)


async def run_levels(
    base_url: str, model: str, levels: list[int], max_tokens: int
) -> list[LevelResult]:
    import openai

    results = []
    async with openai.AsyncOpenAI(
        base_url=base_url, api_key="unused", max_retries=0, timeout=600
    ) as client:
        await _one_stream(client, model, -1, 4)  # warm-up
        for num_streams in levels:
            start = time.perf_counter()
            streams = await asyncio.gather(
                *(_one_stream(client, model, i, max_tokens) for i in range(num_streams))
            )
            wall_s = time.perf_counter() - start
            ttfts = [s.ttft_s for s in streams]
            results.append(
                LevelResult(
                    num_streams=num_streams,
                    num_tokens=sum(s.num_tokens for s in streams),
                    wall_s=wall_s,
                    ttft_p50_s=statistics.median(ttfts),
                    ttft_max_s=max(ttfts),
                    tpot_mean_s=statistics.fmean(s.tpot_s for s in streams),
                )
            )
    return results


def format_table(results: list[LevelResult]) -> str:
    lines = [
        "| streams | tokens | wall s | tokens/s | TTFT p50 ms | TTFT max ms | TPOT ms |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r.num_streams} | {r.num_tokens} | {r.wall_s:.2f} | {r.tokens_per_s:.0f} | "
            f"{r.ttft_p50_s * 1e3:.0f} | {r.ttft_max_s * 1e3:.0f} | {r.tpot_mean_s * 1e3:.1f} |"
        )
    return "\n".join(lines)


def _start_worker(model: str, cache_dir: str, log_path: Path) -> tuple[object, str]:
    from pdrouter.common.proc import ManagedProcess, find_free_port, wait_for_http

    port = find_free_port()
    argv = [
        sys.executable,
        "-m",
        "workers.cli",
        "serve",
        "--role",
        "mixed",
        "--model",
        model,
        "--port",
        str(port),
        "--model-cache-dir",
        cache_dir,
        "--log-level",
        "warning",
    ]
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = ManagedProcess("bench-worker", argv, env=env, log_path=log_path)
    try:
        wait_for_http(f"http://127.0.0.1:{port}/health", 300, proc)
    except BaseException:
        proc.stop()
        raise
    return proc, f"http://127.0.0.1:{port}/v1"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="an already running worker's /v1 URL (default: start one)")
    parser.add_argument("--model", default="tiny", help="model to start / name to send")
    parser.add_argument("--levels", default="1,8,32", help="concurrent streams, comma-separated")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per stream")
    args = parser.parse_args(argv)
    levels = [int(v) for v in args.levels.split(",")]
    proc = None
    with tempfile.TemporaryDirectory(prefix="pdrouter-bench-") as tmp:
        url = args.url
        if url is None:
            proc, url = _start_worker(args.model, tmp, Path(tmp) / "worker.log")
        try:
            results = asyncio.run(run_levels(url, args.model, levels, args.max_tokens))
        finally:
            if proc is not None:
                proc.stop()  # type: ignore[attr-defined]
    print(f"mixed worker {url}, model {args.model}, {args.max_tokens} tokens per stream")
    print(format_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
