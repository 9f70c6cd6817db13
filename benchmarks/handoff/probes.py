"""Why is the put slow, and what fixes it? Probes of the pool beside the handoff table.

    python -m benchmarks.handoff.probes --output /tmp/probes.md          # GPU host
    python -m benchmarks.handoff.probes --only memory --output m.md      # one section
    python -m benchmarks.handoff.probes --cpu --output /tmp/probes.md    # smoke test, tiny

Sections (benchmarks.handoff.memory, .pool_probes, .staging_probe say what each measures):
memory, value_batch, streams, prefault, staging. --allow-sysctl lets the prefault section
reserve HugeTLB pages (root; restored after). Results are rewritten to --output after every
section (and as JSON lines beside it), so a run cut short keeps what it measured; sections
that would start after --budget-s are skipped and listed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from benchmarks.handoff import pool_probes
from benchmarks.handoff.actor import Actor
from benchmarks.handoff.kv import LLAMA3_8B, TINY
from benchmarks.handoff.memory import host_facts, memory_rows
from benchmarks.handoff.pool_lab import PoolLab
from benchmarks.handoff.probe_report import render
from benchmarks.handoff.staging_probe import VARIANTS, StagingProbe

SECTIONS = ("memory", "value_batch", "prefault", "streams", "staging")
MIB, GIB = 1 << 20, 1 << 30


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.handoff.probes",
                                     description=__doc__.split("\n\n")[0])  # fmt: skip
    parser.add_argument("--cpu", action="store_true", help="no GPU parts (CPU kernel, no pinning)")
    parser.add_argument("--sizes", choices=("tiny", "full"),
                        help="tiny (smoke test, --cpu default) or full (GiB)")  # fmt: skip
    parser.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections")
    parser.add_argument("--allow-sysctl", action="store_true",
                        help="may write /proc/sys/vm/nr_hugepages (restored after)")  # fmt: skip
    parser.add_argument("--budget-s", type=float, default=1e9,
                        help="start no section after this many seconds")  # fmt: skip
    parser.add_argument("--output", type=Path, required=True)
    return parser.parse_args(argv)


def _thp_usable(facts: dict[str, str]) -> bool:
    return "[never]" not in facts["thp_enabled"] and "unreadable" not in facts["thp_enabled"]


def run_section(name: str, args: argparse.Namespace, facts: dict[str, str], emit: Any) -> None:
    tiny = args.sizes == "tiny"
    sizes = pool_probes.CPU_SIZES if tiny else pool_probes.GPU_SIZES
    log_dir = Path(tempfile.mkdtemp(prefix=f"pdrouter-probe-{name}-"))
    if name == "memory":
        touch, copy, procs = (64 * MIB, 64 * MIB, 2) if tiny else (4 * GIB, GIB, 8)
        for row in memory_rows(touch, copy, procs):
            emit({"probe": "memory", **row})
        return
    if name == "staging":
        staging(args, log_dir, emit)
        return
    lab = PoolLab(log_dir, max_workers=max(sizes.streams))
    try:
        if name == "value_batch":
            pool_probes.value_batch(lab, sizes, emit)
        elif name == "streams":
            pool_probes.streams(lab, sizes, emit, threads=(2,) if tiny else (2, 8))
        elif name == "prefault":
            pool_probes.prefault(lab, sizes, emit, args.allow_sysctl, _thp_usable(facts))
    finally:
        lab.close()


def staging(args: argparse.Namespace, log_dir: Path, emit: Any) -> None:
    """The four staging variants against one pool whose memory is already faulted in."""
    shape, block_size, blocks = (TINY, 4, 64) if args.sizes == "tiny" else (LLAMA3_8B, 16, 512)
    nbytes = blocks * shape.slot_bytes(block_size)
    probe = Actor("staging-probe", StagingProbe, (not args.cpu, shape, block_size, blocks))
    lab = PoolLab(log_dir, max_workers=1)
    try:
        with lab.pool(pool_probes.pool_bytes(nbytes)) as pool:
            value = shape.slot_bytes(block_size)
            lab.connect(pool, 1, value, num_slots=64)
            filler = pool_probes.keys("staging/filler", blocks)
            lab.op(pool, "put", [filler], 64)  # fault the owner's memory in first
            lab.remove([filler])
            for variant in VARIANTS:
                out = probe.call("run", pool=pool.where, variant=variant, batch=64, tag=variant)
                emit({"probe": "staging", "variant": variant, **out})
    finally:
        lab.close()
        probe.stop()


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    args.sizes = args.sizes or ("tiny" if args.cpu else "full")
    start = time.monotonic()
    facts = host_facts()
    command = "python -m benchmarks.handoff.probes " + shlex.join(
        sys.argv[1:] if argv is None else argv
    )
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    rows: list[dict[str, Any]] = []
    jsonl = args.output.with_suffix(".jsonl")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    jsonl.write_text("")

    def emit(row: dict[str, Any]) -> None:
        rows.append(row)
        print(json.dumps(row, default=str), flush=True)
        with jsonl.open("a") as f:
            f.write(json.dumps(row, default=str) + "\n")

    print(json.dumps({"facts": facts}), flush=True)
    for name in args.only.split(","):
        if name not in SECTIONS:
            raise SystemExit(f"unknown section {name!r}; sections: {', '.join(SECTIONS)}")
        if time.monotonic() - start > args.budget_s:
            emit({"probe": name, "note": f"skipped: over --budget-s {args.budget_s:.0f}"})
            continue
        t0 = time.monotonic()
        try:
            run_section(name, args, facts, emit)
        except Exception:
            emit({"probe": name, "note": "failed: " + traceback.format_exc()[-1500:]})
        print(f"section {name}: {time.monotonic() - t0:.1f} s", flush=True)
        args.output.write_text(render(rows, facts, command.strip(), date))
    print(f"wrote {args.output} and {jsonl}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
