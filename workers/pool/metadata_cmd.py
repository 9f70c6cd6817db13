"""`pdworker metadata`: the Mooncake transfer-metadata store, bound to one address.

    pdworker metadata --host 127.0.0.1 --port M      (clients' --metadata http://HOST:M/metadata)

mooncake_master can serve this store itself (--enable_http_metadata_server), but 0.3.13 binds
it to 0.0.0.0 whatever --http_metadata_server_host says (measured: /proc/net/tcp). This runs
the wheel's own server (mooncake.http_metadata_server.KVBootstrapServer, the code behind its
`mooncake_http_metadata_server` command) on --host alone, and adds GET /health (liveness:
`{"status": "ok"}`) for the launcher.

The store has no authentication (Mooncake's C++ client sends no credential): whoever reaches
this port can rewrite where KV transfers go. Bind it to loopback or a firewalled address
(docs/security.md); pdrouter.launch.exposure lists it.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from dataclasses import dataclass, field

from pdrouter.common.flags import add_flags, flag, from_args

LIVENESS_BODY = '{"status": "ok"}'


@dataclass(frozen=True)
class MetadataConfig:
    """Where the metadata store listens."""

    host: str = field(default="127.0.0.1", metadata=flag("--host", "the one address to bind"))
    port: int = field(
        default=0, metadata=flag("--port", "HTTP port (/metadata, /health)", required=True)
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, MetadataConfig)


def run(args: argparse.Namespace) -> int:
    try:
        from aiohttp import web
        from mooncake.http_metadata_server import KVBootstrapServer
    except ImportError as exc:
        print(
            f"pdworker metadata: {exc}: install the Mooncake wheel "
            "(pip install 'mooncake-transfer-engine-non-cuda==0.3.13.post1')",
            file=sys.stderr,
        )
        return 1

    async def health(_: web.Request) -> web.Response:
        return web.Response(text=LIVENESS_BODY, content_type="application/json")

    config: MetadataConfig = from_args(MetadataConfig, args)
    server = KVBootstrapServer(port=config.port, host=config.host)
    server.app.router.add_get("/health", health)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    thread = server.run()
    # The server thread ends on its own only when it failed (port taken): exit 1 then.
    while not stop.wait(0.2):
        if not thread.is_alive():
            print(
                f"pdworker metadata: the server on {config.host}:{config.port} stopped",
                file=sys.stderr,
            )
            return 1
    server.close()
    return 0
