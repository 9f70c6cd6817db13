"""PD's request paths against the mixed worker in one run: TTFT and the first-to-second token
gap, streamed, at a fixed concurrency (benchmarks/pd_paths.py has the paths and the client).

    OMP_NUM_THREADS=1 python -m benchmarks.pd_matrix [--lengths 128 512 2048]
    OMP_NUM_THREADS=1 python -m benchmarks.pd_matrix --crossover [--lengths 32 64 128 256 448]

The matrix: the model of benchmarks/pd.py (8192 positions), 1 P + 1 D + 1 mixed; per prompt
length, mixed, pd, pd+early, pd+local and pd+early+local back to back over the same workers
(each PD variant its own router), fresh prompts (no shared prefix). The router's own
pdrouter_first_to_second_token_seconds is read beside the client's gap. Section `pd-matrix`
of docs/benchmarks/pd.md.

--crossover sets the default of the router's --local-prefill-below-tokens: the demo model
(`pdrouter launch --model demo`, 512 positions), through P and the pool (threshold 0) and
prefilled on D (every prompt local), and the mixed worker; section `pd-crossover`.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack

import httpx

from benchmarks.machine import cpu_name
from benchmarks.pd import SERVED_NAME, cluster_spec
from benchmarks.pd_paths import (
    ALWAYS_LOCAL_TOKENS,
    StreamTiming,
    Variant,
    completion_body,
    drive,
    extra_router,
    fresh_prompt,
    matrix_variants,
    router_flags,
)
from benchmarks.table_file import publish_section
from pdrouter.launch.cluster import Cluster
from pdrouter.launch.spec import ClusterSpec

GAP_METRIC = "pdrouter_first_to_second_token_seconds"
DEMO_NAME = "bench-demo"


def _median(values: Iterator[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def _router_gap(url: str) -> tuple[float, float]:
    """(sum, count) of the router's first-to-second token histogram."""
    found = {"sum": 0.0, "count": 0.0}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        for part in found:
            if line.startswith(f"{GAP_METRIC}_{part} "):
                found[part] = float(line.rsplit(" ", 1)[1])
    return found["sum"], found["count"]


def body(model: str, length: int, salt: int, args: argparse.Namespace) -> dict:
    return completion_body(model, fresh_prompt(length, salt), args.max_tokens)


def _header(title: str, command: str, model: str, args: argparse.Namespace) -> list[str]:
    return [
        f"## {title}",
        "",
        f"Command: `OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '?')} {command}`  ",
        f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}  ",
        f"Machine: {cpu_name()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        "no GPU (CPU Paddle)  ",
        f"Setup: {model}; 1 P + 1 D + 1 mixed worker, pool owner on same-host shared memory; "
        f"{args.requests} streamed completions per path and length at concurrency "
        f"{args.concurrency}, {args.max_tokens} output tokens each (`ignore_eos`), fresh "
        "prompts (no shared prefix); medians over the requests, timed by the client: TTFT = "
        "request sent -> first text event, gap = first -> second text event, TPOT = mean gap "
        "after the first.",
        "",
    ]


def run_matrix(args: argparse.Namespace) -> str:
    variants, skipped = matrix_variants(args.local_tokens, router_flags())
    spec, _ = cluster_spec(args.lengths, args.log_dir)
    rows: list[tuple[int, Variant, list[StreamTiming], float | None]] = []
    with Cluster(spec) as cluster, ExitStack() as routers:
        urls = {v.name: cluster.mixed_urls[0] if v.router_args is None else
                routers.enter_context(extra_router(cluster, v.router_args, v.name))
                for v in variants}  # fmt: skip
        for url in urls.values():  # warm-up
            drive(url, [completion_body(SERVED_NAME, fresh_prompt(64, 999), 4)], 1)
        for index, length in enumerate(args.lengths):
            for v in variants:
                salt = 10_000 * (index + 1) + 1000 * variants.index(v)  # fresh per path
                bodies = [body(SERVED_NAME, length, salt + i, args) for i in range(args.requests)]
                before = _router_gap(urls[v.name]) if v.router_args is not None else None
                timings = drive(urls[v.name], bodies, args.concurrency)
                router_gap_s = None
                if before is not None:
                    after = _router_gap(urls[v.name])
                    count = after[1] - before[1]
                    router_gap_s = (after[0] - before[0]) / count if count else None
                rows.append((length, v, timings, router_gap_s))
                ttft = _median(t.ttft_s for t in timings)
                print(f"{length} tokens, {v.name}: TTFT p50 {_ms(ttft)} ms", flush=True)
    return render_matrix(rows, skipped, args)


