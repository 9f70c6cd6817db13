"""PD (1 prefill + 1 decode through the pool) against one mixed worker: TTFT, TPOT, handoff.

    OMP_NUM_THREADS=1 python -m benchmarks.pd [--lengths 128 512 1024 2048 4096]

One run starts one cluster (master, pool owner, 1 P, 1 D, 1 mixed, router) of a larger random
Llama-style checkpoint (hidden 512, 4 layers, 8 heads / 4 KV heads, 8192 positions) written in
the Hugging Face layout by the tiny-model machinery, so prefill compute is visible on a CPU.
For each prompt length, the same kind of prompt (fresh token ids, so no prefix is shared) goes
through the mixed worker and through the router, one request at a time, streamed with the
official openai client. The handoff split comes from the workers' /metrics histograms (their
_sum grows by exactly one request's time, as requests run one at a time). Writes the table to
docs/benchmarks/pd.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.machine import cpu_name
from benchmarks.table_file import publish
from pdrouter.launch.cluster import Cluster
from pdrouter.launch.spec import ClusterSpec

BLOCK_SIZE = 16
MAX_TOKENS = 32
SERVED_NAME = "bench-large"
HANDOFF_METRICS = {  # column -> (role, histogram)
    "P compute": ("prefill", "pdworker_prefill_compute_seconds"),
    "D2H": ("prefill", "pdworker_d2h_seconds"),
    "put": ("prefill", "pdworker_pool_put_seconds"),
    "get": ("decode", "pdworker_pool_get_seconds"),
    "H2D": ("decode", "pdworker_h2d_seconds"),
}


@dataclass(frozen=True)
class StreamTiming:
    ttft_s: float
    tpot_s: float
    num_tokens: int


def write_checkpoint(cache_root: Path) -> Path:
    """The benchmark model, materialized once (same generator as the tiny presets)."""
    from workers.engine.tiny import TinySpec, write_checkpoint

    spec = TinySpec(hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=4,
                    intermediate_size=1408, max_position_embeddings=8192)  # fmt: skip
    folder = cache_root / "bench-large-0"
    if not (folder / "config.json").exists():
        write_checkpoint(folder, spec, seed=0)
    return folder


def stream_once(base_url: str, prompt: list[int]) -> StreamTiming:
    import openai

    api = openai.OpenAI(base_url=f"{base_url}/v1", api_key="bench", max_retries=0, timeout=600)
    t0 = time.perf_counter()
    token_times: list[float] = []
    for chunk in api.completions.create(
        model=SERVED_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    ):  # fmt: skip
        if chunk.choices and chunk.choices[0].text:
            token_times.append(time.perf_counter())
    # The byte tokenizer emits one text delta per token (ASCII-range random output aside, a
    # delta can hold back a partial UTF-8 byte), so deltas approximate tokens for TPOT.
    n = len(token_times)
    tpot_s = (token_times[-1] - token_times[0]) / (n - 1) if n > 1 else 0.0
    return StreamTiming(token_times[0] - t0, tpot_s, n)


def histogram_sums(url: str) -> dict[str, float]:
    sums = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if "_seconds_sum " in line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            sums[name.removesuffix("_sum")] = float(value)
    return sums


def make_prompt(num_tokens: int, salt: int) -> list[int]:
    # Printable byte tokens; the salt makes every prompt's first block (hence all keys) unique.
    return [33 + (salt * 31 + i * 7 + (i * i) % 13) % 90 for i in range(num_tokens)]


def run(lengths: list[int], reps: int, out_path: Path, log_dir: str | None) -> str:
    cache_root = Path(os.environ.get("PDROUTER_BENCH_CACHE", Path.home() / ".cache" / "pdrouter"))
    model_dir = write_checkpoint(cache_root)
    max_len = max(lengths) + MAX_TOKENS + BLOCK_SIZE
    num_blocks = max_len // BLOCK_SIZE + 8
    spec = ClusterSpec(
        model=str(model_dir), num_prefill=1, num_decode=1, num_mixed=1, pool_size="1GiB",
        worker_args=("--served-model-name", SERVED_NAME, "--block-size", str(BLOCK_SIZE),
                     "--num-kv-blocks", str(num_blocks), "--max-model-len", str(max_len),
                     "--max-num-batched-tokens", "1024", "--staging-slots", "128",
                     "--transfer-batch-blocks", "64"),
        log_dir=log_dir, startup_timeout_s=600.0,
    )  # fmt: skip
    rows = []
    with Cluster(spec) as cluster:
        p_url, d_url = cluster.prefill_urls[0], cluster.decode_urls[0]
        for url in (cluster.mixed_urls[0], cluster.router_url):  # warm-up
            stream_once(url, make_prompt(64, salt=999))
        for length in lengths:
            mixed, pd, handoff = [], [], {k: [] for k in HANDOFF_METRICS}
            for rep in range(reps):
                mixed.append(stream_once(cluster.mixed_urls[0], make_prompt(length, 2 * rep)))
                before = {"prefill": histogram_sums(p_url), "decode": histogram_sums(d_url)}
                pd.append(stream_once(cluster.router_url, make_prompt(length, 2 * rep + 1)))
                after = {"prefill": histogram_sums(p_url), "decode": histogram_sums(d_url)}
                for column, (role, name) in HANDOFF_METRICS.items():
                    handoff[column].append(after[role][name] - before[role][name])
            rows.append((length, mixed, pd, {k: statistics.median(v) for k, v in handoff.items()}))
            ttft_mixed = statistics.median(t.ttft_s for t in mixed)
            ttft_pd = statistics.median(t.ttft_s for t in pd)
            print(f"{length} tokens: TTFT mixed {ttft_mixed:.3f} s, PD {ttft_pd:.3f} s", flush=True)
    return render(rows, reps, num_blocks)


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"


def render(rows: list, reps: int, num_blocks: int) -> str:
    kv_bytes_per_token = 4 * 2 * 4 * 64 * 4  # layers * (K, V) * kv heads * head dim * fp32
    cpu = cpu_name()
    lines = [
        "# PD (1 prefill + 1 decode via the Mooncake pool) vs one mixed worker",
        "",
        f"Command: `OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '?')} "
        f"python -m benchmarks.pd --lengths {' '.join(str(r[0]) for r in rows)} "
        f"--reps {reps}`  ",
        f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}  ",
        f"Machine: {cpu}, {os.cpu_count()} cores, Python {platform.python_version()}  ",
        "Model: random Llama-style checkpoint, hidden 512, 4 layers, 8 heads / 4 KV heads, "
        f"head dim 64, float32, block size {BLOCK_SIZE} ({num_blocks} KV blocks per worker); "
        f"{MAX_TOKENS} output tokens, greedy, one request at a time; median of {reps}. "
        "Every worker process runs with the same OMP_NUM_THREADS; pool owner on same-host "
        "shared memory.",
        "",
        "TTFT is measured by the client (request sent -> first text chunk); PD's includes P's "
        "whole handoff (compute, D2H, put), because the router sends P's first token only once "
        "P has answered. TPOT is the mean gap between text chunks after the first. The handoff "
        "columns are per request, from the workers' histograms: P compute = engine add -> "
        "first token on P; D2H/H2D = `swap_cache_layout` (CPU implementation); put/get = pool "
        "calls (exists + batch put; batch get).",
        "",
        "| prompt tokens | KV MiB | TTFT mixed ms | TTFT PD ms | TPOT mixed ms | TPOT PD ms "
        "| P compute ms | D2H ms | put ms | get ms | H2D ms |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for length, mixed, pd, handoff in rows:
        med = statistics.median
        lines.append(
            f"| {length} | {length * kv_bytes_per_token / 2**20:.1f} "
            f"| {_ms(med(t.ttft_s for t in mixed))} | {_ms(med(t.ttft_s for t in pd))} "
            f"| {_ms(med(t.tpot_s for t in mixed))} | {_ms(med(t.tpot_s for t in pd))} "
            + "".join(f"| {_ms(handoff[k])} " for k in HANDOFF_METRICS)
            + "|"
        )
    length, _, pd, handoff = rows[-1]
    move_s = sum(handoff[k] for k in ("D2H", "put", "get", "H2D"))
    pd_ttft_s = statistics.median(t.ttft_s for t in pd)
    lines += [
        "",
        f"Reading: at {length} prompt tokens the whole KV handoff (D2H + put on P before the "
        f"first token, get + H2D on D before the second) takes {_ms(move_s)} ms, "
        f"{100 * move_s / pd_ttft_s:.1f}% of PD's time to first token, which is P's prefill "
        "compute, paid by the mixed worker as well. On 2 shared CPU "
        "cores TTFT and TPOT differences of 10-30% between the two columns are within run-to-"
        "run noise (other processes share the cores); the handoff columns are stable.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.pd", description=__doc__)
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024, 2048, 4096])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default="docs/benchmarks/pd.md")
    parser.add_argument("--log-dir", default=None)
    args = parser.parse_args(argv)
    table = run(args.lengths, args.reps, Path(args.out), args.log_dir)
    publish(args.out, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
