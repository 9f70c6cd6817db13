"""Where a pool hit starts to pay: TTFT of a prompt whose first k blocks P reads from the pool
against the same-length prompt computed cold, and P's own pool load time, for growing k.

    OMP_NUM_THREADS=1 python -m benchmarks.cache.defaults [--blocks 1 2 4 8 32 128]

One cluster (2 P + 2 D, router round robin), `--pool-prefix-min-tokens 0` so that every hit is
loaded. Per k and repetition, three requests in a row alternate between the two Ps: a warm-up
that computes the k-block prefix (and writes it to the pool), the measured hit (the other P:
its device cache never saw the prefix, so the hit is the pool's), and a cold prompt of the
same length with no shared prefix. Writes docs/benchmarks/cache_defaults.md.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
from pathlib import Path

import httpx

from benchmarks.cache import workloads
from benchmarks.cache.__main__ import spec_of
from benchmarks.machine import cpu_name
from benchmarks.pd import write_checkpoint
from pdrouter.launch.cluster import Cluster

TAIL_TOKENS = 16
LOAD = "pdworker_pool_prefix_load_seconds"


def _load_totals(urls: list[str]) -> tuple[float, float]:
    """(seconds, loads) summed over the Ps' pool prefix load histograms."""
    total_s = count = 0.0
    for url in urls:
        for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
            if line.startswith(LOAD + "_sum "):
                total_s += float(line.split()[-1])
            elif line.startswith(LOAD + "_count "):
                count += float(line.split()[-1])
    return total_s, count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.cache.defaults", description=__doc__
    )
    parser.add_argument("--blocks", type=int, nargs="+", default=[1, 2, 4, 8, 32, 128])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default="docs/benchmarks/cache_defaults.md")
    args = parser.parse_args(argv)
    cache_root = Path(os.environ.get("PDROUTER_BENCH_CACHE", Path.home() / ".cache" / "pdrouter"))
    spec = spec_of(write_checkpoint(cache_root), ("--pool-prefix-min-tokens", "0"), (), None)
    rng = random.Random(11)
    rows = []
    with Cluster(spec) as cluster:
        url = cluster.router_url
        workloads.no_reuse(url, 2000, 2, 64)  # warm-up, one per P
        for k in args.blocks:
            hit_s, cold_s, load_s = [], [], []
            for _ in range(args.reps):
                prefix = workloads.text(k * 16, rng)
                workloads.completions(url, [prefix + workloads.text(TAIL_TOKENS, rng)])
                before = _load_totals(cluster.prefill_urls)
                hit = workloads.completions(url, [prefix + workloads.text(TAIL_TOKENS, rng)])[0]
                after = _load_totals(cluster.prefill_urls)
                assert hit.cached_tokens == k * 16, f"{k} blocks: cached {hit.cached_tokens}"
                cold = workloads.completions(url, [workloads.text(k * 16 + TAIL_TOKENS, rng)])[0]
                hit_s.append(hit.ttft_s)
                cold_s.append(cold.ttft_s)
                load_s.append((after[0] - before[0]) / max(1.0, after[1] - before[1]))
            rows.append((k, statistics.median(hit_s), statistics.median(cold_s),
                         statistics.median(load_s)))  # fmt: skip
            print(f"{k} blocks: hit {rows[-1][1]:.3f} s, cold {rows[-1][2]:.3f} s", flush=True)
    lines = [
        "# Pool prefix defaults: where a pool hit starts to pay",
        "",
        f"Command: `OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '?')} python -m "
        f"benchmarks.cache.defaults --blocks {' '.join(map(str, args.blocks))} "
        f"--reps {args.reps}`  ",
        f"Machine: {cpu_name()}, {os.cpu_count()} cores, **shared with other jobs** (noisy).  ",
        "Model and cluster: as `docs/benchmarks/cache.md` (2 P + 2 D, block size 16), with "
        f"`--pool-prefix-min-tokens 0`. Prompt = k-block prefix + {TAIL_TOKENS} fresh tokens; "
        "the hit is read from the pool by the P that never saw the prefix; cold = a prompt of "
        f"the same length sharing nothing. TTFT by the openai client, median of {args.reps}; "
        "P load = get + host -> device on P (`pdworker_pool_prefix_load_seconds`).",
        "",
        "| hit blocks | hit tokens | TTFT hit ms | TTFT cold ms | hit / cold | P load ms |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for k, hit, cold, load in rows:
        lines.append(f"| {k} | {16 * k} | {1000 * hit:.0f} | {1000 * cold:.0f} "
                     f"| {hit / cold:.2f} | {1000 * load:.1f} |")  # fmt: skip
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
