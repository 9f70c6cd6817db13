"""Eviction pressure: a working set of prefixes 1.5x P's device cache, revisited; device only /
device+pool / device+host+pool under each write policy, each on a fresh 1 P + 1 D cluster.

    OMP_NUM_THREADS=1 python -m benchmarks.cache.eviction [--kv-blocks 128 --prefixes 6
        --rounds 3 --visits 3]

A round visits every prefix in turn, `visits` requests each (prefix + a unique question of
`--question-tokens`): the first of a visit misses P's device cache from round 2 on (the
prefixes cycle through 1.5x its room, least recently used first: the worst case for LRU), the
others hit it. "Revisits" are those first requests of rounds 2+: where the host tier and the
pool differ. Tokens by source and host-tier traffic come from the workers' /metrics. Writes
docs/benchmarks/cache_eviction.md. The model is benchmarks.pd's checkpoint (hidden 512, 4
layers; 128 KiB of KV per 16-token block).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.cache.eviction_report import render
from benchmarks.cache.workloads import MODEL, completions, text
from benchmarks.pd import write_checkpoint
from pdrouter.launch.cluster import Cluster
from pdrouter.launch.spec import ClusterSpec

BLOCK_SIZE = 16
POOL_OFF = ("--no-pool-prefix-cache", "--no-decode-writeback")
CASES: dict[str, tuple[str, ...]] = {
    "device": POOL_OFF,
    "device+pool": (),
    "+host write_through": ("--write-policy", "write_through"),
    "+host write_through_selective": ("--write-policy", "write_through_selective"),
    "+host write_back": ("--write-policy", "write_back"),
}
SOURCES = ("device", "host", "pool", "computed")


@dataclass
class CaseResult:
    """One case: TTFT of every request and of the revisits, P's tokens by source, host
    traffic summed over P and D."""

    ttft_s: list[float] = field(default_factory=list)
    revisit_ttft_s: list[float] = field(default_factory=list)
    by_source: dict[str, float] = field(default_factory=dict)
    host: dict[str, float] = field(default_factory=dict)


def spec_of(model_dir: Path, args: argparse.Namespace, case_flags: tuple[str, ...],
            host_gib: float) -> ClusterSpec:  # fmt: skip
    host = ("--swap-space", str(host_gib)) if "--write-policy" in case_flags else ()
    max_len = args.kv_blocks * BLOCK_SIZE
    return ClusterSpec(
        model=str(model_dir), num_prefill=1, num_decode=1, pool_size="1GiB",
        worker_args=("--served-model-name", MODEL, "--block-size", str(BLOCK_SIZE),
                     "--num-kv-blocks", str(args.kv_blocks), "--max-model-len", str(max_len),
                     "--max-num-batched-tokens", "1024", "--staging-slots", "128",
                     "--transfer-batch-blocks", "64", *case_flags, *host),
        router_args=("--prefill-timeout-s", "600", "--local-prefill-below-tokens", "0"),
        log_dir=args.log_dir, startup_timeout_s=900.0,
    )  # fmt: skip


def prompts_of(args: argparse.Namespace) -> list[tuple[bool, str]]:
    """(is a revisit, prompt) in the order sent; the same for every case."""
    rng = random.Random(args.seed)
    prefix_tokens = args.kv_blocks * 3 // 2 // args.prefixes * BLOCK_SIZE
    prefixes = [text(prefix_tokens, rng) for _ in range(args.prefixes)]
    out = []
    for round_index in range(args.rounds):
        for prefix in prefixes:
            for visit in range(args.visits):
                question = text(args.question_tokens, rng)
                out.append((round_index > 0 and visit == 0, f"{prefix}{question}"))
    return out


def _scrape(urls: list[str]) -> dict[str, float]:
    """Every sample of the workers' /metrics, as 'name{label="v"}', summed over urls."""
    total: dict[str, float] = {}
    for url in urls:
        body = httpx.get(f"{url}/metrics", timeout=30).text
        for family in text_string_to_metric_families(body):
            for s in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                name = f"{s.name}{{{labels}}}" if labels else s.name
                total[name] = total.get(name, 0.0) + s.value
    return total


def run_case(spec: ClusterSpec, prompts: list[tuple[bool, str]]) -> CaseResult:
    with Cluster(spec) as cluster:
        url = cluster.router_url
        completions(url, [text(64, random.Random(99))])  # warm-up (first-call costs)
        before = _scrape(cluster.prefill_urls)
        samples = completions(url, [p for _, p in prompts])
        after = _scrape(cluster.prefill_urls)
        host = _scrape(cluster.prefill_urls + cluster.decode_urls)
    result = CaseResult(ttft_s=[s.ttft_s for s in samples])
    result.revisit_ttft_s = [s.ttft_s for s, (rev, _) in zip(samples, prompts, strict=True) if rev]
    key = 'pdworker_prompt_tokens_by_source_total{{source="{}"}}'
    result.by_source = {s: after.get(key.format(s), 0) - before.get(key.format(s), 0)
                        for s in SOURCES}  # fmt: skip
    copies = [v for k, v in host.items() if k.startswith("pdworker_host_tier_copy_bytes_total")]
    result.host = {"copy_bytes": sum(copies),
                   "read_bytes": host.get("pdworker_host_tier_read_bytes_total", 0.0),
                   "evictions": host.get("pdworker_host_tier_evictions_total", 0.0)}  # fmt: skip
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cache.eviction",
                                     description=__doc__)  # fmt: skip
    parser.add_argument("--kv-blocks", type=int, default=128, help="P's and D's device cache")
    parser.add_argument("--prefixes", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--visits", type=int, default=3, help="requests per prefix per round")
    parser.add_argument("--question-tokens", type=int, default=64)
    parser.add_argument("--swap-space", type=float, default=0.05, help="GiB of host tier")
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--out", default="docs/benchmarks/cache_eviction.md")
    parser.add_argument("--log-dir", default=None)
    args = parser.parse_args(argv)
    cache_root = Path(os.environ.get("PDROUTER_BENCH_CACHE", Path.home() / ".cache" / "pdrouter"))
    model_dir = write_checkpoint(cache_root)
    prompts = prompts_of(args)
    results: dict[str, CaseResult] = {}
    for case in args.cases:
        print(f"case {case}: starting a cluster", flush=True)
        spec = spec_of(model_dir, args, CASES[case], args.swap_space)
        results[case] = run_case(spec, prompts)
    given = " ".join(argv if argv is not None else sys.argv[1:])
    threads = os.environ.get("OMP_NUM_THREADS", "?")
    command = f"OMP_NUM_THREADS={threads} python -m benchmarks.cache.eviction {given}".strip()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(results, command, args))
    print(out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
