"""KV handoff between workers of different TP sizes: a 2-rank P writing from two GPUs, a 1-rank
D reading on one, against a 1-rank P and D on the same pool (the baseline).

    python -m benchmarks.handoff.tp           # GPU host (2 GPUs), 8B shape: its section of
                                              # docs/benchmarks/handoff.md
    python -m benchmarks.handoff.tp --cpu --output /tmp/tp.md    # no GPU: tiny shape, numpy
    python -m benchmarks.handoff.tp --reader-tp 2   # a 1-rank P -> a 2-rank D (one or two
                                                  # GPUs): the cut of D's heads out of P's
                                                  # whole-block shard, its own section

Every rank is a process of its own (benchmarks.handoff.actor) with the workers' KVPoolClient
over shared memory, its staging page-locked on a GPU, and the workers' per-rank functions
(workers/engine/tp/rank_io.py): P rank r writes its KV heads [4r, 4r + 4) of each block
under the shard key naming them; D (all 8 heads) reads the two shards of each block into
its heads through a view of its cache (two copies per block, half a block each). The P
ranks write at once; D reads after both ended; D checks every byte of every block against
the whole cache P's ranks were cut from.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.handoff.actor import Actor
from benchmarks.handoff.kv import LLAMA3_8B, TINY, KvShape, pattern, scattered_ids
from benchmarks.handoff.tp_cut import CUT_SECTION, cut_routes, render_cut
from benchmarks.machine import device_name, gpu_missing
from benchmarks.table_file import publish_section
from workers.pool.keys import block_keys

GPU_TOKENS, CPU_TOKENS = "4096,16384", "256"
DEFAULT_OUT = Path(__file__).resolve().parents[2] / "docs" / "benchmarks" / "handoff.md"
SECTION = "handoff-tp"
PROSE = """## Tensor parallel: a 2-rank P on two GPUs, a 1-rank D on one

Llama-3-8B's KV shape (32 layers, 8 KV heads, head dim 128, 2-byte elements), block size 16,
host staging (page-locked) over same-host shared memory, one pool owner. P of TP size 2: two
processes, rank r on GPU r holding KV heads [4r, 4r + 4); each writes its half of every block
under the shard key naming its heads (`h0-4of8`, `h4-8of8`), both at once. D of TP size 1
(all 8 heads, GPU 0) reads both shards of each block into its heads through views of its
cache (`workers/engine/tp/rank_io.py`: two copies and two pool objects per block, half a
block each). The baseline: P and D of TP size 1 through the same pool, the same blocks. Every
byte of every block D holds is checked against the whole cache P's ranks were cut from.
Scattered block ids on both sides and a partial last block; rep 0 is cold (first use of the
pool's memory and of each client's staging)."""


class Rank:
    """One rank of P or D in its own process: its heads of the cache, its pool client."""

    def __init__(self, gpu: bool, device: int, shape: KvShape, heads: tuple[int, int, int]) -> None:
        from workers.engine.tp.shards import HeadRange

        self.gpu, self.device, self.shape = gpu, device, shape
        self.own = HeadRange(*heads)
        if gpu:
            from kernels.cuda_swap import import_cupy

            self.xp = import_cupy()
            self.device = device % self.xp.cuda.runtime.getDeviceCount()  # one GPU: all on it
            self.xp.cuda.Device(self.device).use()
        else:
            import numpy

            self.xp = numpy
        self.tensors: list[Any] = []
        self.client: Any = None
        self.registration: Any = None

    def setup(self, pool: dict[str, str], num_blocks: int, block_size: int, slots: int) -> None:
        """A cache of this rank's heads (P's filled from the whole pattern) and a client."""
        from workers.pool.client import KVPoolClient, PoolClientConfig

        s, xp = self.shape, self.xp
        whole = (num_blocks, s.num_kv_heads, block_size, s.head_dim)
        self.tensors = []
        for t in range(s.num_tensors):
            full = pattern(xp, t, num_blocks * s.num_kv_heads * block_size * s.head_dim)
            part = full.reshape(whole)[:, self.own.start : self.own.end]
            self.tensors.append(xp.ascontiguousarray(part))
        config = PoolClientConfig(
            master_addr=pool["master_addr"], metadata_url=pool["metadata_url"],
            owner_addr=pool["owner_addr"], num_slots=slots,
            slot_bytes=s.slot_bytes(block_size), call_timeout_s=120.0,
            cuda_device=self.device if self.gpu else None,
        )  # fmt: skip
        self.client = KVPoolClient(config).connect()
        if self.gpu:
            from kernels.pinned_host import HostRegistration

            buffer = self.client.buffer
            self.registration = HostRegistration(buffer.ptr, buffer.nbytes)

    def write(self, ids: list[int], keys: list[str], group: int) -> float:
        from workers.engine.tp.rank_io import write_rank

        t0 = time.perf_counter()
        out = write_rank(
            self.client, self.tensors, self.own, ids, keys, group, time.monotonic() + 60.0
        )
        assert all(r.ok for r in out.results), [r.error() for r in out.results if not r.ok]
        return time.perf_counter() - t0

    def read(self, writer_tp: int, ids: list[int], keys: list[str], group: int) -> float:
        from workers.engine.tp.rank_io import read_rank

        for tensor in self.tensors:
            tensor[...] = 0
        self._sync()
        t0 = time.perf_counter()
        out = read_rank(
            self.client,
            self.tensors,
            self.own,
            writer_tp,
            ids,
            keys,
            group,
            time.monotonic() + 60.0,
        )
        self._sync()
        assert out.num_loaded == len(keys), (out.num_loaded, out.missing_keys)
        return time.perf_counter() - t0

    def holds(self, ids: list[int], source_ids: list[int], num_blocks: int, bs: int) -> bool:
        """Every byte of block ids[j] is the whole pattern's block source_ids[j]."""
        s, xp = self.shape, self.xp
        whole = (num_blocks, s.num_kv_heads, bs, s.head_dim)
        dst, src = xp.asarray(ids), xp.asarray(source_ids)
        for t, tensor in enumerate(self.tensors):
            full = pattern(xp, t, num_blocks * s.num_kv_heads * bs * s.head_dim).reshape(whole)
            if not bool(xp.array_equal(tensor[dst], full[src][:, self.own.start : self.own.end])):
                return False
        return True

    def _sync(self) -> None:
        if self.gpu:
            self.xp.cuda.Device(self.device).synchronize()

    def close(self) -> None:
        self._sync()
        self.client.close()
        if self.registration is not None:
            self.registration.close()


