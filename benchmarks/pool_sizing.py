"""How large the pool must be: D's handoff hit rate against pool size, under concurrency.

    OMP_NUM_THREADS=1 python -m benchmarks.pool_sizing [--sizes 16MiB 32MiB 64MiB 128MiB]

For each pool size, one `pdrouter launch`-style cluster (1 P, 1 D, one pool owner of that size)
of benchmarks/pd.py's model (8 KiB of KV per token) takes waves of concurrent requests with
fresh prompts (no shared prefix). D's counters say how many handoff blocks it found in the
pool and how many were gone (evicted before D read them: D recomputes those); the in-flight
KV is concurrency x prompt KV. Writes docs/benchmarks/pool_sizing.md, which docs/deploy.md's
sizing section cites.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.machine import cpu_name
from benchmarks.pd import BLOCK_SIZE, SERVED_NAME, make_prompt, write_checkpoint
from benchmarks.table_file import publish
from pdrouter.launch.cluster import Cluster
from pdrouter.launch.spec import ClusterSpec
from workers.pool.owner_process import parse_size_bytes

KV_BYTES_PER_TOKEN = 4 * 2 * 4 * 64 * 4  # layers * (K, V) * kv heads * head dim * fp32
D_COUNTERS = ("pdworker_pool_blocks_loaded_total", "pdworker_pool_blocks_missing_total")


async def wave(router_url: str, prompts: list[list[int]]) -> None:
    import openai

    api = openai.AsyncOpenAI(base_url=f"{router_url}/v1", api_key="bench", max_retries=0,
                             timeout=600)  # fmt: skip
    async with api:  # closed inside this loop (asyncio.run closes the loop after)
        await asyncio.gather(*(api.completions.create(model=SERVED_NAME, prompt=p,
                                                      max_tokens=4, temperature=0)
                               for p in prompts))  # fmt: skip


def d_counters(url: str) -> dict[str, float]:
    import httpx

    values = dict.fromkeys(D_COUNTERS, 0.0)
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        name, _, value = line.partition(" ")
        if name in values:
            values[name] = float(value)
    return values


def measure(size: str, model_dir: Path, concurrency: int, waves: int, prompt_tokens: int,
            log_dir: str) -> tuple[float, float]:  # fmt: skip
    """(blocks loaded, blocks missing) on D over every wave."""
    spec = ClusterSpec(model=str(model_dir), pool_size=size, log_dir=log_dir,
                       worker_args=("--served-model-name", SERVED_NAME, "--block-size",
                                    str(BLOCK_SIZE), "--num-kv-blocks", "600",
                                    "--max-model-len", "1024", "--max-num-seqs",
                                    str(concurrency), "--staging-slots", "128",
                                    "--transfer-batch-blocks", "32"),
                       # every prompt through P: the table is D's handoff hit rate
                       router_args=("--local-prefill-below-tokens", "0"),
                       startup_timeout_s=600.0)  # fmt: skip
    with Cluster(spec) as cluster:
        d_url = cluster.decode_urls[0]
        before = d_counters(d_url)
        for w in range(waves):
            salt0 = 10_000 * (w + 1) + parse_size_bytes(size) // 2**20
            prompts = [make_prompt(prompt_tokens, salt0 + i) for i in range(concurrency)]
            asyncio.run(wave(cluster.router_url, prompts))
        after = d_counters(d_url)
    loaded, missing = (after[k] - before[k] for k in D_COUNTERS)
    print(f"{size}: {loaded:.0f} blocks loaded, {missing:.0f} missing", flush=True)
    return loaded, missing


def render(rows: list[tuple[str, float, float]], concurrency: int, waves: int,
           prompt_tokens: int) -> str:  # fmt: skip
    in_flight = concurrency * prompt_tokens * KV_BYTES_PER_TOKEN
    cpu = cpu_name(platform.machine())
    lines = [
        "# Pool size against D's handoff hit rate",
        "",
        f"Command: `OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '?')} python -m "
        f"benchmarks.pool_sizing --sizes {' '.join(r[0] for r in rows)} --concurrency "
        f"{concurrency} --waves {waves} --prompt-tokens {prompt_tokens}`  ",
        f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}  ",
        f"Machine: {cpu}, {os.cpu_count()} cores, Python {platform.python_version()}  ",
        f"Workload: benchmarks/pd.py's model ({KV_BYTES_PER_TOKEN // 1024} KiB of KV per "
        f"token, block size {BLOCK_SIZE}: {BLOCK_SIZE * KV_BYTES_PER_TOKEN // 1024} KiB "
        f"objects); {waves} waves of {concurrency} concurrent requests with fresh "
        f"{prompt_tokens}-token prompts, 4 output tokens; 1 P, 1 D, one pool owner (shared "
        f"memory). KV in flight per wave: {in_flight / 2**20:.0f} MiB.",
        "",
        "Hit rate = blocks D loaded / blocks D asked for (the rest were evicted between P's "
        "put and D's get, and D recomputed them).",
        "",
        "| pool size | pool / KV in flight | blocks loaded | blocks missing | D hit rate |",
        "|---:|---:|---:|---:|---:|",
    ]
    for size, loaded, missing in rows:
        ratio = parse_size_bytes(size) / in_flight
        rate = loaded / (loaded + missing) if loaded + missing else 0.0
        lines.append(f"| {size} | {ratio:.2f} | {loaded:.0f} | {missing:.0f} | {rate:.0%} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.pool_sizing",
                                     description=__doc__.split("\n\n")[0])  # fmt: skip
    parser.add_argument("--sizes", nargs="+", default=["16MiB", "32MiB", "64MiB", "128MiB"])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--waves", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=392)
    parser.add_argument("--out", default="docs/benchmarks/pool_sizing.md")
    args = parser.parse_args(argv)
    cache_root = Path(os.environ.get("PDROUTER_BENCH_CACHE", Path.home() / ".cache" / "pdrouter"))
    model_dir = write_checkpoint(cache_root)
    log_dir = tempfile.mkdtemp(prefix="pool-sizing-")
    rows = []
    for size in args.sizes:
        loaded, missing = measure(size, model_dir, args.concurrency, args.waves,
                                  args.prompt_tokens, f"{log_dir}/{size}")  # fmt: skip
        rows.append((size, loaded, missing))
    table = render(rows, args.concurrency, args.waves, args.prompt_tokens)
    publish(args.out, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