def render_matrix(rows: list, skipped: list[str], args: argparse.Namespace) -> str:
    command = "python -m benchmarks.pd_matrix --lengths " + " ".join(map(str, args.lengths))
    command += f" --requests {args.requests} --concurrency {args.concurrency}"
    command += f" --max-tokens {args.max_tokens}"
    lines = _header("PD paths vs the mixed worker: TTFT and the first-to-second token gap",
                    command, "the random 4-layer checkpoint of the table above (8192 "
                    "positions, block size 16)", args)  # fmt: skip
    lines += [
        "Paths: mixed = the mixed worker alone; pd = router with --no-early-decode (when it "
        "has the flag) and --local-prefill-below-tokens 0; +early = the router's default early "
        "decode (D starts with P); +local = conditional disaggregation at "
        f"{'the default threshold' if args.local_tokens is None else args.local_tokens} "
        "(prompts that short are prefilled on D). Router gap = the router's own "
        f"`{GAP_METRIC}` over the same requests (mean).",
        "",
        "| prompt tokens | path | TTFT p50 ms | TTFT / mixed | gap p50 ms | gap / mixed TPOT "
        "| router gap mean ms | TPOT p50 ms |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    mixed = {length: timings for length, v, timings, _ in rows if v.router_args is None}
    for length, v, timings, router_gap_s in rows:
        ttft = _median(t.ttft_s for t in timings)
        ttst = _median(t.ttst_s for t in timings)
        base_ttft = _median(t.ttft_s for t in mixed[length])
        base_tpot = _median(t.tpot_s for t in mixed[length])
        ratio = "-" if not (ttft and base_ttft) else f"{ttft / base_ttft:.2f}"
        gap_ratio = "-" if not (ttst and base_tpot) else f"{ttst / base_tpot:.2f}"
        lines.append(f"| {length} | {v.name} | {_ms(ttft)} | {ratio} | {_ms(ttst)} | "
                     f"{gap_ratio} | {_ms(router_gap_s)} | "
                     f"{_ms(_median(t.tpot_s for t in timings))} |")  # fmt: skip
    if skipped:
        lines += ["", "Not run: " + "; ".join(skipped) + "."]
    return "\n".join(lines) + "\n"


def run_crossover(args: argparse.Namespace) -> str:
    """Per length: the mixed worker, PD (threshold 0) and every prompt prefilled on D."""
    spec = ClusterSpec(model="demo", num_prefill=1, num_decode=1, num_mixed=1,
                       worker_args=("--served-model-name", DEMO_NAME),
                       router_args=("--local-prefill-below-tokens", "0"),
                       log_dir=args.log_dir, startup_timeout_s=600.0)  # fmt: skip
    paths = ("mixed", "pd", "local")
    results: dict[int, dict[str, list[StreamTiming]]] = {}
    with Cluster(spec) as cluster:
        local_args = ("--local-prefill-below-tokens", str(ALWAYS_LOCAL_TOKENS))
        with extra_router(cluster, local_args, "local") as local_url:
            urls = {"mixed": cluster.mixed_urls[0], "pd": cluster.router_url,
                    "local": local_url}  # fmt: skip
            for url in urls.values():  # warm-up
                drive(url, [completion_body(DEMO_NAME, fresh_prompt(16, 999), 4)], 1)
            for index, length in enumerate(args.lengths):
                results[length] = {}
                for k, path in enumerate(paths):
                    salt = 10_000 * (index + 1) + 1000 * k
                    bodies = [body(DEMO_NAME, length, salt + i, args) for i in range(args.requests)]
                    results[length][path] = drive(urls[path], bodies, args.concurrency)
                tt2t = {p: _ms(_median(t.tt2t_s for t in results[length][p])) for p in paths}
                print(f"{length} tokens: TT2T p50 {tt2t}", flush=True)
    return render_crossover(results, args)


def render_crossover(results: dict[int, dict[str, list[StreamTiming]]],
                     args: argparse.Namespace) -> str:  # fmt: skip
    command = "python -m benchmarks.pd_matrix --crossover --lengths "
    command += " ".join(map(str, args.lengths))
    command += f" --requests {args.requests} --concurrency {args.concurrency}"
    command += f" --max-tokens {args.max_tokens}"
    lines = _header("Conditional disaggregation: the crossover", command,
                    "`--model demo` (6 layers, 5.8M parameters, 512 positions)", args)  # fmt: skip
    lines += [
        "Paths: pd = router with --local-prefill-below-tokens 0 (P prefills, KV through the "
        f"pool); local = a router whose threshold ({ALWAYS_LOCAL_TOKENS}) sends every prompt "
        "to D's own prefill (P only tokenizes and decides); mixed = the mixed worker.",
        "",
        "The decision's measure is the time to the second token (TT2T = TTFT + gap, per "
        "request): through PD the first token leaves when P has written the KV and the second "
        "waits for D to read it; prefilled on D both wait for D's own prefill, which also "
        "delays the tokens of D's other streams (TPOT). The threshold is set at the longest "
        "prompt for which local's TT2T p50 is below PD's.",
        "",
        "| prompt tokens | TTFT mixed ms | TTFT pd ms | TTFT local ms | gap pd ms "
        "| gap local ms | TT2T mixed ms | TT2T pd ms | TT2T local ms | local / pd TT2T "
        "| TPOT pd ms | TPOT local ms |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    faster = []  # lengths where D's own prefill gave the second token sooner
    fields = ("ttft_s", "ttst_s", "tt2t_s", "tpot_s")
    for length, by_path in results.items():
        med = {p: {f: _median(getattr(t, f) for t in ts) for f in fields}
               for p, ts in by_path.items()}  # fmt: skip
        mixed, pd, local = med["mixed"], med["pd"], med["local"]
        ratio = local["tt2t_s"] / pd["tt2t_s"]  # type: ignore[operator]
        if ratio < 1.0:
            faster.append(length)
        lines.append(
            f"| {length} | {_ms(mixed['ttft_s'])} | {_ms(pd['ttft_s'])} | {_ms(local['ttft_s'])} "
            f"| {_ms(pd['ttst_s'])} | {_ms(local['ttst_s'])} | {_ms(mixed['tt2t_s'])} "
            f"| {_ms(pd['tt2t_s'])} | {_ms(local['tt2t_s'])} | {ratio:.2f} "
            f"| {_ms(pd['tpot_s'])} | {_ms(local['tpot_s'])} |"
        )
    lines += ["", "Local reached the second token sooner at: "
              + (", ".join(map(str, faster)) or "no length") + " prompt tokens."]  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.pd_matrix", description=__doc__)
    parser.add_argument("--crossover", action="store_true",
                        help="the threshold's crossover on the demo model instead")  # fmt: skip
    parser.add_argument("--lengths", type=int, nargs="+", default=None)
    parser.add_argument("--requests", type=int, default=16, help="per path and length")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--local-tokens", type=int, default=None,
                        help="the +local paths' threshold (default: the router's)")  # fmt: skip
    parser.add_argument("--out", default="docs/benchmarks/pd.md")
    parser.add_argument("--log-dir", default=None)
    args = parser.parse_args(argv)
    if args.crossover:
        args.lengths = args.lengths or [32, 64, 128, 256, 448]
        publish_section(args.out, "pd-crossover", run_crossover(args))
    else:
        args.lengths = args.lengths or [128, 512, 2048]
        publish_section(args.out, "pd-matrix", run_matrix(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
