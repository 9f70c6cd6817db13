"""aiperf over PD's paths and the mixed worker, at several prompt lengths, in one run: TTFT,
the time to the second token (aiperf's `time_to_second_token`: the first-to-second token
gap) and the inter-token latency, one table.

    make bench-serving-matrix   # installs aiperf into .venv-aiperf first
    python -m benchmarks.serving_matrix --aiperf PATH [--isls 128 512 2048] [--requests 64]

The cluster is benchmarks/pd.py's (its random 4-layer checkpoint, 8192 positions: 2048-token
prompts fit) with 1 P, 1 D and 1 mixed worker; every PD path is its own router over the same
P and D (benchmarks/pd_paths.py: pd, pd+early, pd+local, pd+early+local; a path whose flag the
router lacks is skipped and named). Per prompt length, the paths run back to back, each an
aiperf profile of streaming chat requests with `ignore_eos`. Section `serving-matrix` of
docs/benchmarks/serving.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from contextlib import ExitStack
from pathlib import Path

from benchmarks.machine import cpu_name
from benchmarks.pd import SERVED_NAME, cluster_spec
from benchmarks.pd_paths import extra_router, matrix_variants, router_flags
from benchmarks.serving import AIPERF_VERSION, DEFAULT_AIPERF, REPO, _fmt, _stat, run_aiperf
from benchmarks.table_file import publish_section
from pdrouter.launch.cluster import Cluster

COLUMNS = [  # (aiperf tag, stat, column)
    ("time_to_first_token", "p50", "TTFT p50 ms"),
    ("time_to_first_token", "p99", "TTFT p99 ms"),
    ("time_to_second_token", "p50", "gap p50 ms"),
    ("inter_token_latency", "p50", "ITL p50 ms"),
]


def run(args: argparse.Namespace) -> str:
    variants, skipped = matrix_variants(args.local_tokens, router_flags())
    # Room for the longest prompt, the chat template's tokens and the answer.
    spec, _ = cluster_spec([max(args.isls) + args.osl + 64], args.log_dir)
    rows: list[tuple[int, str, dict]] = []
    with Cluster(spec) as cluster, ExitStack() as routers:
        tokenizer = Path(spec.model).resolve()
        urls = {v.name: cluster.mixed_urls[0] if v.router_args is None else
                routers.enter_context(extra_router(cluster, v.router_args, v.name))
                for v in variants}  # fmt: skip
        out_root = cluster.log_dir / "aiperf"
        for i, isl in enumerate(args.isls):
            for k, v in enumerate(variants):
                out_dir = out_root / f"{isl}-{v.name.replace('+', '-')}"
                out_dir.mkdir(parents=True)
                t0 = time.monotonic()
                # A seed per run and no warm-up (aiperf's repeats its prompts): no request
                # finds its prompt cached (the threshold counts uncached tokens).
                run = run_aiperf(args.aiperf, urls[v.name], tokenizer, out_dir, args,
                                 SERVED_NAME, isl, seed=1 + 16 * i + k, warmup=False)  # fmt: skip
                rows.append((isl, v.name, run["summary"]))
                print(f"{isl} tokens, {v.name}: {time.monotonic() - t0:.0f} s", flush=True)
    return render(rows, skipped, args)


def render(rows: list[tuple[int, str, dict]], skipped: list[str], args: argparse.Namespace) -> str:
    head = ["prompt tokens", "path", "ok", *(c for _, _, c in COLUMNS), "TTFT / mixed",
            "gap / mixed ITL"]  # fmt: skip
    lines = [
        "## PD paths vs the mixed worker under aiperf: TTFT and the first-to-second token gap",
        "",
        f"Command: `make bench-serving-matrix` (`OMP_NUM_THREADS="
        f"{os.environ.get('OMP_NUM_THREADS', '?')} python -m benchmarks.serving_matrix --isls "
        f"{' '.join(map(str, args.isls))} --requests {args.requests} --concurrency "
        f"{args.concurrency} --osl {args.osl}`)  ",
        f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}  ",
        f"Machine: {cpu_name()}, {os.cpu_count()} cores, {platform.platform()}, Python "
        f"{platform.python_version()}, no GPU (CPU Paddle). {args.note}  ",
        f"aiperf {AIPERF_VERSION}, streaming chat requests with `ignore_eos`, {args.requests} "
        f"per path and length at concurrency {args.concurrency}, {args.osl} output tokens; the "
        "random 4-layer checkpoint of docs/benchmarks/pd.md (8192 positions, block size 16); "
        "1 P + 1 D + 1 mixed worker, every PD path its own router over the same P and D, "
        "each run its own aiperf seed and no warm-up (no prompt found cached: aiperf's "
        "warm-up sends the prompts its measured requests send again). "
        "Paths: pd = --no-early-decode (when the router has it) and "
        "--local-prefill-below-tokens 0; +early = the router's default early decode (D starts "
        "with P); +local = the threshold "
        f"{'default' if args.local_tokens is None else args.local_tokens}. gap = aiperf's "
        "time to second token (first -> second streamed token). Targets (issue): PD's gap <= 2x "
        "the mixed worker's ITL p50; TTFT PD / mixed <= 1.05 at 128 tokens, <= 1.10 at 2048.",
        "",
        "| " + " | ".join(head) + " |",
        "|---:|---|" + "---:|" * (len(head) - 2),
    ]
    mixed = {isl: summary for isl, name, summary in rows if name == "mixed"}
    for isl, name, summary in rows:
        ok = int(_stat(summary, "request_count", "avg") or 0)
        cells = [str(isl), name, f"{ok} of {args.requests}"]
        cells += [_fmt(_stat(summary, tag, stat)) for tag, stat, _ in COLUMNS]
        base = mixed[isl]
        ttft, base_ttft = (_stat(s, "time_to_first_token", "p50") for s in (summary, base))
        gap, base_itl = (
            _stat(summary, "time_to_second_token", "p50"),
            _stat(base, "inter_token_latency", "p50"),
        )
        cells.append(_fmt(ttft / base_ttft, 2) if ttft and base_ttft else "-")
        cells.append(_fmt(gap / base_itl, 2) if gap and base_itl else "-")
        lines.append("| " + " | ".join(cells) + " |")
    if skipped:
        lines += ["", "Not run: " + "; ".join(skipped) + "."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--isls", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--requests", type=int, default=64, help="per path and length")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--osl", type=int, default=64, help="output tokens per request")
    parser.add_argument("--local-tokens", type=int, default=None,
                        help="the +local paths' threshold (default: the router's)")  # fmt: skip
    parser.add_argument("--aiperf", type=Path, default=DEFAULT_AIPERF)
    parser.add_argument("--note", default="", help="what else ran on the machine meanwhile")
    parser.add_argument("--output", type=Path, default=REPO / "docs/benchmarks/serving.md")
    parser.add_argument("--log-dir", default=None)
    args = parser.parse_args(argv)
    args.aiperf = args.aiperf.absolute()  # aiperf runs in its output folder
    if not args.aiperf.exists():
        print(f"no aiperf at {args.aiperf}; run `make bench-serving-matrix`", file=sys.stderr)
        return 2
    publish_section(args.output, "serving-matrix", run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
