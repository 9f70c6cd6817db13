"""The collector as `pdrouter serve` leaves it before serving: what start-up made is frozen
out of its walks, and the young generation collected a tenth as often as CPython's default.
Checked in a child process: the settings are the process's own and would change every other
test's."""

from __future__ import annotations

import json
import subprocess
import sys

from pdrouter.router.serve import GC_YOUNG_THRESHOLD

_PROBE = """
import gc, json
from pdrouter.router.serve import settle_collector
before = gc.get_threshold()
settle_collector()
print(json.dumps({"before": before, "after": gc.get_threshold(),
                  "frozen": gc.get_freeze_count()}))
"""


def test_settle_collector_freezes_start_up_and_raises_the_young_threshold() -> None:
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                         check=True, timeout=60)  # fmt: skip
    state = json.loads(out.stdout)
    before, after = state["before"], state["after"]
    assert after == [GC_YOUNG_THRESHOLD, before[1], before[2]]
    assert GC_YOUNG_THRESHOLD == 10_000
    # Everything imported so far (the router's modules, pydantic's schemas) is frozen.
    assert state["frozen"] > 10_000
