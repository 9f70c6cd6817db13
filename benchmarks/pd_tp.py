"""PD with tensor-parallel workers on the CPU: TTFT and decode tok/s at TP size 1 and 2.

    OMP_NUM_THREADS=1 python -m benchmarks.pd_tp [--lengths 512 2048] [--reps 3]

The model and worker flags of benchmarks.pd (hidden 512, 4 layers, 4 KV heads); the cluster
(1 P, 1 D, router) starts once per TP size, both roles at that size, and the same fresh
prompts go through the router one at a time, streamed. At TP size 2 every worker is two
processes exchanging two all-reduces per layer per step through gloo: on a CPU of two cores
it costs, and the table says how much. Writes its section of docs/benchmarks/pd.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

from benchmarks.machine import cpu_name
from benchmarks.pd import MAX_TOKENS, cluster_spec, make_prompt, stream_once
from benchmarks.table_file import publish_section
from pdrouter.launch.cluster import Cluster

TP_SIZES = (1, 2)


def run(lengths: list[int], reps: int, log_dir: str | None) -> dict[int, dict[int, tuple]]:
    """TP size -> prompt length -> (median TTFT s, median decode tok/s)."""
    results: dict[int, dict[int, tuple]] = {}
    for tp in TP_SIZES:
        extra = ("--tensor-parallel-size", str(tp)) if tp > 1 else ()
        spec, _ = cluster_spec(lengths, f"{log_dir}/tp{tp}" if log_dir else None, num_mixed=0,
                               extra_worker_args=extra)  # fmt: skip
        results[tp] = {}
        with Cluster(spec) as cluster:
            stream_once(cluster.router_url, make_prompt(64, salt=999))  # warm-up
            for index, length in enumerate(lengths):
                runs = [stream_once(cluster.router_url, make_prompt(length, 1 + index * reps + r))
                        for r in range(reps)]  # fmt: skip
                ttft = statistics.median(t.ttft_s for t in runs)
                tok_s = statistics.median(1 / t.tpot_s for t in runs if t.tpot_s > 0)
                results[tp][length] = (ttft, tok_s)
                print(f"tp={tp}, {length} tokens: TTFT {ttft:.3f} s, {tok_s:.1f} tok/s", flush=True)
    return results


def render(results: dict[int, dict[int, tuple]], lengths: list[int], reps: int) -> str:
    lines = [
        "## Tensor parallel: P and D of TP size 1 and 2 (CPU)",
        "",
        f"Command: `OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '?')} "
        f"python -m benchmarks.pd_tp --lengths {' '.join(map(str, lengths))} --reps {reps}`  ",
        f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}  ",
        f"Machine: {cpu_name()}, {os.cpu_count()} cores, Python {platform.python_version()}  ",
        "Setup: the model and worker flags of the first table; 1 P + 1 D + router, both "
        "workers of the row's TP size (each rank a process, gloo all-reduces), started once per "
        f"size; fresh prompts through the router, one at a time, streamed, {MAX_TOKENS} output "
        f"tokens; median of {reps}. Decode tok/s = 1 / the mean gap between text chunks.",
        "",
        "| prompt tokens | TTFT tp=1 ms | TTFT tp=2 ms | decode tok/s tp=1 | decode tok/s tp=2 |",
        "|---:|---:|---:|---:|---:|",
    ]
    for length in lengths:
        (t1, r1), (t2, r2) = results[1][length], results[2][length]
        lines.append(f"| {length} | {t1 * 1e3:.1f} | {t2 * 1e3:.1f} | {r1:.1f} | {r2:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.pd_tp", description=__doc__)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default="docs/benchmarks/pd.md")
    parser.add_argument("--log-dir", default=None)
    args = parser.parse_args(argv)
    results = run(args.lengths, args.reps, args.log_dir)
    publish_section(args.out, "pd-tp", render(results, args.lengths, args.reps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
