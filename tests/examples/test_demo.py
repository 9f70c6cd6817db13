"""`make demo` runs examples/demo.py: the whole PD path on the packaged demo model, one streamed
chat request through the official client, its KV through the pool. Run here as make runs it,
so that a change of the router's defaults (a short prompt prefilled on D, say) cannot break the
README's first command unseen."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests.repo import REPO_ROOT

pytestmark = pytest.mark.slow
TIMEOUT_S = 300.0


def test_the_demo_answers_and_its_kv_goes_through_the_pool() -> None:
    proc = subprocess.Popen(
        [sys.executable, str(REPO_ROOT / "examples" / "demo.py")],
        cwd=REPO_ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:  # Ctrl-C: the demo's own finally stops its cluster
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    assert proc.returncode == 0, out
    assert "assistant: JSON (JavaScript Object Notation)" in out, out
    pool_line = next(line for line in out.splitlines() if line.startswith("KV through the pool"))
    written = int(pool_line.split(": ")[1].split(" bytes written")[0])
    assert written > 0 and pool_line.endswith(f"{written} bytes read by decode"), pool_line
    assert out.rstrip().endswith("stopped everything"), out
