"""Would more pool owners per host copy faster? One owner against two, same master.

    python -m benchmarks.handoff.owners_probe [--mib 512] [--output FILE]

A same-host put or get through the shared-memory transport is copied by the owner that
holds the object's segment, on a pool of one thread (Mooncake's MemcpyWorkerPool,
kDefaultMemcpyWorkers = 1 in mooncake-store/src/transfer_task.cpp), so one owner moves about
one host memcpy whatever the number of clients or calls (docs/benchmarks/handoff_probes.md).
This probe starts a master and two `pdworker pool` owners, one shared-memory client attached
to each (A to owner A, B to owner B) and a second client on owner A (A2), and times batch puts
and gets of --mib MiB in 2 MiB values placed with ReplicateConfig.preferred_segment:
- each client alone, into its own owner's segment and into the other's;
- A and A2 at once into owner A (one owner, two streams);
- A and B at once, each into its own owner (two owners, two streams).
No GPU needed; the numbers that matter come from a host with many cores (the GPU host).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx

from benchmarks.machine import cpu_name
from benchmarks.table_file import publish
from workers.pool.client import KVPoolClient, PoolClientConfig
from workers.pool.local_pool import LocalPool

VALUE = 2 << 20
_serial = iter(range(1 << 30))


def segments(pool: LocalPool) -> list[str]:
    text = httpx.get(f"{pool.addresses.admin_url}/get_all_segments", timeout=10).text
    return [line.strip() for line in text.splitlines() if line.strip()]


def client(pool: LocalPool, owner_port: int, num_slots: int) -> KVPoolClient:
    a = pool.addresses
    config = PoolClientConfig(master_addr=a.master_addr, metadata_url=a.metadata_url,
                              owner_addr=f"127.0.0.1:{owner_port}", num_slots=num_slots,
                              slot_bytes=VALUE)  # fmt: skip
    return KVPoolClient(config).connect()


def move(c: KVPoolClient, op: str, keys: list[str], segment: str) -> None:
    """One batch put (placed on segment) or get of keys from c's staging, raw Mooncake."""
    from mooncake.store import ReplicateConfig

    ptrs = [c.buffer.ptr + i * VALUE for i in range(len(keys))]
    sizes = [VALUE] * len(keys)
    store: Any = c._store  # the probe needs the placement the client does not offer
    if op == "put":
        config = ReplicateConfig()
        config.replica_num = 1
        config.preferred_segment = segment
        codes = store.batch_put_from(keys, ptrs, sizes, config)
    else:
        codes = store.batch_get_into(keys, ptrs, sizes)
    assert min(codes) >= 0, (op, segment, sorted(set(codes))[:4])


def timed(jobs: list[Callable[[], None]]) -> float:
    """Seconds for jobs run at once, one thread each."""
    threads = [threading.Thread(target=job) for job in jobs]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def case(name: str, streams: list[tuple[KVPoolClient, str]], n: int) -> dict[str, Any]:
    """Put then get n values per stream, the streams at once; GB/s over all bytes."""
    tag = next(_serial)
    keys = [[f"owners/{tag}/{s}/{i}" for i in range(n)] for s in range(len(streams))]
    row: dict[str, Any] = {"case": name}
    for op in ("put", "get"):
        jobs = [
            (lambda c=c, seg=seg, k=k, op=op: move(c, op, k, seg))
            for (c, seg), k in zip(streams, keys, strict=True)
        ]
        row[op] = len(streams) * n * VALUE / timed(jobs) / 1e9
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=512, help="bytes per stream and operation")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--output", default="")
    args = ap.parse_args(argv)
    n = args.mib * (1 << 20) // VALUE
    size = (4 * args.reps + 6) * n * VALUE  # every case's keys stay: fresh memory per owner
    rows: list[dict[str, Any]] = []
    with LocalPool(size) as pool_a:
        pool_b = LocalPool(size, log_dir=pool_a.log_dir / "b")
        pool_b.master = pool_a.master  # the second owner joins the same master
        pool_b.start_owner()
        try:
            seg_a_b = segments(pool_a)
            assert len(seg_a_b) == 2, seg_a_b
            a, a2 = client(pool_a, pool_a.owner_port, n), client(pool_a, pool_a.owner_port, n)
            b = client(pool_a, pool_b.owner_port, n)
            # Which segment is whose: the faster put of A alone is into its own owner's.
            probe = [case(f"A -> {s}", [(a, s)], n)["put"] for s in seg_a_b]
            own_a, own_b = seg_a_b if probe[0] >= probe[1] else seg_a_b[::-1]
            cases = {
                "A alone, into owner A": [(a, own_a)],
                "A alone, into owner B": [(a, own_b)],
                "B alone, into owner B": [(b, own_b)],
                "A + A2 at once, both into owner A": [(a, own_a), (a2, own_a)],
                "A + B at once, each into its own owner": [(a, own_a), (b, own_b)],
            }
            for _ in range(args.reps):
                rows.extend(case(name, streams, n) for name, streams in cases.items())
            for c in (a, a2, b):
                c.close()
        finally:
            if pool_b.owner is not None:
                pool_b.owner.stop()
    lines = [
        f"Generated by `python -m benchmarks.handoff.owners_probe "
        f"{' '.join(sys.argv[1:] if argv is None else argv)}` on "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; host {cpu_name()}; "
        f"{args.mib} MiB per stream and operation in 2 MiB values; median of {args.reps}.",
        "",
        "| case | put GB/s | get GB/s |",
        "|---|---:|---:|",
    ]
    for name in dict.fromkeys(r["case"] for r in rows):
        mine = [r for r in rows if r["case"] == name]
        put = sorted(r["put"] for r in mine)[len(mine) // 2]
        get = sorted(r["get"] for r in mine)[len(mine) // 2]
        lines.append(f"| {name} | {put:.2f} | {get:.2f} |")
    text = "\n".join(lines) + "\n"
    publish(args.output, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
