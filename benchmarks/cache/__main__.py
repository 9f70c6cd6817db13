"""The pool as a shared prefix cache, measured: cache off / device / device+pool /
+cache-aware, each on a fresh 2 P + 2 D cluster through the router.

    OMP_NUM_THREADS=1 python -m benchmarks.cache [--conversations 4 --turns 4 --questions 6]

The model is benchmarks.pd's random Llama-style checkpoint (hidden 512, 4 layers), on which
prefill compute is visible on a CPU. Writes docs/benchmarks/cache.md and cache.png.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from benchmarks.cache import report, workloads
from benchmarks.pd import write_checkpoint
from pdrouter.launch.cluster import Cluster
from pdrouter.launch.spec import ClusterSpec

BLOCK_SIZE = 16
NUM_KV_BLOCKS = 640
CASES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {  # worker flags, router flags
    "cache off": (("--no-prefix-cache", "--no-pool-prefix-cache", "--no-decode-writeback"), ()),
    "device": (("--no-pool-prefix-cache", "--no-decode-writeback"), ()),
    "device+pool": ((), ()),
    "+cache-aware": ((), ("--prefill-policy", "cache_aware")),
}


def spec_of(model_dir: Path, worker_flags: tuple[str, ...], router_flags: tuple[str, ...],
            log_dir: str | None) -> ClusterSpec:  # fmt: skip
    return ClusterSpec(
        model=str(model_dir), num_prefill=2, num_decode=2, pool_size="1GiB",
        worker_args=("--served-model-name", workloads.MODEL, "--block-size", str(BLOCK_SIZE),
                     "--num-kv-blocks", str(NUM_KV_BLOCKS), "--max-model-len", "4096",
                     "--max-num-batched-tokens", "1024", "--staging-slots", "128",
                     "--transfer-batch-blocks", "64", *worker_flags),
        # Every prompt through P, whose prefix cache the table measures (with conditional
        # disaggregation a turn whose new part is short is prefilled on D).
        router_args=("--prefill-timeout-s", "600", "--local-prefill-below-tokens", "0",
                     *router_flags),
        log_dir=log_dir, startup_timeout_s=900.0,
    )  # fmt: skip


def run_case(spec: ClusterSpec, args: argparse.Namespace) -> dict[str, workloads.WorkloadResult]:
    with Cluster(spec) as cluster:
        url = cluster.router_url
        for salt in range(2):  # warm-up: one request per P (first-call costs)
            workloads.no_reuse(url, 1000 + salt, 1, 64)
        out = {
            "multi_turn": workloads.multi_turn(url, args.seed, args.conversations, args.turns),
            "shared_doc": workloads.shared_doc(url, args.seed, args.questions),
            "no_reuse": workloads.no_reuse(url, args.seed, args.unique, args.unique_tokens),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cache", description=__doc__)
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--questions", type=int, default=6)
    parser.add_argument("--unique", type=int, default=6)
    parser.add_argument("--unique-tokens", type=int, default=512)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--out", default="docs/benchmarks/cache.md")
    parser.add_argument("--log-dir", default=None)
    args = parser.parse_args(argv)
    cache_root = Path(os.environ.get("PDROUTER_BENCH_CACHE", Path.home() / ".cache" / "pdrouter"))
    model_dir = write_checkpoint(cache_root)
    results: report.Results = {}
    for case in args.cases:
        worker_flags, router_flags = CASES[case]
        print(f"case {case}: starting a cluster", flush=True)
        results[case] = run_case(spec_of(model_dir, worker_flags, router_flags, args.log_dir), args)
        mt = results[case]["multi_turn"].samples
        print(f"case {case}: multi-turn TTFT {[round(s.ttft_s, 3) for s in mt]}", flush=True)
    given = " ".join(argv if argv is not None else sys.argv[1:])
    threads = os.environ.get("OMP_NUM_THREADS", "?")
    command = f"OMP_NUM_THREADS={threads} python -m benchmarks.cache {given}".strip()
    settings = (
        f"Model: random Llama-style checkpoint (hidden 512, 4 layers, 8 heads / 4 KV heads, "
        f"float32), block size {BLOCK_SIZE}, {NUM_KV_BLOCKS} KV blocks per worker, "
        f"{workloads.MAX_TOKENS} output tokens, greedy, one request at a time. Multi-turn: "
        f"{args.conversations} conversations x {args.turns} turns, ~1,000-token system prompt, "
        f"40-token user messages; shared document: {args.questions} questions; no reuse: "
        f"{args.unique} prompts of {args.unique_tokens} tokens. P's pool reads: "
        "`--pool-prefix-min-tokens 32 --pool-load-timeout-s 2` (the defaults)."
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report.render(results, command, settings))
    report.draw(results, out.with_suffix(".png"))
    print(out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
