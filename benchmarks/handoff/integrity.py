"""What the pool objects' integrity check costs a handoff: the same P, D and pool, passes
with and without it, alternated.

    python -m benchmarks.handoff.integrity                        # GPU host, device pointers
    python -m benchmarks.handoff.integrity --path host            # GPU host, host staging
    python -m benchmarks.handoff.integrity --cpu --output /tmp/i.md   # no GPU: tiny, numpy

For each prompt one LocalPool and one P and D process (benchmarks/handoff/side.py); then
1 + reps rounds of two passes, off and on (their order flips every round, so neither always
runs on a warmer pool): P writes, D reads and checks every byte, D removes the keys. "on"
goes through workers.pool.checked_pool.CheckedPool as a worker with --pool-integrity on:
P seals a header per block (its payload's checksum: xxh3 on host staging, the GPU word sum
on device staging, computed while the payloads are put), then puts the headers (a group's
behind the next group's payloads); D gets both and checks them. --read-parts and
--header-calls set CheckedPool's concurrent calls, to compare them; the table's cost is
that of the defaults unless the command line names others.
The first round is dropped (cold); the table has the median of the rest. Writes the
"Integrity" section of docs/benchmarks/handoff.md.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
from pathlib import Path
from typing import Any

from benchmarks.handoff.__main__ import DEFAULT_OUT, config
from benchmarks.handoff.actor import Actor
from benchmarks.handoff.kv import Prompt, scattered_ids
from benchmarks.handoff.side import Side
from benchmarks.handoff.table import MIB, TableConfig, segment_bytes
from benchmarks.machine import device_name, gpu_missing
from benchmarks.table_file import write_section
from workers.pool.checked_pool import READ_PARTS
from workers.pool.header_calls import HEADER_CALLS


def markers(path: str) -> tuple[str, str]:
    """The markers of one path's table in the output file (each path keeps its own)."""
    return f"<!-- handoff-integrity-{path}:begin -->", f"<!-- handoff-integrity-{path}:end -->"


HEAD = (
    "| prompt | block | MiB | handoff off ms | handoff on ms | cost | write off / on ms | "
    "read off / on ms | exact |\n|---|---|---|---|---|---|---|---|---|"
)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.handoff.integrity", description=__doc__
    )
    parser.add_argument("--cpu", action="store_true", help="numpy caches, tiny shape")
    parser.add_argument("--tokens", default="", help="prompt sizes (default 4096; --cpu 256)")
    parser.add_argument("--block-sizes", default="16", help="block sizes")
    parser.add_argument("--path", choices=("host", "device"), help="default: device on a GPU")
    parser.add_argument("--reps", type=int, default=5, help="warm rounds (each: off and on)")
    parser.add_argument(
        "--read-parts",
        type=int,
        default=READ_PARTS,
        help="concurrent gets a host-staging batch is split over",
    )
    parser.add_argument(
        "--header-calls",
        type=int,
        default=HEADER_CALLS,
        help="concurrent calls a batch of headers is split over",
    )
    parser.add_argument("--owner-threads", type=int, default=8, help="pdworker pool --threads")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUT)
    return parser.parse_args(argv)


def _one_pass(cfg: TableConfig, p: Actor, d: Actor, prompt: Prompt, ids: Any, tag: str,
              integrity: bool) -> dict[str, Any]:  # fmt: skip
    p_ids, d_ids = ids
    keys = prompt.keys(f"integrity/bs{prompt.block_size}/{prompt.label}/{tag}")
    group = cfg.group_blocks
    d.call("reset", block_ids=d_ids)
    w = p.call("write", mode="pipelined", keys=keys, block_ids=p_ids, group=group,
               integrity=integrity)  # fmt: skip
    r = d.call("read", mode="pipelined", keys=keys, block_ids=d_ids, source_ids=p_ids,
               group=group, integrity=integrity)  # fmt: skip
    removed = d.call("remove", keys=keys, integrity=integrity)
    assert removed == len(keys), "not every key was removed"
    wall = w["write_wall_s"] + r["read_wall_s"]
    return {"write_s": w["write_wall_s"], "read_s": r["read_wall_s"], "wall_s": wall,
            "exact": r["exact"]}  # fmt: skip