def _case(ps: list[Actor], ds: list[Actor], prefix: str, tokens: int,
          args: argparse.Namespace, num_blocks: int) -> dict[str, float]:  # fmt: skip
    bs = args.block_size
    keys = block_keys(prefix, list(range(tokens - 3)), bs)
    p_ids = scattered_ids(num_blocks, len(keys), seed=tokens)
    d_ids = scattered_ids(num_blocks, len(keys), seed=tokens + 1)
    t0 = time.perf_counter()
    for p in ps:
        p.send("write", ids=p_ids, keys=keys, group=args.group_blocks)
    ranks_s = [p.result() for p in ps]
    write_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for d in ds:  # D's ranks read at once
        d.send("read", writer_tp=len(ps), ids=d_ids, keys=keys, group=args.group_blocks)
    max(d.result() for d in ds)
    read_s = time.perf_counter() - t0
    exact = all(d.call("holds", ids=d_ids, source_ids=p_ids, num_blocks=num_blocks, bs=bs)
                for d in ds)  # fmt: skip
    return {"blocks": len(keys), "write_s": write_s, "rank_max_s": max(ranks_s),
            "read_s": read_s, "exact": exact}  # fmt: skip


def run(args: argparse.Namespace) -> list[str]:
    from workers.pool.local_pool import LocalPool

    shape = TINY if args.cpu else LLAMA3_8B
    h = shape.num_kv_heads
    num_blocks = max(args.tokens) // args.block_size + 1
    lines = []
    with (
        tempfile.TemporaryDirectory() as logs,
        LocalPool(args.pool_bytes, log_dir=Path(logs)) as pool,
    ):
        addrs = {"master_addr": pool.addresses.master_addr,
                 "metadata_url": pool.addresses.metadata_url,
                 "owner_addr": pool.addresses.owner_addr}  # fmt: skip
        gpu = not args.cpu
        two = [(gpu, r, shape, (r * h // 2, (r + 1) * h // 2, h)) for r in range(2)]
        actors = {
            "p1": [Actor("p1", Rank, (gpu, 0, shape, (0, h, h)))],
            "d": [Actor("d1", Rank, (gpu, 0, shape, (0, h, h)))],
        }
        if args.reader_tp == 2:  # P tp=1 -> D tp=1 (baseline) and P tp=1 -> D tp=2
            actors["d2"] = [Actor(f"d2-r{r}", Rank, two[r]) for r in range(2)]
        else:  # P tp=1 (baseline) and P tp=2 -> D tp=1
            actors["p2"] = [Actor(f"p2-r{r}", Rank, two[r]) for r in range(2)]
        every = [a for group in actors.values() for a in group]
        try:
            for a in every:
                a.send("setup", pool=addrs, num_blocks=num_blocks, block_size=args.block_size,
                       slots=args.staging_slots)  # fmt: skip
            for a in every:
                a.result()
            for tokens in args.tokens:
                for rep in range(args.reps):
                    for name in ("p1", "p2", "d2"):
                        if name not in actors:
                            continue
                        ps = actors["p1"] if name == "d2" else actors[name]
                        ds = actors["d2"] if name == "d2" else actors["d"]
                        r = _case(ps, ds, f"{name}-{tokens}-{rep}", tokens, args, num_blocks)
                        lines.append(_row(name, tokens, rep, r, shape, args.block_size))
                        print(lines[-1], flush=True)
        finally:
            for a in every:
                a.stop()
    return lines


def _row(name: str, tokens: int, rep: int, r: dict[str, float], shape: KvShape, bs: int) -> str:
    mib = r["blocks"] * shape.slot_bytes(bs) / 2**20
    hand_s = r["write_s"] + r["read_s"]
    pairing = {"p1": "1 rank -> 1 rank", "p2": "2 ranks, 2 GPUs -> 1 rank",
               "d2": "1 rank -> 2 ranks (cut)"}[name]  # fmt: skip
    return (
        f"| {tokens} | {pairing} | {rep} | "
        f"{r['blocks']} | {mib:.1f} | {r['write_s'] * 1e3:.1f} | {r['read_s'] * 1e3:.1f} | "
        f"{hand_s * 1e3:.1f} | {mib / 1024 / hand_s:.2f} | {'yes' if r['exact'] else 'NO'} |"
    )


HEADER = (
    "| tokens | P -> D | rep | blocks | KV MiB | P write ms (ranks at once) | D read ms "
    "| handoff ms | GiB/s | byte-exact |\n" + "|---" * 10 + "|"
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.handoff.tp", description=__doc__)
    parser.add_argument("--cpu", action="store_true", help="numpy caches, tiny shape (smoke)")
    parser.add_argument("--tokens", help=f"default {GPU_TOKENS} (--cpu {CPU_TOKENS})")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--group-blocks", type=int, default=64)
    parser.add_argument("--staging-slots", type=int, default=128)
    parser.add_argument("--reps", type=int, default=2, help="rep 0 is cold, the rest warm")
    parser.add_argument("--pool-bytes", type=int, default=12 << 30)
    parser.add_argument(
        "--reader-tp",
        type=int,
        choices=(1, 2),
        default=1,
        help="2: a 1-rank P -> a 2-rank D (the head cut), its own section",
    )
    parser.add_argument("--output", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if not args.cpu and (missing := gpu_missing()):
        print(f"no GPU ({missing}); use --cpu", file=sys.stderr)
        return 2
    args.tokens = [
        int(t) for t in (args.tokens or (CPU_TOKENS if args.cpu else GPU_TOKENS)).split(",")
    ]
    if args.cpu:
        args.pool_bytes = min(args.pool_bytes, 256 << 20)
    lines = run(args)
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    command = "python -m benchmarks.handoff.tp " + " ".join(argv or sys.argv[1:])
    device = device_name(not args.cpu)
    if args.reader_tp == 2:
        routes = [] if args.cpu else cut_routes(args.tokens, args.block_size)
        text = render_cut(lines, routes, HEADER, when, device, command)
        publish_section(args.output, CUT_SECTION, text)
    else:
        publish_section(args.output, SECTION, render(lines, when, device, command))
    return 0


def render(lines: list[str], when: str, device: str, command: str) -> str:
    return f"{PROSE}\n\n{when}, {device}: `{command}`\n\n{HEADER}\n" + "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
