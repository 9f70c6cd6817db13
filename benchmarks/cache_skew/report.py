"""The skew benchmark's table (docs/benchmarks/cache_skew.md) and figure (cache_skew.png).

TTFT p50 / p90   over every turn of every conversation, as the client measured it
hit rate         prompt tokens by source (router counts): device, pool, computed
P load           each prefill instance's requests in flight (the router's gauge), averaged
                 over the run's samples; balance = busiest / idlest
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from pathlib import Path

from benchmarks.cache_skew.workload import SkewResult
from benchmarks.machine import cpu_name

BASELINE = "round_robin"


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def mean_loads(result: SkewResult) -> dict[str, float]:
    """Each P's requests in flight, averaged over the samples."""
    urls = sorted({url for _, loads in result.loads for url in loads})
    return {
        url: statistics.fmean(loads.get(url, 0.0) for _, loads in result.loads)
        if result.loads
        else 0.0
        for url in urls
    }


def balance(result: SkewResult) -> float:
    """Busiest P's mean load over the idlest's (inf when one was idle throughout)."""
    loads = list(mean_loads(result).values())
    if not loads or max(loads) == 0:
        return 1.0
    return max(loads) / min(loads) if min(loads) > 0 else float("inf")


def row(case: str, r: SkewResult, base_p90: float | None) -> str:
    ttfts = [t.ttft_s for t in r.turns]
    p50, p90 = 1000 * pct(ttfts, 0.5), 1000 * pct(ttfts, 0.9)
    src = r.by_source
    total = sum(src.values()) or 1.0
    loads = " / ".join(f"{v:.2f}" for v in mean_loads(r).values())
    gain = "" if base_p90 is None else f"{1 - p90 / base_p90:+.0%}"
    return (
        f"| {case} | {p50:.0f} | {p90:.0f} | {gain} | {src['device'] / total:.0%} | "
        f"{src['pool'] / total:.0%} | {src['computed'] / total:.0%} | {loads} | "
        f"{balance(r):.2f} | {r.wall_s:.1f} |"
    )


def render(results: dict[str, SkewResult], command: str, settings: str) -> str:
    base = results.get(BASELINE)
    base_p90 = None if base is None else 1000 * pct([t.ttft_s for t in base.turns], 0.9)
    lines = [
        "# Skew and scale: round robin vs the load-aware cache policy (2 P + 2 D)",
        "",
        f"Command: `{command}`  ",
        f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}  ",
        f"Machine: {cpu_name()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
        "the 2 P, 2 D, pool and router share these cores with the client.  ",
        settings,
        "",
        "Each case is a fresh cluster (master, pool owner, 2 P, 2 D, router) with the router's "
        "`--prefill-policy` (cache_aware@W: with `--cache-load-weight W`). TTFT by the "
        "openai client; tokens by source are the router's counts; P load is the router's "
        "requests in flight per P, averaged over the run (balance: busiest / idlest). "
        "Target: cache_aware's p90 at least 20% under round robin's, balance at most 1.5.",
        "",
        "| case | TTFT p50 ms | p90 ms | p90 vs round robin | device | pool | computed "
        "| P mean in flight | balance | wall s |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    lines += [row(case, r, None if case == BASELINE else base_p90) for case, r in results.items()]
    lines += ["", "![P loads over time per case](cache_skew.png)", ""]
    return "\n".join(lines) + "\n"


def draw(results: dict[str, SkewResult], path: Path) -> None:
    """One panel per case: each P's requests in flight over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        1, len(results), figsize=(4.2 * len(results), 3.4), squeeze=False, sharey=True
    )
    for ax, (case, r) in zip(axes[0], results.items(), strict=True):
        for i, url in enumerate(mean_loads(r)):
            xs = [t for t, _ in r.loads]
            ax.plot(xs, [loads.get(url, 0.0) for _, loads in r.loads], label=f"P{i}", lw=1)
        ax.set(title=f"{case} (balance {balance(r):.2f})", xlabel="s")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("requests in flight")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