def measure(cfg: TableConfig, prompt: Prompt, reps: int, checked: dict[str, int],
            log: Any = print) -> dict[str, Any]:  # fmt: skip
    """Median warm passes off and on for one prompt (fresh P, D and pool)."""
    from workers.pool.local_pool import LocalPool

    n = prompt.num_blocks
    cache_blocks = n + n // 4 + 1
    ids = (scattered_ids(cache_blocks, n, seed=1), scattered_ids(cache_blocks, n, seed=2))
    side_args = (cfg.gpu, cfg.shape, cfg.path, cfg.device_calls)
    p = Actor("prefill", Side, ("prefill", *side_args))
    d = Actor("decode", Side, ("decode", *side_args))
    slot_bytes = cfg.shape.slot_bytes(prompt.block_size)
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    try:
        for side in (p, d):
            side.call("alloc", num_blocks=cache_blocks, block_size=prompt.block_size)
        log_dir = cfg.log_dir / f"integrity-bs{prompt.block_size}-{prompt.label}"
        with LocalPool(segment_bytes(n * (slot_bytes + 64)), log_dir=log_dir,
                       owner_threads=cfg.owner_threads) as pool:  # fmt: skip
            a = pool.addresses
            where = {"master_addr": a.master_addr, "metadata_url": a.metadata_url,
                     "owner_addr": a.owner_addr, "owner_pid": str(pool.owner.pid)}  # fmt: skip
            for side in (p, d):
                side.call("connect", pool=where, num_slots=max(cfg.staging_slots, cfg.group_blocks),
                          slot_bytes=slot_bytes, checked=checked)  # fmt: skip
            for rnd in range(1 + reps):
                order = ("off", "on") if rnd % 2 else ("on", "off")
                for name in order:
                    result = _one_pass(cfg, p, d, prompt, ids, f"{rnd}{name}", name == "on")
                    log(f"  {prompt.label} bs{prompt.block_size} round {rnd} {name}: "
                        f"{result['wall_s'] * 1e3:.2f} ms exact {result['exact']}")  # fmt: skip
                    if rnd:
                        runs[name].append(result)
            for side in (p, d):
                side.call("disconnect")
    finally:
        p.stop()
        d.stop()
    return {name: _median(passes) for name, passes in runs.items()}


def _median(passes: list[dict[str, Any]]) -> dict[str, Any]:
    out = {k: statistics.median(p[k] for p in passes) for k in ("write_s", "read_s", "wall_s")}
    return {**out, "exact": all(p["exact"] for p in passes)}


def render(cfg: TableConfig, rows: list[tuple[Prompt, dict[str, Any]]], command: str) -> str:
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    where = f"{device_name(cfg.gpu)}, {date}; path {cfg.path}, groups of {cfg.group_blocks}"
    begin, end = markers(cfg.path)
    lines = [begin, f"`{command}` on {where} blocks; median of the warm rounds.", "", HEAD]
    for prompt, m in rows:
        off, on = m["off"], m["on"]
        cost = on["wall_s"] / off["wall_s"] - 1
        mib = prompt.num_blocks * cfg.shape.slot_bytes(prompt.block_size) / MIB
        lines.append(
            f"| {prompt.label} | {prompt.block_size} | {mib:.0f} | {off['wall_s'] * 1e3:.2f} | "
            f"{on['wall_s'] * 1e3:.2f} | {cost * 100:+.1f}% | {off['write_s'] * 1e3:.2f} / "
            f"{on['write_s'] * 1e3:.2f} | {off['read_s'] * 1e3:.2f} / {on['read_s'] * 1e3:.2f} "
            f"| {off['exact'] and on['exact']} |"
        )
    return "\n".join([*lines, end])


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if not args.cpu and (why := gpu_missing()):
        print(f"benchmarks.handoff.integrity: skipped, needs a GPU ({why}); --cpu runs it")
        return 0
    base = (["--cpu"] if args.cpu else []) + ["--owner-threads", str(args.owner_threads)]
    if args.path:
        base += ["--path", args.path]
    cfg = config(
        _base_args(base), Path(f"/tmp/pdrouter-integrity-{datetime.datetime.now():%H%M%S}")
    )
    tokens = [int(t) for t in (args.tokens or ("256" if args.cpu else "4096")).split(",")]
    rows = []
    for bs in (int(b) for b in args.block_sizes.split(",")):
        for n in tokens:
            prompt = Prompt(n, bs)
            checked = {"read_parts": args.read_parts, "header_calls": args.header_calls}
            rows.append((prompt, measure(cfg, prompt, args.reps, checked)))
    command = "python -m benchmarks.handoff.integrity " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    text = render(cfg, rows, command.strip())
    print(text)
    write_section(args.output, text, *markers(cfg.path))
    ok = all(m["off"]["exact"] and m["on"]["exact"] for _, m in rows)
    return 0 if ok else 1


def _base_args(extra: list[str]) -> argparse.Namespace:
    from benchmarks.handoff.__main__ import parse as parse_handoff

    return parse_handoff(extra)


if __name__ == "__main__":
    raise SystemExit(main())
