"""Fixtures every test folder shares."""

from __future__ import annotations

import dataclasses
import os
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdrouter.common.proc import PORT_RANGE_ENV
from pdrouter.launch.cluster import Cluster

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


# Flags added to every worker of every cluster the tests launch (pdrouter.launch.cluster):
# the same end-to-end suite on another engine backend or device, e.g. on a GPU host
#     PDROUTER_TEST_WORKER_ARGS="--engine-backend torch --device gpu" pytest tests/e2e/pd
# Appended last, so they win over a fixture's own value of the same flag.
WORKER_ARGS_ENV = "PDROUTER_TEST_WORKER_ARGS"


@pytest.fixture(autouse=True, scope="session")
def _extra_worker_args() -> Iterator[None]:
    extra = tuple(shlex.split(os.environ.get(WORKER_ARGS_ENV, "")))
    if not extra:
        yield
        return
    post_init = Cluster.__post_init__

    def with_extra(self: Cluster) -> None:
        self.spec = dataclasses.replace(self.spec, worker_args=(*self.spec.worker_args, *extra))
        post_init(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Cluster, "__post_init__", with_extra)
        yield
