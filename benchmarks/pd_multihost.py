"""The PD benchmark across hosts (TCP) next to the single-host shared-memory run, same workload.

    OMP_NUM_THREADS=1 python -m benchmarks.pd_multihost [--lengths 128 512 2048] [--reps 3]

Workload, model and metrics are benchmarks/pd.py's: fresh prompts (no shared prefix), one
request at a time, streamed through the router with the official openai client; the handoff
split comes from the P and D workers' histograms. Two clusters, one after the other:

    shared memory  `pdrouter launch` on one host: the workers are same-host clients of the pool
                   owner (--pool-owner), blocks move through its shared memory
    TCP            pdrouter.launch.multihost on pdrouter.launch.netns (master + owner on host A,
                   owner + P on B, D on C, routers on D): blocks move over TCP between hosts
                   (veth pairs through a bridge; no wire, so this is the protocol's cost,
                   not a network's)

Needs root for the namespaces (elsewhere it says so and exits 1). Writes
docs/benchmarks/multihost.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.machine import cpu_name
from benchmarks.pd import (
    BLOCK_SIZE,
    HANDOFF_METRICS,
    MAX_TOKENS,
    SERVED_NAME,
    histogram_sums,
    make_prompt,
    stream_once,
    write_checkpoint,
)
from benchmarks.table_file import publish
from pdrouter.launch.cluster import Cluster
from pdrouter.launch.multihost import HOSTS, MultiHostCluster
from pdrouter.launch.netns import Topology, unavailable_reason
from pdrouter.launch.spec import ClusterSpec

Runner = Callable[..., object]  # call(fn, *args) in the network the cluster lives in
MOVE = ("D2H", "put", "get", "H2D")


def model_args(model_dir: Path, lengths: list[int]) -> tuple[tuple[str, ...], int]:
    max_len = max(lengths) + MAX_TOKENS + BLOCK_SIZE
    num_blocks = max_len // BLOCK_SIZE + 8
    return ("--model", str(model_dir), "--served-model-name", SERVED_NAME,
            "--block-size", str(BLOCK_SIZE), "--num-kv-blocks", str(num_blocks),
            "--max-model-len", str(max_len), "--max-num-batched-tokens", "1024",
            "--staging-slots", "128", "--transfer-batch-blocks", "64"), num_blocks  # fmt: skip


def measure(call: Runner, router: str, p_url: str, d_url: str, lengths: list[int], reps: int,
            salt0: int) -> dict[int, dict[str, float]]:  # fmt: skip
    """Per length: median TTFT and per-request handoff stages (seconds)."""
    call(stream_once, router, make_prompt(64, salt=salt0 + 999))  # warm-up
    rows = {}
    for length in lengths:
        ttft, stages = [], {k: [] for k in HANDOFF_METRICS}
        for rep in range(reps):
            before = {"prefill": call(histogram_sums, p_url), "decode": call(histogram_sums, d_url)}
            timing = call(stream_once, router, make_prompt(length, salt0 + rep))
            after = {"prefill": call(histogram_sums, p_url), "decode": call(histogram_sums, d_url)}
            ttft.append(timing.ttft_s)
            for column, (role, name) in HANDOFF_METRICS.items():
                stages[column].append(after[role][name] - before[role][name])
        rows[length] = {"TTFT": statistics.median(ttft),
                        **{k: statistics.median(v) for k, v in stages.items()}}  # fmt: skip
        print(f"{length} tokens: {rows[length]}", flush=True)
    return rows


def run_shared_memory(args: tuple[str, ...], lengths: list[int], reps: int, log_dir: str):
    model_dir = args[args.index("--model") + 1]
    rest = tuple(a for i, a in enumerate(args) if i not in (0, 1))  # all but --model DIR
    spec = ClusterSpec(model=model_dir, num_prefill=1, num_decode=1, num_mixed=0,
                       pool_size="1GiB", worker_args=rest, log_dir=log_dir,
                       startup_timeout_s=600.0)  # fmt: skip
    with Cluster(spec) as cluster:
        return measure(lambda fn, *a: fn(*a), cluster.router_url, cluster.prefill_urls[0],
                       cluster.decode_urls[0], lengths, reps, salt0=1000)  # fmt: skip


def run_tcp(args: tuple[str, ...], lengths: list[int], reps: int, log_dir: str):
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    with Topology(HOSTS) as topo:
        model, engine_args = args[1], args[2:]  # args: --model DIR, then the rest
        cluster = MultiHostCluster(topo, Path(log_dir), model, engine_args, pool_size="512MiB")
        try:
            cluster.start(timeout_s=600.0)
            return measure(topo.call, cluster.router_urls[0], cluster.url("prefill"),
                           cluster.url("decode"), lengths, reps, salt0=2000)  # fmt: skip
        finally:
            cluster.stop()


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"


def render(shm: dict, tcp: dict, lengths: list[int], reps: int, num_blocks: int) -> str:
    kv_bytes_per_token = 4 * 2 * 4 * 64 * 4  # layers * (K, V) * kv heads * head dim * fp32
    cpu = cpu_name(platform.machine())
    lines = [
        "# PD across hosts (TCP) vs one host (shared memory), same workload",
        "",
        f"Command: `OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '?')} python -m "
        f"benchmarks.pd_multihost --lengths {' '.join(map(str, lengths))} --reps {reps}` "
        "(`make bench-multihost`)  ",
        f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}  ",
        f"Machine: {cpu}, {os.cpu_count()} cores, Python {platform.python_version()}  ",
        "Model and workload: benchmarks/pd.py's (random Llama-style checkpoint, hidden 512, "
        f"4 layers, 4 KV heads, head dim 64, float32, block size {BLOCK_SIZE}, {num_blocks} "
        f"KV blocks per worker; {MAX_TOKENS} output tokens, greedy, fresh prompts, one request "
        f"at a time; median of {reps}).",
        "",
        "shm: `pdrouter launch` on one host, workers are shared-memory clients of the pool "
        "owner. TCP: the namespace topology of tests/e2e/multihost (pool owners on hosts A "
        "and B, P on B, D on C, router on D); every block crosses a veth pair and a bridge "
        "over Mooncake's TCP transport, on the same 2 cores (no real wire: the cost of the "
        "protocol, not of a network). Handoff = D2H + put (on P, before the first token) + "
        "get + H2D (on D, before the second); put/get are the pool calls.",
        "",
        "| prompt tokens | KV MiB | TTFT shm ms | TTFT TCP ms | P compute shm ms "
        "| P compute TCP ms | put shm ms | put TCP ms "
        "| get shm ms | get TCP ms | handoff shm ms | handoff TCP ms |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n in lengths:
        a, b = shm[n], tcp[n]
        lines.append(
            f"| {n} | {n * kv_bytes_per_token / 2**20:.1f} | {_ms(a['TTFT'])} | {_ms(b['TTFT'])} "
            f"| {_ms(a['P compute'])} | {_ms(b['P compute'])} "
            f"| {_ms(a['put'])} | {_ms(b['put'])} | {_ms(a['get'])} | {_ms(b['get'])} "
            f"| {_ms(sum(a[k] for k in MOVE))} | {_ms(sum(b[k] for k in MOVE))} |"
        )
    n = lengths[-1]
    move_shm, move_tcp = (sum(run[n][k] for k in MOVE) for run in (shm, tcp))
    lines += [
        "",
        f"Reading: at {n} prompt tokens the handoff takes {_ms(move_tcp)} ms over TCP against "
        f"{_ms(move_shm)} ms through shared memory ({move_tcp / move_shm:.1f}x), "
        f"{100 * move_tcp / tcp[n]['TTFT']:.1f}% and {100 * move_shm / shm[n]['TTFT']:.1f}% of "
        "the time to first token, which P's prefill compute dominates either way. The two "
        "runs are minutes apart on 2 cores shared with other processes: the P compute "
        "columns (the same work in both) show how loaded each run was, so compare the "
        "put/get/handoff columns, not the TTFT columns.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.pd_multihost",
                                     description=__doc__.split("\n\n")[0])  # fmt: skip
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default="docs/benchmarks/multihost.md")
    args = parser.parse_args(argv)
    reason = unavailable_reason()
    if reason is not None:
        print(f"benchmarks.pd_multihost: cannot make network namespaces: {reason}")
        return 1
    cache_root = Path(os.environ.get("PDROUTER_BENCH_CACHE", Path.home() / ".cache" / "pdrouter"))
    flags, num_blocks = model_args(write_checkpoint(cache_root), args.lengths)
    log_dir = tempfile.mkdtemp(prefix="pd-multihost-")
    shm = run_shared_memory(flags, args.lengths, args.reps, f"{log_dir}/shm")
    tcp = run_tcp(flags, args.lengths, args.reps, f"{log_dir}/tcp")
    table = render(shm, tcp, args.lengths, args.reps, num_blocks)
    publish(args.out, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
