"""PD (1 prefill + 1 decode through the pool) against one mixed worker: TTFT, TPOT, handoff.

    OMP_NUM_THREADS=1 python -m benchmarks.pd [--lengths 128 512 1024 2048 4096]
    OMP_NUM_THREADS=1 python -m benchmarks.pd --overlap-compare [--overlap-lengths 4096]

One run starts one cluster (master, pool owner, 1 P, 1 D, 1 mixed, router) of a larger random
Llama-style checkpoint (hidden 512, 4 layers, 8 heads / 4 KV heads, 8192 positions) written in
the Hugging Face layout by the tiny-model machinery, so prefill compute is visible on a CPU.
For each prompt length, the same kind of prompt (fresh token ids, so no prefix is shared) goes
through the mixed worker and through the router, one request at a time, streamed with the
official openai client. The handoff split comes from the workers' /metrics histograms (their
_sum grows by exactly one request's time, as requests run one at a time). Writes the table to
its section of docs/benchmarks/pd.md.

--overlap-compare measures P's write while computing instead: the cluster (no mixed worker)
starts twice, with the default workers and with --no-write-while-computing, and the same
fresh prompts go through the router; its table is the file's second section.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.machine import cpu_name
from benchmarks.table_file import publish_section
from pdrouter.launch.cluster import Cluster
from pdrouter.launch.spec import ClusterSpec

BLOCK_SIZE = 16
CHUNK_TOKENS = 1024  # --max-num-batched-tokens: P prefills a long prompt in chunks of this
MAX_TOKENS = 32
SERVED_NAME = "bench-large"
HANDOFF_METRICS = {  # column -> (role, histogram)
    "P compute": ("prefill", "pdworker_prefill_compute_seconds"),
    "D2H": ("prefill", "pdworker_d2h_seconds"),
    "put": ("prefill", "pdworker_pool_put_seconds"),
    "get": ("decode", "pdworker_pool_get_seconds"),
    "H2D": ("decode", "pdworker_h2d_seconds"),
}
OVERLAP_METRICS = {  # column -> P's sample (a histogram's _sum, a counter), grown per request
    "P compute": "pdworker_prefill_compute_seconds_sum",
    "D2H": "pdworker_d2h_seconds_sum",
    "put": "pdworker_pool_put_seconds_sum",
    "write wait": "pdworker_pool_write_wait_seconds_sum",
    "blocks early": "pdworker_pool_blocks_written_early_total",
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


def metric_samples(url: str) -> dict[str, float]:
    """The samples without labels of url/metrics (open: the benchmark sets no API key)."""
    samples = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def histogram_sums(url: str) -> dict[str, float]:
    return {
        name.removesuffix("_sum"): value
        for name, value in metric_samples(url).items()
        if name.endswith("_seconds_sum")
    }


def make_prompt(num_tokens: int, salt: int) -> list[int]:
    # Printable byte tokens; the salt makes every prompt's first block (hence all keys) unique.
    return [33 + (salt * 31 + i * 7 + (i * i) % 13) % 90 for i in range(num_tokens)]


def cluster_spec(lengths: list[int], log_dir: str | None, num_mixed: int = 1,
                 extra_worker_args: tuple[str, ...] = ()) -> tuple[ClusterSpec, int]:  # fmt: skip
    """1 P, 1 D (and num_mixed mixed workers) of the benchmark model, KV for the longest
    prompt; with the number of KV blocks per worker."""
    cache_root = Path(os.environ.get("PDROUTER_BENCH_CACHE", Path.home() / ".cache" / "pdrouter"))
    model_dir = write_checkpoint(cache_root)
    max_len = max(lengths) + MAX_TOKENS + BLOCK_SIZE
    num_blocks = max_len // BLOCK_SIZE + 8
    spec = ClusterSpec(
        model=str(model_dir), num_prefill=1, num_decode=1, num_mixed=num_mixed, pool_size="1GiB",
        worker_args=("--served-model-name", SERVED_NAME, "--block-size", str(BLOCK_SIZE),
                     "--num-kv-blocks", str(num_blocks), "--max-model-len", str(max_len),
                     "--max-num-batched-tokens", str(CHUNK_TOKENS), "--staging-slots", "128",
                     "--transfer-batch-blocks", "64", *extra_worker_args),
        log_dir=log_dir, startup_timeout_s=600.0,
    )  # fmt: skip
    return spec, num_blocks


def run(lengths: list[int], reps: int, log_dir: str | None) -> str:
    spec, num_blocks = cluster_spec(lengths, log_dir)
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


OVERLAP_MODES = {"on": (), "off": ("--no-write-while-computing",)}  # mode -> extra worker args


def run_overlap(lengths: list[int], reps: int, log_dir: str | None) -> str:
    """Per mode and length: median TTFT through the router and P's per-request samples."""
    results: dict[str, dict[int, dict[str, float]]] = {}
    for mode, extra in OVERLAP_MODES.items():
        mode_log_dir = f"{log_dir}/overlap-{mode}" if log_dir else None
        spec, _ = cluster_spec(lengths, mode_log_dir, num_mixed=0, extra_worker_args=extra)
        results[mode] = {}
        with Cluster(spec) as cluster:
            p_url = cluster.prefill_urls[0]
            stream_once(cluster.router_url, make_prompt(CHUNK_TOKENS + 64, salt=0))  # warm-up
            for index, length in enumerate(lengths):
                ttft, per_request = [], {k: [] for k in OVERLAP_METRICS}
                for rep in range(reps):
                    # Both modes get the same prompts; salts differ mod 90, so no shared prefix.
                    prompt = make_prompt(length, salt=1 + index * reps + rep)
                    before = metric_samples(p_url)
                    ttft.append(stream_once(cluster.router_url, prompt).ttft_s)
                    after = metric_samples(p_url)
                    for column, name in OVERLAP_METRICS.items():
                        per_request[column].append(after[name] - before[name])
                row = {k: statistics.median(v) for k, v in per_request.items()}
                row["TTFT"] = statistics.median(ttft)
                results[mode][length] = row
                print(f"overlap {mode}, {length} tokens: {row}", flush=True)
    return render_overlap(results, lengths, reps)


