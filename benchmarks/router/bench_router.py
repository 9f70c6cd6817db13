"""Router overhead: requests/s and latency of six ways to reach the same mock backends.

    python -m benchmarks.router.bench_router [--rounds 3] [--window-s 3]
        [--output docs/benchmarks/router.md]

One run starts a mock prefill and a mock decode backend (`benchmarks.router.mock_backend`: no
model, one-token chunks as fast as the CPU allows) and, in front of them:

    direct    the client calls the decode mock itself (no router, no prefill hop)
    bare      the floor: the same two hops relayed by a bare ASGI app on the same stack
              (`benchmarks.router.bare_relay`), with none of a router's checks or features
    bare-raw  the same bare relay without uvicorn (a bare asyncio protocol server)
    pdrouter  `pdrouter serve` in PD mode (P's /internal/prefill, then D's /internal/decode),
              with its default client to the workers (our own, pdrouter.router.upstream.h1)
    pdrouter-aiohttp  the same with `--upstream-client aiohttp`
    pdrouter-baseline `pdrouter serve` of another checkout (`--baseline DIR`, run by DIR's own
              .venv from DIR): a change's before and after, measured in one run
    toy       vLLM's toy disaggregation proxy as the mooncake wheel ships it, unmodified
    sglang    the SGLang gateway (`sglang_router.launch_router --pd-disaggregation`)

Every phase (streams of N tokens at concurrency C) runs each case in turn for a short window,
round after round, rotating the order, so that background load on the shared machine falls on
all of them alike. Every stream is checked whole (the mock's token texts in order, then
[DONE]); a lost or damaged stream fails the run. The CPU time of each router's process group
over its windows gives its relay cost per request and, from two stream lengths, per token.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.router.load import LoadResult, run_interleaved, run_load
from benchmarks.router.report import write_report
from benchmarks.router.stats import CASES, CaseStats, Phase
from pdrouter.common.proc import ManagedProcess, find_free_port, wait_for_http

MODEL = "mock"


def group_cpu_s(pgid: int) -> float:
    """User + system CPU seconds of every live process in process group pgid (Linux /proc)."""
    ticks_per_s = os.sysconf("SC_CLK_TCK")
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue  # exited while we looked
        # Fields after the parenthesized command name: state ppid pgrp ... utime(14) stime(15)
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid:
            total += int(fields[11]) + int(fields[12])
    return total / ticks_per_s


class Bench:
    """The processes of one run: two mocks and the routers in front of them."""

    def __init__(self, workdir: Path, cases: list[str], token_interval_ms: float = 0.0,
                 baseline: Path | None = None) -> None:  # fmt: skip
        self.workdir = workdir
        self.cases = cases
        self.token_interval_ms = token_interval_ms  # the decode mock's pause between tokens
        self.baseline = baseline  # another checkout, for the case pdrouter-baseline
        self.procs: dict[str, ManagedProcess] = {}
        self.urls: dict[str, str] = {}
        self.notes: dict[str, str] = {}

    def _start(self, name: str, argv: list[str], ready_path: str, port: int,
               cwd: str | None = None) -> None:  # fmt: skip
        proc = ManagedProcess(name, argv, log_path=self.workdir / f"{name}.log", cwd=cwd)
        self.procs[name] = proc
        wait_for_http(f"http://127.0.0.1:{port}{ready_path}", 60.0, proc)
        self.urls[name] = f"http://127.0.0.1:{port}"

    def start(self) -> None:
        py = sys.executable
        tokenizer_dir = self.workdir / "tokenizer"
        tokenizer_dir.mkdir(exist_ok=True)
        _write_tokenizer(tokenizer_dir)
        for role in ("prefill", "decode"):
            port = find_free_port()
            argv = [py, "-m", "benchmarks.router.mock_backend", "--role", role, "--port", str(port),
                    "--model", MODEL, "--model-path", str(tokenizer_dir),
                    "--token-interval-ms", str(self.token_interval_ms)]  # fmt: skip
            self._start(f"mock-{role}", argv, "/health", port)
        p_url, d_url = self.urls["mock-prefill"], self.urls["mock-decode"]
        self.urls["direct"] = d_url
        self.procs["direct"] = self.procs["mock-decode"]
        clients = (("pdrouter", "h1", ()), ("pdrouter-aiohttp", "aiohttp", ()),
                   ("pdrouter-traced", "h1", ("--otlp-endpoint", p_url)))  # fmt: skip
        for case, client, extra in clients:
            if case in self.cases:
                port = find_free_port()
                argv = [py, "-m", "pdrouter.cli", "serve", "--prefill", p_url, "--decode", d_url,
                        "--port", str(port), "--log-level", "warning",
                        "--upstream-client", client, *extra]  # fmt: skip
                self._start(case, argv, "/health", port)
        if "pdrouter-baseline" in self.cases:
            self._start_baseline(p_url, d_url)
        for case, server in (("bare", "uvicorn"), ("bare-raw", "raw")):
            if case in self.cases:
                port = find_free_port()
                argv = [py, "-m", "benchmarks.router.bare_relay", "--prefill", p_url,
                        "--decode", d_url, "--port", str(port), "--server", server]  # fmt: skip
                self._start(case, argv, "/health", port)
        if "toy" in self.cases:
            self._start_toy(p_url, d_url)
        if "sglang" in self.cases:
            self._start_sglang(p_url, d_url)

    def _start_baseline(self, p_url: str, d_url: str) -> None:
        python = self.baseline / ".venv" / "bin" / "python" if self.baseline else None
        if python is None or not python.exists():
            self.notes["pdrouter-baseline"] = "not run: no --baseline checkout with a .venv"
            self.cases.remove("pdrouter-baseline")
            return
        port = find_free_port()
        # Run from the checkout: `-m` puts the working directory first on sys.path.
        argv = [str(python), "-m", "pdrouter.cli", "serve", "--prefill", p_url, "--decode", d_url,
                "--port", str(port), "--log-level", "warning"]  # fmt: skip
        self._start("pdrouter-baseline", argv, "/health", port, cwd=str(self.baseline))
        commit = subprocess.run(["git", "-C", str(self.baseline), "log", "-1", "--format=%h %s"],
                                capture_output=True, text=True).stdout.strip()  # fmt: skip
        self.notes["pdrouter-baseline"] = f"`pdrouter` at {commit[:100] or self.baseline}"

    def _start_toy(self, p_url: str, d_url: str) -> None:
        spec = importlib.util.find_spec("mooncake")
        script = Path(spec.origin).parent / "vllm_v1_proxy_server.py" if spec else None
        if script is None or not script.exists():
            self.notes["toy"] = "not run: mooncake wheel (vllm_v1_proxy_server.py) not installed"
            self.cases.remove("toy")
            return
        port = find_free_port()
        p_port, d_port = p_url.rsplit(":", 1)[1], d_url.rsplit(":", 1)[1]
        argv = [sys.executable, str(script), "--host", "127.0.0.1", "--port", str(port),
                "--prefiller-hosts", "127.0.0.1", "--prefiller-ports", p_port,
                "--decoder-hosts", "127.0.0.1", "--decoder-ports", d_port]  # fmt: skip
        self._start("toy", argv, "/healthcheck", port)

    def _start_sglang(self, p_url: str, d_url: str) -> None:
        if importlib.util.find_spec("sglang_router") is None:
            self.notes["sglang"] = (
                "not run: sglang-router not installed (pip install sglang-router)"
            )
            self.cases.remove("sglang")
            return
        port, metrics_port = find_free_port(), find_free_port()
        argv = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
                "--prefill", p_url, "--decode", d_url, "--host", "127.0.0.1", "--port", str(port),
                "--policy", "round_robin", "--log-level", "warn", "--prometheus-host",
                "127.0.0.1", "--prometheus-port", str(metrics_port)]  # fmt: skip
        self._start("sglang", argv, "/health", port)

    def stop(self) -> None:
        for proc in reversed(list(self.procs.values())):
            proc.stop()


def _write_tokenizer(folder: Path) -> None:
    """A local tokenizer for the SGLang gateway (it loads one per model, from the model_path
    the workers report; without a local one it would try to download one by name)."""
    from workers.engine.tiny import write_byte_tokenizer

    write_byte_tokenizer(folder)


async def _measure(bench: Bench, phases: list[Phase], rounds: int, window_s: float,
                   warmup: int) -> dict[Phase, dict[str, CaseStats]]:  # fmt: skip
    stats = {phase: {case: CaseStats() for case in bench.cases} for phase in phases}
    for case in bench.cases:  # warm every path (connections, imports, JIT-less first calls)
        await run_load(bench.urls[case], MODEL, 4, 8, window_s=0.0, num_requests=warmup)
    for r in range(rounds):
        for phase in phases:
            if phase.concurrency == 1:
                await _interleaved(bench, phase, stats[phase], window_s * len(bench.cases), r,
                                   rounds)  # fmt: skip
                continue
            order = bench.cases[r % len(bench.cases) :] + bench.cases[: r % len(bench.cases)]
            for case in order:
                pgid = bench.procs[case].pid
                cpu_before = group_cpu_s(pgid)
                load = await run_load(
                    bench.urls[case], MODEL, phase.concurrency, phase.num_tokens, window_s
                )
                stats[phase][case].add(load, group_cpu_s(pgid) - cpu_before)
                _print_window(r, rounds, phase, case, load)
    return stats


async def _interleaved(bench: Bench, phase: Phase, stats: dict[str, CaseStats], window_s: float,
                       r: int, rounds: int) -> None:  # fmt: skip
    """One request at a time: the cases take turns request by request (bench_load), so a
    latency difference between two cases is never a difference of when they ran."""

    def cpu(case: str) -> float | None:
        # The mocks serve every case here: only a router's own processes are its alone.
        return None if case == "direct" else group_cpu_s(bench.procs[case].pid)

    urls = {case: bench.urls[case] for case in bench.cases}
    loads = await run_interleaved(urls, MODEL, phase.num_tokens, window_s, cpu)
    for case, load in loads.items():
        stats[case].add(load, load.cpu_s)
        _print_window(r, rounds, phase, case, load)


def _print_window(r: int, rounds: int, phase: Phase, case: str, load: LoadResult) -> None:
    p50_ms = 1000 * statistics.median(load.latencies_s)
    print(f"round {r + 1}/{rounds} {phase.name:<22} {case:<9} "
          f"{load.requests_per_s:8.1f} req/s  p50 {p50_ms:7.2f} ms", flush=True)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.router.bench_router",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    parser.add_argument(
        "--baseline",
        type=Path,
        help="another checkout of pdrouter with its own .venv (e.g. a git worktree of the "
        "commit before a change): adds the case pdrouter-baseline, its router, to every round",
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16],
                        help="clients of the 32-token phases (one phase each; the 256-token "
                        "phase runs 16)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3, help="windows per case and phase")
    parser.add_argument("--window-s", type=float, default=3.0, help="seconds per window")
    parser.add_argument("--warmup", type=int, default=32, help="requests per case first")
    parser.add_argument(
        "--token-interval-ms",
        type=float,
        default=0.0,
        help="the decode mock's pause between tokens (0: as fast as the CPU allows; a real "
        "model's is 10-50 ms)",
    )
    parser.add_argument(
        "--section",
        default="default",
        help="name of the generated section to replace in --output (one per configuration, "
        "e.g. 'uvloop' for a run with uvloop and httptools importable)",
    )
    parser.add_argument("--output", default="docs/benchmarks/router.md",
                        help="markdown file to write ('' to skip)")  # fmt: skip
    args = parser.parse_args(argv)
    phases = [Phase(c, 32) for c in args.concurrency] + [Phase(16, 256)]
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-router-") as tmp:
        cases = [c for c in args.cases if c != "pdrouter-baseline" or args.baseline]
        bench = Bench(Path(tmp), cases, args.token_interval_ms, args.baseline)
        try:
            bench.start()
            t0 = time.monotonic()
            stats = asyncio.run(_measure(bench, phases, args.rounds, args.window_s, args.warmup))
            wall_s = time.monotonic() - t0
        finally:
            bench.stop()
    load_after = os.getloadavg()
    text = write_report(
        stats, bench.notes, args, wall_s, load_before, load_after, args.output or None
    )
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
