"""The cost of the sampling controls: decode ITL with and without them, same run.

    OMP_NUM_THREADS=1 python -m benchmarks.sampling_controls           (make bench-sampling)
    smoke: python -m benchmarks.sampling_controls --models tiny --streams 4 --max-tokens 16 \
        --repeats 1 --vocab-sizes 32000 --out /tmp/sampling.md

Part 1, the engine: for each model and stream count, all streams arrive at once and decode
--max-tokens tokens with ignore_eos under each setting of SETTINGS, one after the other on one
engine; ITL is the mean time of a pure decode step (every stream one token). Part 2, the
adjustments alone (workers.engine.penalties.adjust_logits) on random logits of real vocabulary
sizes, a batch of rows each with --history-tokens outputs and prompt tokens. Writes the
tables as the results section of docs/benchmarks/sampling_controls.md (the reading around it
stays).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

from benchmarks.table_file import section_markers, write_section
from workers.engine.api import EngineRequest, SamplingParams
from workers.engine.engine import LLMEngine
from workers.engine.engine_config import EngineConfig
from workers.engine.penalties import LogitsAdjust, adjust_logits, distinct_ids

TITLE = "Sampling controls: decode ITL with and without them (CPU)"
SECTION = "sampling-run"  # the results section of --out (the prose around it stays)
SETTINGS = {
    "greedy, no controls": {"temperature": 0.0},
    "greedy + presence, frequency, repetition": {
        "temperature": 0.0,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.5,
        "repetition_penalty": 1.2,
    },
    "seeded top_k 40, no controls": {"temperature": 0.8, "seed": 1, "top_k": 40},
    "seeded top_k 40 + penalties, logit_bias, min_p": {
        "temperature": 0.8,
        "seed": 1,
        "top_k": 40,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.5,
        "repetition_penalty": 1.2,
        "min_p": 0.05,
        "logit_bias": ((5, 1.0), (6, -1.0)),
    },
}


def decode_itl_ms(
    engine: LLMEngine, tag: str, num_streams: int, args, params
) -> tuple[float, float]:
    """Mean pure-decode step time (ms) of num_streams streams under params: wall clock, and
    this process's CPU time (what a busy shared machine does not inflate)."""
    vocab = min(engine.limits.vocab_size or 256, 256)
    for i in range(num_streams):
        prompt = tuple((7 * i + 13 * j + 1) % vocab for j in range(args.prompt_len))
        engine.add_request(EngineRequest(f"{tag}-{i}", prompt, params))
    step_s: list[float] = []
    cpu_s: list[float] = []
    while engine.has_unfinished():
        start_s, start_cpu_s = time.perf_counter(), time.process_time()
        engine.step()
        if engine.last_step_num_tokens == engine.last_step_num_chunks > 0:
            step_s.append(time.perf_counter() - start_s)
            cpu_s.append(time.process_time() - start_cpu_s)
    return 1000 * statistics.fmean(step_s), 1000 * statistics.fmean(cpu_s)


def engine_table(args: argparse.Namespace) -> list[str]:
    lines = [
        "| model | streams | setting | ITL ms (wall) | CPU ms / step | CPU vs no controls |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for model in args.models.split(","):
        for num_streams in (int(n) for n in args.streams.split(",")):
            config = EngineConfig(
                model=model,
                block_size=16,
                num_kv_blocks=args.num_kv_blocks,
                max_num_seqs=num_streams,
                max_num_batched_tokens=num_streams * args.prompt_len,
                cache_dir=args.cache_dir,
            )
            engine = LLMEngine.from_config(config)
            base = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
            itl: dict[str, tuple[float, float]] = {}
            for name, fields in SETTINGS.items():
                params = SamplingParams(**{**base.__dict__, **fields})
                runs = [
                    decode_itl_ms(engine, f"{name}-{r}", num_streams, args, params)
                    for r in range(args.repeats)
                ]
                itl[name] = (
                    statistics.median(r[0] for r in runs),
                    statistics.median(r[1] for r in runs),
                )
            names = list(SETTINGS)
            for i, name in enumerate(names):
                wall_ms, cpu_ms = itl[name]
                ratio = cpu_ms / itl[names[i - i % 2]][1]
                lines.append(
                    f"| {model} | {num_streams} | {name} | {wall_ms:.2f} | "
                    f"{cpu_ms:.2f} | {ratio:.2f}x |"
                )
            print("\n".join(lines[-len(names) :]), flush=True)
    return lines


def adjust_table(args: argparse.Namespace) -> list[str]:
    lines = [
        "| vocab | rows | history tokens (prompt + outputs) | adjust_logits CPU ms / step |",
        "|---:|---:|---:|---:|",
    ]
    rng = np.random.default_rng(0)
    for vocab in (int(v) for v in args.vocab_sizes.split(",")):
        rows = max(int(n) for n in args.streams.split(","))
        logits = rng.normal(0, 3, (rows, vocab)).astype(np.float32)
        history = args.history_tokens
        adjusts = [
            LogitsAdjust(
                0.5,
                0.5,
                1.2,
                ((5, 1.0),),
                tuple(int(t) for t in rng.integers(0, vocab, history)),
                distinct_ids(rng.integers(0, vocab, history)),  # made once per request
            )
            for _ in range(rows)
        ]
        times = []
        for _ in range(max(args.repeats, 3) * 5):
            start_s = time.process_time()
            adjust_logits(logits, adjusts)
            times.append(time.process_time() - start_s)
        ms = 1000 * statistics.median(times)
        lines.append(f"| {vocab:,} | {rows} | {history} + {history} | {ms:.2f} |")
        print(lines[-1], flush=True)
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.sampling_controls",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--models", default="tiny,tiny-large")
    p.add_argument("--streams", default="1,32", help="comma-separated stream counts")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--num-kv-blocks", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3, help="runs per point; the median is kept")
    p.add_argument("--vocab-sizes", default="32000,151936")
    p.add_argument("--history-tokens", type=int, default=1024)
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--out", default="docs/benchmarks/sampling_controls.md")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_before = os.getloadavg()[0]
    engine_lines = engine_table(args)
    adjust_lines = adjust_table(args)
    cli = " ".join(sys.argv[1:] if argv is None else argv)
    begin, end = section_markers(SECTION)
    block = "\n".join(
        [
            begin,
            f"- Command: `OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')} python -m "
            f"benchmarks.sampling_controls{' ' + cli if cli else ''}`",
            f"- Load average before {load_before:.2f}, after {os.getloadavg()[0]:.2f}; prompt "
            f"{args.prompt_len} tokens, {args.max_tokens} generated per stream, ignore_eos; each "
            f"ITL the median of {args.repeats} runs of the mean pure-decode step.",
            "- CPU ms / step: this process's CPU time per decode step (a busy shared machine "
            "inflates the wall clock, not this); `vs no controls`: over the same sampling "
            "without the controls, same run.",
            "",
            *engine_lines,
            "",
            "The adjustments alone on random logits (the engine's tiny models have small "
            "vocabularies; real ones do not): presence, frequency and repetition penalties and a "
            "logit bias on every row.",
            "",
            *adjust_lines,
            end,
        ]
    )
    # Only the results section is replaced: the reading written under it stays.
    write_section(args.out, block, begin, end, TITLE)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
