"""The eviction-pressure table (docs/benchmarks/cache_eviction.md) and its targets:
device+host+pool TTFT p50 on revisits at most 0.7x device+pool's; write_through_selective at
most half the host-tier bytes of write_through at no worse than 1.1x its revisit TTFT p50."""

from __future__ import annotations

import argparse
import os
import platform
import time
from typing import Any

from benchmarks.cache.report import _ms, _pct
from benchmarks.machine import cpu_name

MIB = 1 << 20


def _row(case: str, r: Any) -> str:
    src = r.by_source
    sources = " / ".join(f"{src.get(s, 0):.0f}" for s in ("device", "host", "pool", "computed"))
    host = r.host
    return (f"| {case} | {_ms(_pct(r.revisit_ttft_s, 0.5))} | {_ms(_pct(r.revisit_ttft_s, 0.9))}"
            f" | {_ms(_pct(r.ttft_s, 0.5))} | {_ms(_pct(r.ttft_s, 0.9))} | {sources} | "
            f"{host['copy_bytes'] / MIB:.1f} | {host['read_bytes'] / MIB:.1f} | "
            f"{host['evictions']:.0f} |")  # fmt: skip


def _p50(results: dict[str, Any], case: str) -> float | None:
    r = results.get(case)
    return _pct(r.revisit_ttft_s, 0.5) if r is not None and r.revisit_ttft_s else None


def _targets(results: dict[str, Any]) -> list[str]:
    lines = []
    pool = _p50(results, "device+pool")
    for case in results:
        host = _p50(results, case)
        if case.startswith("+host") and pool and host is not None:
            ratio = host / pool
            verdict = "met" if ratio <= 0.7 else "NOT met"
            lines.append(f"- {case}: revisit TTFT p50 {ratio:.2f}x device+pool's "
                         f"(target <= 0.7x: {verdict})")  # fmt: skip
    wt, sel = results.get("+host write_through"), results.get("+host write_through_selective")
    if wt is not None and sel is not None and wt.host["copy_bytes"]:
        bytes_ratio = sel.host["copy_bytes"] / wt.host["copy_bytes"]
        wt_p50, sel_p50 = (
            _p50(results, "+host write_through"),
            _p50(results, "+host write_through_selective"),
        )
        ttft_ratio = sel_p50 / wt_p50 if wt_p50 and sel_p50 is not None else float("nan")
        verdict = "met" if bytes_ratio <= 0.5 and ttft_ratio <= 1.1 else "NOT met"
        lines.append(f"- write_through_selective: {bytes_ratio:.2f}x write_through's host bytes "
                     f"at {ttft_ratio:.2f}x its revisit TTFT p50 (target <= 0.5x at <= 1.1x: "
                     f"{verdict})")  # fmt: skip
    return lines


def render(results: dict[str, Any], command: str, args: argparse.Namespace) -> str:
    prefix_blocks = args.kv_blocks * 3 // 2 // args.prefixes
    lines = [
        "# Eviction pressure: the host tier against the device cache and the pool",
        "",
        f"`{command}` ({time.strftime('%Y-%m-%d')}, {cpu_name()}, {os.cpu_count()} CPUs, "
        f"{platform.python_version()}). 1 P + 1 D, {args.kv_blocks} KV blocks of 16 tokens "
        f"each; {args.prefixes} prefixes of {prefix_blocks} blocks (1.5x the device cache), "
        f"{args.rounds} rounds x {args.visits} requests per prefix, each with a unique "
        f"{args.question_tokens}-token question; host tier `--swap-space {args.swap_space}` "
        "GiB on both workers where on. One request at a time, greedy, 16 output tokens.",
        "",
        "Revisits: the first request of a prefix in rounds 2+ (P's device cache lost it). "
        "Tokens by source: P's `pdworker_prompt_tokens_by_source_total` "
        "(device / host / pool / computed). Host traffic: P + D, MiB copied device -> host "
        "(write policy) and host -> device (swap-ins).",
        "",
        "| case | revisit TTFT p50 ms | p90 ms | all TTFT p50 ms | p90 ms | "
        "tokens device / host / pool / computed | host writes MiB | host reads MiB | "
        "host evictions |",
        "|---|---|---|---|---|---|---|---|---|",
        *(_row(case, r) for case, r in results.items()),
        "",
        "Targets:",
        "",
        *(_targets(results) or ["- (run device+pool and the host cases to compare)"]),
        "",
    ]
    return "\n".join(lines)
