"""Decode throughput of the engine on CPU: tokens/s at 1, 8 and 32 concurrent streams.

    OMP_NUM_THREADS=1 python -m benchmarks.engine            (make bench-engine)

For each model (the tiny preset and the larger "tiny-large" preset) and each stream count,
all streams arrive at once with a prompt of --prompt-len tokens and decode --max-tokens
tokens greedily with ignore_eos. Decode tokens/s counts only pure decode steps (every chunk
one token), timed around engine.step(); "end to end" counts every generated token over the
whole run, prefill included. Writes the table to docs/benchmarks/engine.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.machine import cpu_name
from workers.engine.api import EngineRequest, SamplingParams
from workers.engine.engine import LLMEngine
from workers.engine.engine_config import EngineConfig


@dataclass(frozen=True)
class BenchResult:
    model: str
    num_streams: int
    decode_tokens: int
    decode_time_s: float
    generated_tokens: int
    wall_time_s: float

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_time_s

    @property
    def e2e_tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_time_s


def run_streams(
    engine: LLMEngine, model: str, num_streams: int, prompt_len: int, max_tokens: int
) -> BenchResult:
    """Run num_streams identical-length requests to completion and time the steps."""
    vocab = engine.limits.vocab_size or 256
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(num_streams):
        # Distinct prompts, so no two streams are the same computation.
        prompt = tuple((7 * i + 13 * j + 1) % min(vocab, 256) for j in range(prompt_len))
        engine.add_request(EngineRequest(f"bench-{model}-{num_streams}-{i}", prompt, params))
    decode_tokens = generated_tokens = 0
    decode_time_s = 0.0
    start_s = time.perf_counter()
    while engine.has_unfinished():
        step_start_s = time.perf_counter()
        outputs = engine.step()
        step_s = time.perf_counter() - step_start_s
        generated_tokens += sum(len(o.new_token_ids) for o in outputs)
        if engine.last_step_num_tokens == 0:
            raise RuntimeError("benchmark engine blocked: raise --num-kv-blocks")
        if engine.last_step_num_tokens == engine.last_step_num_chunks:
            decode_tokens += engine.last_step_num_tokens
            decode_time_s += step_s
    wall_time_s = time.perf_counter() - start_s
    return BenchResult(
        model, num_streams, decode_tokens, decode_time_s, generated_tokens, wall_time_s
    )


def cpu_description() -> str:
    model_name = cpu_name()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{model_name}, {usable} usable cores (os.cpu_count() = {os.cpu_count()})"


def render(results: list[BenchResult], args: argparse.Namespace, command: str) -> str:
    lines = [
        "# Engine decode throughput (CPU)",
        "",
        f"- Command: `{command}`",
        f"- Machine: {cpu_description()}; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}; "
        f"load average before the run {args.load_before:.2f}, after {os.getloadavg()[0]:.2f} "
        "(other processes on the machine share its cores)",
        f"- Workload: prompt {args.prompt_len} tokens, {args.max_tokens} generated tokens per "
        "stream, greedy, ignore_eos, all streams arriving at once; float32, block size "
        f"{args.block_size}. Each point is the median of {args.repeats} runs.",
        "- Decode tokens/s: tokens of pure decode steps / time in those steps. End to end: all "
        "generated tokens / wall time, prefill included.",
        "",
        "| model | streams | decode tokens/s | vs 1 stream | end-to-end tokens/s | wall s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    single = {r.model: r.decode_tokens_per_s for r in results if r.num_streams == 1}
    for r in results:
        ratio = r.decode_tokens_per_s / single[r.model] if r.model in single else float("nan")
        lines.append(
            f"| {r.model} | {r.num_streams} | {r.decode_tokens_per_s:,.0f} | {ratio:.1f}x | "
            f"{r.e2e_tokens_per_s:,.0f} | {r.wall_time_s:.2f} |"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.engine",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--models", default="tiny,tiny-large", help="comma-separated models")
    p.add_argument("--streams", default="1,8,32", help="comma-separated stream counts")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per stream")
    p.add_argument("--max-tokens", type=int, default=64, help="generated tokens per stream")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5, help="runs per point; the median is kept")
    p.add_argument("--cache-dir", default=None, help="where tiny checkpoints are materialized")
    p.add_argument("--out", default="docs/benchmarks/engine.md", help="markdown file to write")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.load_before = os.getloadavg()[0]
    stream_counts = [int(n) for n in args.streams.split(",")]
    results = []
    for model in args.models.split(","):
        config = EngineConfig(
            model=model,
            block_size=args.block_size,
            num_kv_blocks=args.num_kv_blocks,
            max_num_seqs=max(stream_counts),
            max_num_batched_tokens=max(stream_counts) * args.prompt_len,
            cache_dir=args.cache_dir,
        )
        engine = LLMEngine.from_config(config)
        run_streams(engine, model, 2, args.prompt_len, 4)  # warm-up: first-call overheads
        for num_streams in stream_counts:
            # The machine may be shared: keep the median run by decode rate.
            runs = sorted(
                (
                    run_streams(engine, model, num_streams, args.prompt_len, args.max_tokens)
                    for _ in range(args.repeats)
                ),
                key=lambda r: r.decode_tokens_per_s,
            )
            result = runs[len(runs) // 2]
            results.append(result)
            print(
                f"{model:>12} streams={num_streams:>3} decode {result.decode_tokens_per_s:8.0f} "
                f"tok/s  e2e {result.e2e_tokens_per_s:8.0f} tok/s  wall {result.wall_time_s:.2f} s",
                flush=True,
            )
    cli_args = sys.argv[1:] if argv is None else argv
    omp = f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}"
    command = " ".join([omp, "python -m benchmarks.engine", *cli_args])
    text = render(results, args, command)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
