"""`pdworker pool`: the process that owns the pool memory, and nothing else.

    pdworker pool --size 2GiB --master HOST:PORT --metadata URL [--port N] [--owner-port N]
                  [--no-prefault]

Workers mount no memory, so a worker crash loses no block; the memory lives here. The owner
runs the wheel's `mooncake_client` (the "real client") as its child: it mounts --size bytes
into the pool, serves TCP transfers to clients on any host, and serves same-host clients over
shared memory (KVPoolClient with owner_addr = HOST:owner-port). This process adds /health and
/metrics on --port (behind --admin-key: pdrouter.common.doors.owner_door), pre-faults the
memory before it reports healthy (--no-prefault skips it: workers/pool/prefault.py), and ties
the child's life to its own:

    pdworker pool (HTTP /health /metrics) ── child ─► mooncake_client (--port owner-port)
        SIGTERM: stop the child, exit 0.  Child dies: exit 1.  Owner killed: child killed
        (same process group, and PR_SET_PDEATHSIG for a kill by PID alone).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from pdrouter.common.flags import add_flags, from_args
from workers.pool.owner_process import OwnerConfig, OwnerProcess

log = logging.getLogger("pdworker.pool")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `pdworker pool`, one per flag()-marked field of OwnerConfig."""
    add_flags(parser, OwnerConfig)


def run(args: argparse.Namespace) -> int:
    """Mount the pool, serve /health and /metrics until SIGTERM/SIGINT or the child's death."""
    from workers.pool.errors import PoolSetupError
    from workers.pool.owner_http import serve_owner_http

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    config: OwnerConfig = from_args(OwnerConfig, args)
    size_bytes = config.size_bytes
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    owner = OwnerProcess(config)
    try:
        owner.start()
    except (PoolSetupError, RuntimeError, TimeoutError) as exc:
        owner.stop()
        print(f"pdworker pool: {exc}", file=sys.stderr)
        return 1
    if config.prefault:
        from workers.pool.prefault import prefault

        filled = prefault(config.master_addr, config.metadata_url, size_bytes)
        log.info(
            "pool memory pre-faulted: %d bytes in %.2f s%s",
            filled.bytes_written,
            filled.seconds,
            f" (incomplete: {filled.error})" if filled.error else "",
        )
    server = serve_owner_http(owner, config.http_port, config.admin_key)
    log.info(
        "pool owner up: %d bytes, owner_addr %s, http port %d",
        size_bytes,
        owner.owner_addr,
        server.server_address[1],
    )
    code = 0
    while not stop.wait(0.2):
        if not owner.alive():
            log.error("mooncake_client exited with %s; the pool is gone", owner.popen.returncode)  # type: ignore[union-attr]
            code = 1
            break
    server.shutdown()
    owner.stop()
    return code
