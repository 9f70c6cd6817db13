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


# The multi-host tests share the machine's network namespaces (one run at a time: see
# pdrouter/launch/netns.py), so they all go to one pytest worker.
_SERIAL_GROUPS = {"tests/e2e/multihost/": "netns", "tests/examples/test_start_host.py": "netns"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist's loadgroup mode, keep each module on one worker, so that its
    module-scoped cluster starts once; modules that share a machine-wide resource share a
    group. Without xdist the marker is inert."""
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        group = next((g for prefix, g in _SERIAL_GROUPS.items() if path.startswith(prefix)), path)
        item.add_marker(pytest.mark.xdist_group(group))
