"""Health checks stay out of INFO logs (pdrouter.common.quiet_logs); the worker's real log is
checked in tests/workers/server/test_quiet_access_log.py, the router's in
tests/e2e/pd/test_large_prompt.py."""

from __future__ import annotations

import logging

import pytest

from pdrouter.common.quiet_logs import CALL_LOGGERS, HealthCheckFilter, quiet_health_checks


def _record(level: int, msg: str, *args: object) -> logging.LogRecord:
    return logging.LogRecord("httpx", level, __file__, 1, msg, args, None)


def test_health_and_heartbeat_lines_are_dropped_at_info_and_kept_as_warnings() -> None:
    f = HealthCheckFilter()
    check = 'HTTP Request: %s %s "%s %d %s"'
    assert not f.filter(_record(logging.INFO, check, "GET", "http://127.0.0.1:9/health",
                                "HTTP/1.1", 200, "OK"))  # fmt: skip
    assert not f.filter(_record(logging.INFO, check, "PUT", "http://r/instances/p0/heartbeat",
                                "HTTP/1.1", 200, "OK"))  # fmt: skip
    access = '%s - "%s %s HTTP/%s" %d'
    assert not f.filter(_record(logging.INFO, access, "127.0.0.1:5", "GET", "/health", "1.1", 200))
    assert f.filter(_record(logging.INFO, access, "127.0.0.1:5", "POST", "/v1/completions",
                            "1.1", 200))  # fmt: skip
    assert f.filter(_record(logging.WARNING, "/health failed: ConnectError"))


@pytest.fixture
def clean_call_loggers():
    """No HealthCheckFilter on the call loggers during the test (an in-process server of an
    earlier test may have installed one: it is process-wide), the saved filters after it."""
    saved = {name: list(logging.getLogger(name).filters) for name in CALL_LOGGERS}
    for name, filters in saved.items():
        logging.getLogger(name).filters[:] = [
            f for f in filters if not isinstance(f, HealthCheckFilter)
        ]
    yield
    for name, filters in saved.items():
        logging.getLogger(name).filters[:] = filters


@pytest.mark.usefixtures("clean_call_loggers")
def test_installed_once_at_info_and_not_at_debug() -> None:
    quiet_health_checks("debug")
    for name in CALL_LOGGERS:
        assert not any(isinstance(f, HealthCheckFilter) for f in logging.getLogger(name).filters)
    quiet_health_checks("info")
    quiet_health_checks("INFO")
    for name in CALL_LOGGERS:
        filters = logging.getLogger(name).filters
        assert sum(isinstance(f, HealthCheckFilter) for f in filters) == 1
