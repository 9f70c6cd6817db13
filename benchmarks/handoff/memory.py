"""What first touch of memory costs on this host, and what a one-thread memcpy reaches.

A put over shared memory is a copy, by the pool owner, into its segment; the first copy into a
page also faults it in. These probes time that fault-in alone, on anonymous private memory
like the owner's segment (glibc aligned_alloc, i.e. mmap):

    touch          one write per 4 KiB page, one thread: the first touch of the run may also
                   make the hypervisor back the memory (on this workplace's VMs it grows on
                   demand, about 3 s per 8 GB); a second touch of a new mapping is the kernel's
                   fault and zeroing alone
    touch-thp      the same after madvise(MADV_HUGEPAGE): 2 MiB pages, 1/512 the faults
    populate       madvise(MADV_POPULATE_WRITE) (Linux 5.14+): what a pre-fault at start costs
    touch xN       N processes touching their own share at once
    memcpy xN      numpy copy between faulted-in buffers cut into N threads
"""

from __future__ import annotations

import mmap
import multiprocessing as mp
import os
import time
from pathlib import Path

import numpy as np

from benchmarks.handoff.limits import HostMemcpy

PAGE = 4096
MADV_POPULATE_WRITE = 23  # not in Python's mmap module yet


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError as exc:
        return f"unreadable ({exc.strerror})"


def host_facts() -> dict[str, str]:
    meminfo = {}
    for line in _read("/proc/meminfo").splitlines():
        name, _, value = line.partition(":")
        meminfo[name] = value.strip()
    model = next(
        (ln.split(":", 1)[1].strip() for ln in _read("/proc/cpuinfo").splitlines()
         if ln.startswith("model name")), "?",
    )  # fmt: skip
    return {
        "cpu": f"{os.cpu_count()} x {model}",
        "kernel": os.uname().release,
        "glibc": os.confstr("CS_GNU_LIBC_VERSION") or "?",
        "MemTotal": meminfo.get("MemTotal", "?"),
        "MemFree": meminfo.get("MemFree", "?"),
        "thp_enabled": _read("/sys/kernel/mm/transparent_hugepage/enabled"),
        "thp_defrag": _read("/sys/kernel/mm/transparent_hugepage/defrag"),
        "nr_hugepages": _read("/proc/sys/vm/nr_hugepages"),
        "Hugepagesize": meminfo.get("Hugepagesize", "?"),
    }


def touch_gbps(nbytes: int, how: str = "touch") -> float:
    """GB/s of faulting in nbytes of fresh anonymous memory (how: touch | touch-thp | populate)."""
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        if how == "touch-thp":
            region.madvise(mmap.MADV_HUGEPAGE)
        pages = np.frombuffer(region, dtype=np.uint8)[::PAGE]
        t0 = time.perf_counter()
        if how == "populate":
            region.madvise(MADV_POPULATE_WRITE)
        else:
            pages[:] = 1
        elapsed = time.perf_counter() - t0
        del pages
    finally:
        region.close()
    return nbytes / elapsed / 1e9


def _touch_at(nbytes: int, start_at: float) -> tuple[float, float]:
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    pages = np.frombuffer(region, dtype=np.uint8)[::PAGE]
    time.sleep(max(0.0, start_at - time.perf_counter()))
    t0 = time.perf_counter()
    pages[:] = 1
    t1 = time.perf_counter()
    del pages
    region.close()
    return t0, t1


def parallel_touch_gbps(nbytes_each: int, procs: int) -> float:
    """procs processes each faulting in nbytes_each at once: aggregate GB/s."""
    ctx = mp.get_context("spawn")
    with ctx.Pool(procs) as workers:
        start_at = time.perf_counter() + 2.0  # after every child has imported numpy
        spans = workers.starmap(_touch_at, [(nbytes_each, start_at)] * procs)
    wall = max(t1 for _, t1 in spans) - min(t0 for t0, _ in spans)
    return procs * nbytes_each / wall / 1e9


def memory_rows(touch_bytes: int, memcpy_bytes: int, procs: int) -> list[dict]:
    """First-touch and memcpy rates, in the order that keeps the first one the coldest."""
    rows = []

    def add(what: str, nbytes: int, fn: object) -> None:
        try:
            gbps = fn()  # type: ignore[operator]
            rows.append({"what": what, "bytes": nbytes, "gbps": gbps})
        except OSError as exc:
            rows.append({"what": what, "bytes": nbytes, "note": f"failed: {exc}"})

    add("touch, first of the run (1 thread)", touch_bytes, lambda: touch_gbps(touch_bytes))
    add(f"touch x{procs} processes (new memory)", touch_bytes,
        lambda: parallel_touch_gbps(touch_bytes // procs, procs))  # fmt: skip
    add("touch again (1 thread)", touch_bytes, lambda: touch_gbps(touch_bytes))
    add("touch-thp (MADV_HUGEPAGE, 1 thread)", touch_bytes,
        lambda: touch_gbps(touch_bytes, "touch-thp"))  # fmt: skip
    add("populate (MADV_POPULATE_WRITE, 1 call)", touch_bytes,
        lambda: touch_gbps(touch_bytes, "populate"))  # fmt: skip
    copier = HostMemcpy(memcpy_bytes)
    for threads in (1, 2, 4, 8):
        add(f"memcpy x{threads} threads (faulted-in)", memcpy_bytes,
            lambda t=threads: copier.gbps(memcpy_bytes, 3, threads=t))  # fmt: skip
    return rows
