"""The whole KV handoff of a prompt, P -> pool -> D, stage by stage, on a GPU host.

    python -m benchmarks.handoff                  # GPU host: writes docs/benchmarks/handoff.md
    python -m benchmarks.handoff --cpu --output /tmp/handoff.md   # no GPU: tiny, numpy
    python -m benchmarks.handoff --path host --output /tmp/host.md  # through host staging

Starts a real mooncake_master and pool owner per prompt (workers.pool.local_pool.LocalPool),
P and D in their own processes, each with the workers' KVPoolClient over shared memory, and
measures D2H (swap_cache_layout mode 0 into staging), put, get and H2D (mode 1) with
scattered block ids and a partial last block, checking every byte on D; then, on the same
bytes, a pinned bulk cudaMemcpyAsync each way and a host memcpy. Needs the Mooncake wheel
(and, on a GPU, CuPy). Why the put is slow: docs/benchmarks/handoff_probes.md.
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import sys
import tempfile
from pathlib import Path

from benchmarks.handoff.kv import LLAMA3_8B, TINY
from benchmarks.handoff.paths import MODES
from benchmarks.handoff.report import render, write
from benchmarks.handoff.table import TableConfig, run_table
from benchmarks.machine import device_name, gpu_missing

DEFAULT_OUT = Path(__file__).resolve().parents[2] / "docs" / "benchmarks" / "handoff.md"
GPU_TOKENS, CPU_TOKENS = "1024,4096,16384,32768", "64,256"
GPU_BLOCKS, CPU_BLOCKS = "16,64", "4,16"
TITLE = "KV handoff through the pool"


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.handoff", description=__doc__)
    parser.add_argument(
        "--cpu", action="store_true", help="numpy caches, CPU kernel, tiny sizes (smoke test)"
    )
    parser.add_argument("--tokens", type=_ints, help=f"prompt sizes (default {GPU_TOKENS}; "
                        f"--cpu {CPU_TOKENS}); each prompt is 3 tokens shorter")  # fmt: skip
    parser.add_argument("--block-sizes", type=_ints,
                        help=f"default {GPU_BLOCKS} (tiny shape: {CPU_BLOCKS})")  # fmt: skip
    parser.add_argument(
        "--mode", choices=sorted(MODES), default="pipelined", help="pipelined: the workers' path"
    )
    parser.add_argument(
        "--group-blocks", type=int, default=64, help="blocks a swap + pool call (pdworker default)"
    )
    parser.add_argument("--staging-slots", type=int, default=256)
    parser.add_argument(
        "--path",
        choices=("host", "device"),
        help="device pointers (the default on a GPU: Mooncake's CUDA wheel, a GPU worker's "
        "--handoff-path device), or host staging (the default with --cpu)",
    )
    parser.add_argument(
        "--device-calls", type=int, default=4, help="device path: concurrent calls per batch"
    )
    parser.add_argument("--owner-threads", type=int, default=8, help="pdworker pool --threads")
    parser.add_argument(
        "--no-prefault", action="store_true", help="pool owner without pre-faulting (cold pool)"
    )
    parser.add_argument("--warm-reps", type=int, default=3)
    parser.add_argument("--shape", choices=("llama3-8b", "tiny"),
                        help="KV shape (default llama3-8b; tiny with --cpu)")  # fmt: skip
    parser.add_argument("--output", type=Path, default=DEFAULT_OUT)
    return parser.parse_args(argv)


def config(args: argparse.Namespace, log_dir: Path) -> TableConfig:
    shape = {"llama3-8b": LLAMA3_8B, "tiny": TINY}[
        args.shape or ("tiny" if args.cpu else "llama3-8b")
    ]
    return TableConfig(
        gpu=not args.cpu,
        shape=shape,
        tokens=args.tokens or _ints(CPU_TOKENS if args.cpu else GPU_TOKENS),
        block_sizes=args.block_sizes or _ints(CPU_BLOCKS if shape == TINY else GPU_BLOCKS),
        mode=args.mode,
        group_blocks=args.group_blocks,
        staging_slots=args.staging_slots,
        warm_reps=args.warm_reps,
        prefault=not args.no_prefault,
        log_dir=log_dir,
        path=args.path or ("host" if args.cpu else "device"),
        device_calls=args.device_calls,
        owner_threads=args.owner_threads,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if not args.cpu and (why := gpu_missing()):
        print(f"benchmarks.handoff: skipped, needs an NVIDIA GPU with CuPy ({why}); --cpu runs "
              "it on the CPU")  # fmt: skip
        return 0
    log_dir = Path(tempfile.mkdtemp(prefix="pdrouter-handoff-"))
    cfg = config(args, log_dir)
    command = "python -m benchmarks.handoff " + shlex.join(sys.argv[1:] if argv is None else argv)
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(f"{command}: logs under {log_dir}", flush=True)
    device = device_name(cfg.gpu)

    def save(rows: list) -> None:  # after every prompt: a run cut short keeps its rows
        write(args.output, render(cfg, rows, command.strip(), device, date), TITLE)

    rows = run_table(cfg, log=lambda msg: print(msg, flush=True), on_row=save)
    print(render(cfg, rows, command.strip(), device, date))
    print(f"wrote {args.output}")
    ok = all(not r.error and all(p["exact"] for p in r.passes.values()) for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
