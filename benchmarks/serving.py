"""aiperf (NVIDIA's serving benchmark client) against a 1P1D cluster and, as the same-run
baseline, its mixed worker: TTFT, ITL, throughput and errors as the field measures them.

    make bench-serving          # installs aiperf into .venv-aiperf first
    python -m benchmarks.serving [--requests 300] [--concurrency 16] [--aiperf PATH]

One cluster (master, pool owner, 1 P, 1 D, 1 mixed, router) of the tiny model; aiperf sends
streaming chat requests with `ignore_eos` (every answer is --osl tokens long), first through the
router (PD), then straight to the mixed worker. aiperf lives in its own virtualenv (it is heavy
and pins its own dependencies); its tokenizer is the model folder's absolute path, and
HF_ENDPOINT points at an unused loopback port so that nothing it tries can leave the machine
(HF_HUB_OFFLINE=1 makes it refuse a local folder). Writes docs/benchmarks/serving.md.
benchmarks/serving_matrix.py runs the same client over PD's paths at several prompt lengths.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pdrouter.common.proc import find_free_port
from pdrouter.launch.cluster import Cluster
from pdrouter.launch.spec import ClusterSpec

REPO = Path(__file__).resolve().parents[1]
DEFAULT_AIPERF = REPO / ".venv-aiperf" / "bin" / "aiperf"
AIPERF_VERSION = "0.13.0"  # what the Makefile installs
MODEL = "tiny"
# (aiperf metric tag, column, unit scale): aiperf reports latencies in ms.
METRICS = [
    ("time_to_first_token", "TTFT"),
    ("inter_token_latency", "ITL"),
    ("request_latency", "request latency"),
]


def run_aiperf(aiperf: Path, url: str, tokenizer: Path, out_dir: Path, args: Any,
               model: str = MODEL, isl: int | None = None, seed: int = 0,
               warmup: bool = True) -> dict:  # fmt: skip
    """One aiperf profile run against url (isl: prompt tokens, default args.isl; seed: of
    its synthetic prompts, equal seeds sending equal prompts; warmup: first --concurrency
    requests unmeasured, whose prompts the measured ones repeat); its JSON summary and its
    command line."""
    isl = args.isl if isl is None else isl
    argv = [
        str(aiperf), "profile", "--model", model, "--url", url, "--endpoint-type", "chat",
        "--streaming", "--tokenizer", str(tokenizer),
        "--request-count", str(args.requests), "--concurrency", str(args.concurrency),
        "--prompt-input-tokens-mean", str(isl), "--prompt-input-tokens-stddev", "0",
        "--prompt-output-tokens-mean", str(args.osl), "--prompt-output-tokens-stddev", "0",
        "--extra-inputs", "ignore_eos:true", "--random-seed", str(seed),
        "--output-artifact-dir", str(out_dir), "--no-server-metrics", "--no-gpu-telemetry",
        "--request-timeout-seconds", "300", "--ui-type", "none",
    ]  # fmt: skip
    if warmup:
        argv += ["--warmup-request-count", str(args.concurrency)]
    env = {
        **os.environ,
        # Nothing listens there: a download attempt fails at once, on the machine.
        "HF_ENDPOINT": f"http://127.0.0.1:{find_free_port()}",
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }
    env.pop("HF_HUB_OFFLINE", None)
    print("$", " ".join(argv), flush=True)
    subprocess.run(argv, env=env, check=True, cwd=out_dir, timeout=1800)
    found = sorted(out_dir.rglob("profile_export_aiperf.json"))
    if not found:
        raise RuntimeError(f"aiperf wrote no profile_export_aiperf.json under {out_dir}")
    return {"summary": json.loads(found[-1].read_text()), "argv": argv}


def _stat(summary: dict, tag: str, stat: str) -> float | None:
    metric = summary.get(tag)
    if isinstance(metric, dict) and metric.get(stat) is not None:
        return float(metric[stat])
    return None


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def row(name: str, summary: dict, requests: int) -> str:
    errors = summary.get("error_request_count")
    num_errors = int(errors["avg"]) if isinstance(errors, dict) else 0
    num_ok = int(_stat(summary, "request_count", "avg") or 0)
    cells = [name, f"{num_ok} of {requests}", str(num_errors)]
    for tag, _ in METRICS:
        cells.append(f"{_fmt(_stat(summary, tag, 'p50'))} / {_fmt(_stat(summary, tag, 'p99'))}")
    cells.append(_fmt(_stat(summary, "request_throughput", "avg")))
    cells.append(_fmt(_stat(summary, "output_token_throughput", "avg"), 0))
    return "| " + " | ".join(cells) + " |"


def write_table(path: Path, runs: dict[str, dict], args: Any, note: str) -> None:
    router_argv = runs["router (1P1D)"]["argv"]
    head = ["target", "ok", "errors"] + [f"{c} p50 / p99 (ms)" for _, c in METRICS]
    head += ["requests/s", "output tokens/s"]
    lines = [
        "# Serving benchmark: aiperf against the router (1P1D) and a mixed worker",
        "",
        f"aiperf {AIPERF_VERSION} (its own virtualenv), streaming chat requests, "
        f"{args.requests} per target at concurrency {args.concurrency}, "
        f"{args.isl} prompt tokens and {args.osl} output tokens each (`ignore_eos: true`), "
        f"model `{MODEL}`. Same run, same cluster: the PD path through the router, then the "
        "cluster's mixed worker alone (the colocated baseline).",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
        *(row(name, run["summary"], args.requests) for name, run in runs.items()),
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, {platform.platform()}, "
        f"Python {platform.python_version()}, no GPU (CPU Paddle). {note}",
        "",
        "Command: `make bench-serving` (`python -m benchmarks.serving "
        f"--requests {args.requests} --concurrency {args.concurrency} --isl {args.isl} "
        f"--osl {args.osl}`); the aiperf command of the router run:",
        "",
        "```",
        " ".join(Path(a).name if a.endswith("/aiperf") else a for a in router_argv),
        "```",
        "",
    ]
    path.write_text("\n".join(lines))
    print(path.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--isl", type=int, default=128, help="prompt tokens per request")
    parser.add_argument("--osl", type=int, default=32, help="output tokens per request")
    parser.add_argument("--aiperf", type=Path, default=DEFAULT_AIPERF)
    parser.add_argument("--note", default="", help="what else ran on the machine meanwhile")
    parser.add_argument("--output", type=Path, default=REPO / "docs/benchmarks/serving.md")
    args = parser.parse_args(argv)
    args.aiperf = args.aiperf.absolute()  # aiperf runs in its output folder
    if not args.aiperf.exists():
        print(f"no aiperf at {args.aiperf}; run `make bench-serving`", file=sys.stderr)
        return 2
    from workers.engine.tiny import materialize_tiny

    with tempfile.TemporaryDirectory(prefix="bench-serving-") as tmp:
        work = Path(tmp)
        cache = work / "models"
        tokenizer = materialize_tiny(MODEL, 0, cache).resolve()
        spec = ClusterSpec(
            model=MODEL, num_prefill=1, num_decode=1, num_mixed=1,
            worker_args=("--model-cache-dir", str(cache)), log_dir=str(work / "logs"),
        )  # fmt: skip
        cluster = Cluster(spec)
        try:
            cluster.start()
            runs = {}
            for name, url in (("router (1P1D)", cluster.router_url),
                              ("mixed worker", cluster.mixed_urls[0])):  # fmt: skip
                out_dir = work / name.split()[0]
                out_dir.mkdir()
                t0 = time.monotonic()
                runs[name] = run_aiperf(args.aiperf, url, tokenizer, out_dir, args)
                print(f"{name}: {time.monotonic() - t0:.0f} s", flush=True)
        finally:
            cluster.stop()
    write_table(args.output, runs, args, args.note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
