"""ManagedProcess.freeze: SIGSTOP a whole process group and return only once every thread of
every process in it has stopped (fault-injection tests freeze workers and the pool owner)."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

from pdrouter.common.proc import ManagedProcess, all_halted, group_pids
from tests.wait import wait_until

# A parent and a child (same process group), each spinning in 3 threads besides its main one.
BUSY = """
import subprocess, sys, threading
def spin():
    while True:
        pass
for _ in range(3):
    threading.Thread(target=spin, daemon=True).start()
if sys.argv[1] == "parent":
    subprocess.Popen([sys.executable, __file__, "child"])
threading.Event().wait()
"""


def _thread_states(pid: int) -> list[str]:
    return [
        stat.read_text().rpartition(")")[2].split()[0]
        for stat in Path(f"/proc/{pid}/task").glob("*/stat")
    ]


def test_freeze_returns_with_every_thread_of_the_group_stopped(tmp_path: Path) -> None:
    script = tmp_path / "busy.py"
    script.write_text(BUSY)
    proc = ManagedProcess("busy", [sys.executable, str(script), "parent"],
                          log_path=tmp_path / "busy.log")  # fmt: skip
    try:
        pids = wait_until(lambda: group_pids(proc.pid), 20, "the parent and its child",
                          done=lambda p: len(p) == 2)  # fmt: skip
        wait_until(lambda: [len(_thread_states(pid)) for pid in pids], 20,
                   "3 spinning threads in each", done=lambda n: n == [4, 4])  # fmt: skip
        assert not all_halted(pids)
        proc.freeze()
        # Read on return, no wait: each of the 8 threads is already stopped.
        assert [_thread_states(pid) for pid in pids] == [["T"] * 4, ["T"] * 4]
        proc.signal(signal.SIGCONT)
        wait_until(lambda: all_halted(pids), 20, "the group to run again", done=lambda h: not h)
    finally:
        proc.stop()
