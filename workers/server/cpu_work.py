"""CPU-heavy request work off the event loop: chat templating, tokenization, detokenization.

The event loop of a worker serves /health, the router's calls and every stream; a 10 MB prompt
tokenized on it kept /health silent for 12 s, long enough for the router to mark the worker
down and refuse everyone. Such work runs here instead, on a small pool of threads:
the loop stays free, and the tokenizer releases the GIL while it encodes
(workers.engine.tokenizer.Tokenizer.encode), so the loop really runs meanwhile. Two threads:
enough that one huge request does not hold up every small one's tokenization, few enough that
they never crowd out the engine's own thread on a small machine. One per app.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

CPU_WORK_THREADS = 2


class CpuWork:
    """A small thread pool for request preparation; run() awaits fn(*args) on it."""

    def __init__(self, num_threads: int = CPU_WORK_THREADS) -> None:
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="cpu-work")

    async def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """fn(*args, **kwargs) on the pool; its exception is raised here."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    def shutdown(self) -> None:
        """Stop taking work; work already running ends on its own (no wait)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
