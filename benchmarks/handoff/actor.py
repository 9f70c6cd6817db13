"""An object living in its own process, called over a pipe: P, D and every pool writer or
reader of the handoff benchmark run apart, as prefill and decode workers do.

    actor = Actor("prefill", Side, ("prefill", gpu))      # Side(*args) built in the child
    actor.call("connect", addresses=..., num_slots=...)   # Side.connect(**kwargs) there
    actor.send("put", ...); ...; actor.result()           # several actors at once

The child is started with the spawn method (no CUDA context or Mooncake store is inherited)
and stopped by its PID. An exception in the child comes back as RuntimeError carrying its
traceback; a child that dies or hangs fails the call instead of hanging the benchmark.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import traceback
from collections.abc import Callable
from typing import Any

STOP = "__stop__"


class Actor:
    """factory(*args) in a child process; call() its methods by name."""

    def __init__(self, name: str, factory: Callable[..., Any], args: tuple = ()) -> None:
        ctx = mp.get_context("spawn")
        self.name = name
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, factory, args), name=name, daemon=True)
        self._proc.start()
        child.close()
        self._pending = False

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def send(self, method: str, **kwargs: Any) -> None:
        """Start method(**kwargs) in the child; collect its answer with result()."""
        assert not self._pending, f"{self.name}: a call is already in flight"
        self._conn.send((method, kwargs))
        self._pending = True

    def result(self, timeout_s: float = 600.0) -> Any:
        """The answer of the call in flight."""
        assert self._pending, f"{self.name}: no call in flight"
        self._pending = False
        if not self._conn.poll(timeout_s):
            self.stop()
            raise RuntimeError(f"{self.name}: no answer in {timeout_s:.0f}s (stopped it)")
        try:
            status, value = self._conn.recv()
        except EOFError as exc:
            raise RuntimeError(f"{self.name} died (exit code {self._proc.exitcode})") from exc
        if status != "ok":
            raise RuntimeError(f"{self.name} failed:\n{value}")
        return value

    def settle(self, timeout_s: float = 600.0) -> None:
        """Wait out a call still in flight (after another actor's call failed), ignoring its
        answer, so that this actor can be called again."""
        if self._pending:
            with contextlib.suppress(RuntimeError):
                self.result(timeout_s)

    def call(self, method: str, timeout_s: float = 600.0, **kwargs: Any) -> Any:
        self.send(method, **kwargs)
        return self.result(timeout_s)

    def stop(self, timeout_s: float = 20.0) -> None:
        """Ask the child to close its handler and exit; kill it by PID if it does not."""
        if self._proc.is_alive() and not self._pending:
            with contextlib.suppress(OSError):
                self._conn.send((STOP, {}))
        self._proc.join(timeout_s)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(10)
        self._conn.close()


def _serve(conn: Any, factory: Callable[..., Any], args: tuple) -> None:
    try:
        handler = factory(*args)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        try:
            method, kwargs = conn.recv()
        except EOFError:
            break
        if method == STOP:
            close = getattr(handler, "close", None)
            if close is not None:
                close()
            break
        try:
            conn.send(("ok", getattr(handler, method)(**kwargs)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
