"""A router app in the test's own process, called through ASGI (no socket, no lifespan).

Its static instances are never health-checked: it learns about them only by calling them,
which is what the failover tests exercise. Its health loop does not run either.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx

from pdrouter.router.app import create_app
from pdrouter.router.config import RouterConfig
from pdrouter.router.instances.registry import Registry


async def in_process_router(
    cfg: RouterConfig, timeout_s: float = 60.0
) -> AsyncIterator[httpx.AsyncClient]:
    """Yields a client of a router app over cfg; stops the app's clients afterwards."""
    app = create_app(cfg, Registry(list(cfg.prefill_urls), list(cfg.decode_urls)))
    await app.state.service.start()
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://router", timeout=timeout_s
        ) as client:
            yield client
    finally:
        await app.state.service.stop()
