"""Skew and scale, measured: round robin vs the load-aware cache policy (a few load weights),
each on a fresh 2 P + 2 D cluster through the router (benchmarks/cache_skew/workload.py).

    OMP_NUM_THREADS=1 python -m benchmarks.cache_skew [--conversations 32 --users 8]

The model is benchmarks.pd's random Llama-style checkpoint, on which prefill compute is
visible on a CPU. Writes docs/benchmarks/cache_skew.md and cache_skew.png.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from benchmarks.cache.__main__ import BLOCK_SIZE, NUM_KV_BLOCKS, spec_of
from benchmarks.cache.workloads import no_reuse
from benchmarks.cache_skew import report, workload
from benchmarks.pd import write_checkpoint
from benchmarks.table_file import publish
from pdrouter.launch.cluster import Cluster

# case -> router flags
CASES: dict[str, tuple[str, ...]] = {
    "round_robin": ("--prefill-policy", "round_robin"),
    "least_loaded": ("--prefill-policy", "least_loaded"),
    "cache_aware@0.1": ("--prefill-policy", "cache_aware", "--cache-load-weight", "0.1"),
    "cache_aware@0.25": ("--prefill-policy", "cache_aware", "--cache-load-weight", "0.25"),
    "cache_aware@1": ("--prefill-policy", "cache_aware", "--cache-load-weight", "1"),
}


def run_case(
    model_dir: Path, router_flags: tuple[str, ...], s: workload.SkewSettings, log_dir: str | None
) -> workload.SkewResult:
    with Cluster(spec_of(model_dir, (), router_flags, log_dir)) as cluster:
        for salt in range(2):  # warm-up: one request per P (first-call costs)
            no_reuse(cluster.router_url, 1000 + salt, 1, 64)
        return workload.run(cluster.router_url, s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cache_skew", description=__doc__)
    d = workload.SkewSettings()
    for name in ("num_prompts", "conversations", "turns", "users", "prompt_chars", "seed"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name))
    parser.add_argument("--hot-share", type=float, default=d.hot_share)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--out", default="docs/benchmarks/cache_skew.md")
    parser.add_argument("--log-dir", default=None)
    args = parser.parse_args(argv)
    s = workload.SkewSettings(
        num_prompts=args.num_prompts,
        hot_share=args.hot_share,
        prompt_chars=args.prompt_chars,
        conversations=args.conversations,
        turns=args.turns,
        users=args.users,
        seed=args.seed,
    )
    cache_root = Path(os.environ.get("PDROUTER_BENCH_CACHE", Path.home() / ".cache" / "pdrouter"))
    model_dir = write_checkpoint(cache_root)
    results: dict[str, workload.SkewResult] = {}
    for case in args.cases:
        print(f"case {case}: starting a cluster", flush=True)
        results[case] = run_case(model_dir, CASES[case], s, args.log_dir)
        print(f"case {case}: {report.row(case, results[case], None)}", flush=True)
    given = " ".join(argv if argv is not None else sys.argv[1:])
    threads = os.environ.get("OMP_NUM_THREADS", "?")
    command = f"OMP_NUM_THREADS={threads} python -m benchmarks.cache_skew {given}".strip()
    settings = (
        f"Model: random Llama-style checkpoint (hidden 512, 4 layers), block size {BLOCK_SIZE}, "
        f"{NUM_KV_BLOCKS} KV blocks per worker, {s.max_tokens} output tokens, greedy. "
        f"{s.conversations} conversations x {s.turns} turns by {s.users} concurrent users; "
        f"{s.num_prompts} system prompts of {s.prompt_chars} tokens, the first in "
        f"{s.hot_share:.0%} of the conversations; {s.user_chars}-token user messages."
    )
    publish(args.out, report.render(results, command, settings))
    report.draw(results, Path(args.out).with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
