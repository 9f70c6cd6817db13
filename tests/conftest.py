"""Fixtures every test folder shares."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pdrouter.common.proc import PORT_RANGE_ENV

# Under pytest-xdist each worker (gw0, gw1, ...) probes its own 2000 ports for the processes
# it starts (pdrouter.common.proc.find_free_port), so two workers never race for one port.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if _WORKER.startswith("gw") and _WORKER[2:].isdigit():
    _LOW = 20000 + 2000 * (int(_WORKER[2:]) % 6)
    os.environ.setdefault(PORT_RANGE_ENV, f"{_LOW}-{_LOW + 2000}")


@pytest.fixture(scope="session")
def tiny_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where every worker of the session materializes the tiny checkpoint (once)."""
    return tmp_path_factory.mktemp("tiny-cache")
