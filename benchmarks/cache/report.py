"""The cache benchmark's table (docs/benchmarks/cache.md) and figure (cache.png)."""

from __future__ import annotations

import os
import platform
import statistics
import time
from pathlib import Path

from benchmarks.cache.workloads import Sample, WorkloadResult
from benchmarks.machine import cpu_name

Results = dict[str, dict[str, WorkloadResult]]  # case -> workload name -> result


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def _ms(seconds: float) -> str:
    return f"{1000 * seconds:.0f}"


def _by_index(samples: list[Sample]) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for s in samples:
        out.setdefault(s.index, []).append(s.ttft_s)
    return out


def _hit_line(result: WorkloadResult) -> str:
    src = result.by_source
    total = sum(src.values()) or 1.0
    cached = src["device"] + src["pool"]
    return (f"{cached / total:.0%} ({src['device']:.0f} device + {src['pool']:.0f} pool of "
            f"{total:.0f}; {src['computed']:.0f} computed)")  # fmt: skip


def render(results: Results, command: str, settings: str) -> str:
    cases = list(results)
    lines = [
        "# The pool as a shared prefix cache (2 P + 2 D through the router)",
        "",
        f"Command: `{command}`  ",
        f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}  ",
        f"Machine: {cpu_name()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
        "**shared with other jobs running tests at the same time**, so every number carries "
        "that noise (10-30% between runs is common here).  ",
        settings,
        "",
        "Cases, each on a fresh cluster (master, pool owner, 2 P, 2 D, router): **cache off** "
        "(`--no-prefix-cache --no-pool-prefix-cache --no-decode-writeback` on every worker: "
        "the same-run baseline), **device** (device prefix cache only), **device+pool** (the "
        "defaults: device cache, pool prefix reads on P, decode write-back), "
        "**+cache-aware** (the same with the router's `--prefill-policy cache_aware`). TTFT "
        "is measured by the openai client (request sent -> first content chunk).",
        "",
        "## Multi-turn chat: TTFT per turn, p50 / p90 ms",
        "",
        "| turn | " + " | ".join(cases) + " |",
        "|---:|" + "---:|" * len(cases),
    ]
    turns = sorted(_by_index(results[cases[0]]["multi_turn"].samples))
    for turn in turns:
        cells = []
        for case in cases:
            v = _by_index(results[case]["multi_turn"].samples)[turn]
            cells.append(f"{_ms(_pct(v, 0.5))} / {_ms(_pct(v, 0.9))}")
        lines.append(f"| {turn} | " + " | ".join(cells) + " |")
    lines += ["", "Prompt tokens cached (router's `pdrouter_prompt_tokens_by_source_total`):", ""]
    lines += [f"- {case}: {_hit_line(results[case]['multi_turn'])}" for case in cases]
    lines += [
        "",
        "## Long shared document (~3,000 tokens), short questions: TTFT ms",
        "",
        "| case | question 1 (cold) | questions 2+ p50 | p90 | 2+ / cold | cached |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for case in cases:
        samples = results[case]["shared_doc"].samples
        cold = samples[0].ttft_s
        rest = [s.ttft_s for s in samples[1:]]
        lines.append(
            f"| {case} | {_ms(cold)} | {_ms(_pct(rest, 0.5))} | {_ms(_pct(rest, 0.9))} "
            f"| {_pct(rest, 0.5) / cold:.2f} | {_hit_line(results[case]['shared_doc'])} |"
        )
    lines += [
        "",
        "## No reuse (unique prompts): TTFT ms",
        "",
        "| case | p50 | p90 | p50 / cache off |",
        "|---|---:|---:|---:|",
    ]
    base = statistics.median(s.ttft_s for s in results[cases[0]]["no_reuse"].samples)
    for case in cases:
        v = [s.ttft_s for s in results[case]["no_reuse"].samples]
        lines.append(f"| {case} | {_ms(_pct(v, 0.5))} | {_ms(_pct(v, 0.9))} "
                     f"| {statistics.median(v) / base:.2f} |")  # fmt: skip
    lines += ["", "![TTFT per turn and per question](cache.png)", ""]
    return "\n".join(lines) + "\n"


def draw(results: Results, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for case, by_workload in results.items():
        turns = _by_index(by_workload["multi_turn"].samples)
        xs = sorted(turns)
        left.plot(xs, [1000 * _pct(turns[t], 0.5) for t in xs], marker="o", label=case)
        doc = by_workload["shared_doc"].samples
        right.plot([s.index for s in doc], [1000 * s.ttft_s for s in doc], marker="o", label=case)
    left.set(title="Multi-turn chat: TTFT p50 per turn", xlabel="turn", ylabel="TTFT ms",
             yscale="log")  # fmt: skip
    left.set_xticks(sorted(_by_index(next(iter(results.values()))["multi_turn"].samples)))
    right.set(title="Shared document: TTFT per question", xlabel="question", ylabel="TTFT ms",
              yscale="log")  # fmt: skip
    for ax in (left, right):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
