"""`pdrouter launch` (1 P + 1 D, the tiny model, a 128 MiB pool) as a user starts it, for the
tests that watch its output or the processes it starts."""

from __future__ import annotations

import sys
from pathlib import Path

from pdrouter.common.proc import ManagedProcess


def start_launch(
    port: int, tmp: Path, cache_dir: Path, env: dict[str, str] | None = None
) -> ManagedProcess:
    """The launcher on port, logs under tmp/logs, its output in tmp/launch.log; env on top of
    one OpenMP thread and unbuffered output."""
    return ManagedProcess(
        "pdrouter-launch",
        [sys.executable, "-m", "pdrouter.cli", "launch", "--prefill", "1", "--decode", "1",
         "--model", "tiny", "--port", str(port), "--pool-size", "128MiB",
         "--log-dir", str(tmp / "logs"),
         "--worker-args", f"--num-kv-blocks 32 --model-cache-dir {cache_dir}"],
        env={"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})},
        log_path=tmp / "launch.log",
    )  # fmt: skip
