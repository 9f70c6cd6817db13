"""Paddle, imported so that dynamic-graph mode holds in every thread for the life of the process.

Importing paddle enters dynamic-graph mode with a context manager that Paddle keeps in a
thread-local of the importing thread. When that thread ends (the worker loads its engine on an
executor thread; a test server runs on a thread it stops), the manager is collected, its exit
runs, and it sets the process-wide tracer to None: every thread started afterwards runs in
static-graph mode and the model fails with "We only support 'view()' in dynamic graph mode".
Worker code imports paddle from here, which holds a reference to that manager for good.
"""

from __future__ import annotations

import paddle
from paddle.base import framework


def _pin_dynamic_mode() -> object:
    guard = framework.global_var._functional_dygraph_context_manager
    if guard is None and not paddle.in_dynamic_mode():
        paddle.disable_static()
        guard = framework.global_var._functional_dygraph_context_manager
    return guard


_DYNAMIC_MODE_GUARD = _pin_dynamic_mode()

__all__ = ["paddle"]
