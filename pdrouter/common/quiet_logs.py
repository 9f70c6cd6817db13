"""Keep health checks out of INFO logs.

The router checks every instance's /health every --health-interval-s and a worker heartbeats
its registration every 2 s: at INFO, httpx logged one line per check in the router and uvicorn
one access line per /health in every worker, burying the request lines. This filter
drops those lines (records at INFO or below whose message names /health or a heartbeat) from
the two loggers that write them, unless the level is DEBUG, where everything shows. Warnings
(a failed check) always pass.
"""

from __future__ import annotations

import logging

# Loggers that write one line per HTTP call: httpx (the router's checks, a worker's
# heartbeats), uvicorn.access (a worker's access log).
CALL_LOGGERS = ("httpx", "uvicorn.access")
QUIET_PATHS = ("/health", "/heartbeat")


class HealthCheckFilter(logging.Filter):
    """Drops INFO (and lower) records about health checks and heartbeats."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.INFO:
            return True
        message = record.getMessage()
        return not any(path in message for path in QUIET_PATHS)


def quiet_health_checks(level: str | int) -> None:
    """Install HealthCheckFilter on CALL_LOGGERS unless level is DEBUG (or lower). Called
    once by a server's CLI after logging is configured; installs at most one filter each."""
    numeric = logging.getLevelName(level.upper()) if isinstance(level, str) else level
    if isinstance(numeric, int) and numeric <= logging.DEBUG:
        return
    for name in CALL_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, HealthCheckFilter) for f in logger.filters):
            logger.addFilter(HealthCheckFilter())
