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

from pdrouter.common.cli_args import add_flag
from workers.pool.owner_process import OwnerConfig, OwnerProcess, parse_size_bytes

log = logging.getLogger("pdworker.pool")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `pdworker pool` (each with a PDWORKER_* environment mirror)."""
    add_flag(parser, "--size", default="2GiB", help="pool memory to mount, e.g. 2GiB, 512MiB")
    add_flag(parser, "--master", required=True, help="Mooncake master HOST:PORT")
    add_flag(parser, "--metadata", required=True, help="metadata URL http://HOST:PORT/metadata")
    add_flag(parser, "--host", default="127.0.0.1", help="address other clients reach us at")
    add_flag(parser, "--port", type=int, default=0, help="HTTP port for /health, /metrics")
    add_flag(
        parser,
        "--owner-port",
        type=int,
        default=0,
        help="mooncake_client port; same-host workers pass HOST:this as --pool-owner",
    )
    add_flag(parser, "--threads", type=int, default=2, help="mooncake_client service threads")
    add_flag(
        parser,
        "--admin-key",
        default=None,
        help="with it, /metrics and the detailed /health need 'Authorization: Bearer <key>' "
        "(set it through PDWORKER_ADMIN_KEY: argv is public)",
    )
    add_flag(
        parser,
        "--no-prefault",
        action="store_true",
        help="skip writing the pool memory once at start (then the first puts fault it in "
        "page by page, several times slower; workers/pool/prefault.py)",
    )


def run(args: argparse.Namespace) -> int:
    """Mount the pool, serve /health and /metrics until SIGTERM/SIGINT or the child's death."""
    from workers.pool.errors import PoolSetupError
    from workers.pool.owner_http import serve_owner_http

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        size_bytes = parse_size_bytes(args.size)
    except ValueError as exc:
        print(f"pdworker pool: --size: {exc}", file=sys.stderr)
        return 2
    config = OwnerConfig(
        size_bytes=size_bytes,
        master_addr=args.master,
        metadata_url=args.metadata,
        host=args.host,
        http_port=args.port,
        owner_port=args.owner_port,
        threads=args.threads,
    )
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
    if not args.no_prefault:
        from workers.pool.prefault import prefault

        filled = prefault(config.master_addr, config.metadata_url, size_bytes)
        log.info(
            "pool memory pre-faulted: %d bytes in %.2f s%s",
            filled.bytes_written,
            filled.seconds,
            f" (incomplete: {filled.error})" if filled.error else "",
        )
    server = serve_owner_http(owner, config.http_port, args.admin_key)
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
