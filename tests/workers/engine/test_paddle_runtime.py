"""Paddle stays in dynamic-graph mode after the thread that first imported it has ended."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.repo import REPO_ROOT

# A fresh interpreter: the first import of paddle happens on a thread that then ends (as the
# worker's engine load on an executor thread, or a test server on a thread it stops), and a
# thread started afterwards must still be in dynamic-graph mode.
_PROBE = textwrap.dedent(
    """
    import gc, threading

    def first_import():
        import {module}  # noqa: F401

    loader = threading.Thread(target=first_import)
    loader.start()
    loader.join()
    gc.collect()

    import paddle

    seen = {{}}
    later = threading.Thread(target=lambda: seen.update(dynamic=paddle.in_dynamic_mode()))
    later.start()
    later.join()
    print("dynamic" if seen["dynamic"] and paddle.in_dynamic_mode() else "static")
    """
)


def _mode_after_import_on_ended_thread(module: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE.format(module=module)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return done.stdout.strip().splitlines()[-1]


def test_bare_paddle_import_on_an_ended_thread_leaves_static_mode() -> None:
    # The fault the runtime module exists for: if Paddle stops doing this, the module can go.
    assert _mode_after_import_on_ended_thread("paddle") == "static"


def test_paddle_runtime_keeps_dynamic_mode_for_later_threads() -> None:
    assert _mode_after_import_on_ended_thread("workers.engine.paddle_runtime") == "dynamic"


def test_engine_model_imports_paddle_through_the_runtime() -> None:
    assert _mode_after_import_on_ended_thread("workers.engine.model") == "dynamic"
