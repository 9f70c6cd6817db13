"""Run `python -m workers.cli ARGS...` in a process where `import paddle` fails: a worker on
the torch backend started this way proves it never needs Paddle (the GPU hosts' install has
none).

    python tests/e2e/without_paddle.py serve --role mixed --engine-backend torch ...
"""

from __future__ import annotations

import runpy
import sys

if __name__ == "__main__":
    sys.modules["paddle"] = None  # type: ignore[assignment]  # any `import paddle` raises
    sys.argv = ["workers.cli", *sys.argv[1:]]
    runpy.run_module("workers.cli", run_name="__main__", alter_sys=True)