def render_overlap(results: dict[str, dict[int, dict[str, float]]], lengths: list[int],
                   reps: int) -> str:  # fmt: skip
    on, off = results["on"], results["off"]

    def pair(length: int, value: Callable[[dict[str, float]], str]) -> str:
        return f"| {value(on[length])} | {value(off[length])} "

    lines = [
        "## Write while computing: P's TTFT with and without the overlap",
        "",
        f"Command: `OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '?')} "
        f"python -m benchmarks.pd --overlap-compare --overlap-lengths "
        f"{' '.join(map(str, lengths))} --reps {reps}`  ",
        f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}  ",
        f"Machine: {cpu_name()}, {os.cpu_count()} cores, Python {platform.python_version()}  ",
        "Setup: the model and worker flags of the table above, 1 P + 1 D + router (no mixed "
        "worker), started twice in one run: default workers (on: the KV blocks of each "
        f"finished {CHUNK_TOKENS}-token prefill chunk, `--max-num-batched-tokens`, are written "
        "to the pool while the next chunk computes) and workers with "
        "`--no-write-while-computing` (off: every block is written after the whole prefill). "
        f"The same fresh prompts (no shared prefix) through the router in both, one at a time, "
        f"streamed; median of {reps}.",
        "",
        "TTFT PD is measured by the client. From P's /metrics, per request: P compute = engine "
        "add -> first token; D2H + put = all of the request's copies and pool puts, wherever "
        "they ran; write waited = the part of them P waited for after its first token (the "
        "exposed write time, which TTFT PD contains); blocks early = blocks whose write "
        "started before the first token. off - on: the TTFT the overlap saved.",
        "",
        "| prompt tokens | blocks | TTFT PD on ms | TTFT PD off ms | off - on ms "
        "| P compute on ms | P compute off ms | D2H + put on ms | D2H + put off ms "
        "| write waited on ms | write waited off ms | blocks early on | blocks early off |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for length in lengths:
        lines.append(
            f"| {length} | {-(-length // BLOCK_SIZE)} "
            + pair(length, lambda r: _ms(r["TTFT"]))
            + f"| {_ms(off[length]['TTFT'] - on[length]['TTFT'])} "
            + pair(length, lambda r: _ms(r["P compute"]))
            + pair(length, lambda r: _ms(r["D2H"] + r["put"]))
            + pair(length, lambda r: _ms(r["write wait"]))
            + pair(length, lambda r: f"{r['blocks early']:.0f}")
            + "|"
        )
    length = lengths[-1]
    wait_on, wait_off = on[length]["write wait"], off[length]["write wait"]
    saved = off[length]["TTFT"] - on[length]["TTFT"]
    compute_diff = off[length]["P compute"] - on[length]["P compute"]
    lines += [
        "",
        f"Reading: at {length} prompt tokens P waited {_ms(wait_on)} ms after its first token "
        f"for the KV write with the overlap and {_ms(wait_off)} ms without it: "
        f"{_ms(wait_off - wait_on)} ms less on the way to the first token, with "
        f"{on[length]['blocks early']:.0f} of {-(-length // BLOCK_SIZE)} blocks written "
        "while later chunks computed (the last chunk's blocks can only go after it). That "
        "column is the direct measure of the overlap. The TTFT columns differ by "
        f"{_ms(saved)} ms, {100 * abs(saved) / off[length]['TTFT']:.1f}% of TTFT: on 2 shared "
        "CPU cores TTFT moves by more than the whole write from run to run, so the TTFT "
        "difference alone neither shows nor refutes the saving (P compute, the same prefill "
        f"in both modes, differs by {_ms(compute_diff)} ms). D2H + put is wall time: with the "
        "overlap the copies share the two cores with the prefill and can take longer, hidden "
        "behind it but for the write waited.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.pd", description=__doc__)
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024, 2048, 4096])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--overlap-compare",
        action="store_true",
        help="instead of the PD vs mixed table: P's TTFT with write while computing on and "
        "off (--no-write-while-computing), the cluster started once for each",
    )
    parser.add_argument("--overlap-lengths", type=int, nargs="+", default=[4096])
    parser.add_argument("--out", default="docs/benchmarks/pd.md")
    parser.add_argument("--log-dir", default=None)
    args = parser.parse_args(argv)
    if args.overlap_compare:
        table = run_overlap(args.overlap_lengths, args.reps, args.log_dir)
        publish_section(args.out, "pd-overlap", table)
    else:
        publish_section(args.out, "pd", run(args.lengths, args.reps, args.log_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
