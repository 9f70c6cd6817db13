"""One connection of a pool client: a Mooncake store, its registered staging, its page lock.

KVPoolClient holds one Link at a time and swaps in a new one when it reconnects
(workers/pool/pool_health.py says why that can be needed). A Link it swapped out is kept, not
closed: a handoff that started before the swap may still copy through that staging (its pool
call then fails fast as stale, but its device copies run to their end), and a Mooncake call
still running on the old store would crash the process if the store were closed under it.
Each reconnection therefore keeps one staging buffer mapped: max_reconnects bounds that.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass

from workers.pool.bounded_call import BoundedCaller
from workers.pool.client_config import PoolClientConfig
from workers.pool.connect import RPC_FAIL, TRANSFER_FAIL, open_store, parse_host_port, probe_tcp
from workers.pool.errors import PoolTimeoutError
from workers.pool.page_lock import PageLock, Register, lock_staging
from workers.pool.pool_health import ProbeOutcome
from workers.pool.shm_table import SHM_TABLE
from workers.pool.staging import StagingBuffer

SHM_NOT_MAPPED = -600  # INVALID_PARAMS: the owner dropped this client's staging mapping
KEY_MISSING = -704
PROBE_BYTES = 64
PROBE_KEY_PREFIX = "pdprobe/"


@dataclass
class Link:
    """A connected store and the staging registered with it (generation 0: the first)."""

    store: object
    buffer: StagingBuffer
    generation: int
    page_lock: PageLock | None = None


def open_link(
    config: PoolClientConfig,
    caller: BoundedCaller,
    register: Register,
    generation: int,
) -> Link:
    """Set up a store and register (and, for a GPU, page-lock) a fresh staging buffer; over
    shared memory only while no client of this process is in Mooncake's reconnection loop
    (shm_table.py: ShmTableBusy after setup_timeout_s)."""
    if config.owner_addr is None:
        return _open(config, caller, register, generation)
    with SHM_TABLE.change(config.setup_timeout_s):
        link = _open(config, caller, register, generation)
        SHM_TABLE.add(link.store, config.owner_addr)
        return link


def _open(
    config: PoolClientConfig, caller: BoundedCaller, register: Register, generation: int
) -> Link:
    store, buffer = open_store(config, caller)
    lock = None
    if config.page_lock:
        try:
            lock = lock_staging(buffer.ptr, buffer.nbytes, register)
        except BaseException:
            store.unregister_buffer(buffer.ptr)  # type: ignore[attr-defined]
            store.close()  # type: ignore[attr-defined]
            raise
    return Link(store, buffer, generation, lock)


def close_link(link: Link) -> None:
    """Release a link no call uses (the caller made sure of that). Its staging stays in
    Mooncake's table (shm_table.py): Mooncake has no call that frees it."""
    SHM_TABLE.remove(link.store)  # a closed store is in no loop
    if link.page_lock is not None:
        link.page_lock.close()
        link.page_lock = None
    link.store.unregister_buffer(link.buffer.ptr)  # type: ignore[attr-defined]
    link.store.close()  # type: ignore[attr-defined]


def probe_link(
    link: Link, caller: BoundedCaller, config: PoolClientConfig, on_done: Callable[[], None]
) -> ProbeOutcome:
    """Get a key that never exists into the staging's first bytes (nothing is written);
    on_done runs when the native call really returns (it may outlive probe_timeout_s)."""
    store, ptr = link.store, link.buffer.ptr
    key = f"{PROBE_KEY_PREFIX}{uuid.uuid4().hex}"
    try:
        codes = caller.call(
            lambda: store.batch_get_into([key], [ptr], [PROBE_BYTES]),  # type: ignore[attr-defined]
            config.probe_timeout_s,
            on_done=on_done,
            what="pool probe",
        )
    except PoolTimeoutError:
        return ProbeOutcome(
            f"the pool did not answer a probe within {config.probe_timeout_s:g} s "
            "(owner or master stopped or hung)",
            reachable=False,
        )
    code = int(codes[0]) if codes else -1
    if code >= 0 or code == KEY_MISSING:
        return ProbeOutcome(None)
    if code == SHM_NOT_MAPPED and config.owner_addr is not None:
        reason = "the pool owner no longer maps this client's staging (shm_not_mapped, -600)"
    elif code in (TRANSFER_FAIL, RPC_FAIL):
        reason = f"the pool owner or the master does not answer (code {code})"
    else:
        reason = f"a pool probe failed with code {code}"
    walking = SHM_TABLE.walking() if config.owner_addr is not None else []
    if walking:  # a reconnect now would change the table under Mooncake's walk of it
        reason += "; Mooncake's own reconnection is running (workers/pool/shm_table.py)"
    return ProbeOutcome(reason, reachable=not walking and _reachable(config))


def _reachable(config: PoolClientConfig) -> bool:
    """Whether the master (and the owner, over shared memory) accept connections: then a setup
    answers quickly rather than holding the GIL through its retries."""
    if probe_tcp(*parse_host_port(config.master_addr, "--master")):
        return False
    owner = config.owner_addr
    return owner is None or not probe_tcp(*parse_host_port(owner, "--pool-owner"))
