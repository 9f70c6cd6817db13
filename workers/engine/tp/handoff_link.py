"""Rank 0 asks every other rank to move its own heads of some blocks; each rank answers.

    rank 0   PeerLinks.call("write" | "read", **args)  one connection per rank per call,
             sent to all ranks at once; each answer awaited within the call's bound
    rank r   serve_handoff: a listener thread; each call runs on a thread of its own with
             the rank's pool client and cache (workers/engine/tp/rank_io.py)

A call that cannot be answered (a rank gone, past the bound) raises PeerCallError: the
caller counts the blocks as not moved (P's write fails, D recomputes), and the watchdog
takes the worker down if a rank died.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Callable, Sequence
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

log = logging.getLogger(__name__)


class PeerCallError(RuntimeError):
    """A rank did not answer a handoff call (gone, failed, or past the bound)."""


Handler = Callable[..., Any]


class PeerLinks:
    """Rank 0's handoff calls to ranks 1..N-1 (addresses from their serve_handoff)."""

    def __init__(self, addresses: Sequence[tuple[str, int]], authkey: bytes, timeout_s: float):
        self.addresses, self._authkey, self.timeout_s = list(addresses), authkey, timeout_s
        self._threads = concurrent.futures.ThreadPoolExecutor(max(1, 4 * len(self.addresses)))

    def submit(
        self, op: str, bound_s: float | None = None, **kwargs: Any
    ) -> list[concurrent.futures.Future[Any]]:
        """op(**kwargs) sent to every rank at once; each future's result is that rank's
        answer, in rank order, or raises PeerCallError (also past bound_s, default
        timeout_s)."""
        bound = self.timeout_s if bound_s is None else bound_s
        return [self._threads.submit(self._one, a, op, kwargs, bound) for a in self.addresses]

    def _one(
        self, address: tuple[str, int], op: str, kwargs: dict[str, Any], bound_s: float
    ) -> Any:
        try:
            with Client(address, authkey=self._authkey) as conn:
                conn.send((op, kwargs))
                if not conn.poll(bound_s):
                    raise PeerCallError(f"rank at {address} did not answer {op} in {bound_s} s")
                ok, value = conn.recv()
        except (OSError, EOFError) as exc:
            raise PeerCallError(f"rank at {address} unreachable for {op}: {exc}") from exc
        if not ok:
            raise PeerCallError(f"rank at {address} failed {op}: {value}")
        return value


def serve_handoff(handlers: dict[str, Handler], authkey: bytes) -> tuple[str, int]:
    """Answer rank 0's calls on a free loopback port (daemon threads); returns the address."""
    listener = Listener(("127.0.0.1", 0), authkey=authkey)

    def answer(conn: Connection) -> None:
        with conn:
            try:
                op, kwargs = conn.recv()
                reply = (True, handlers[op](**kwargs))
            except Exception as exc:  # reported to rank 0, which counts the blocks not moved
                log.exception("handoff call failed")
                reply = (False, f"{type(exc).__name__}: {exc}")
            with contextlib.suppress(OSError):  # rank 0 gave up on this call
                conn.send(reply)

    def accept() -> None:
        while True:
            try:
                conn = listener.accept()
            except OSError:  # a failed authentication: keep serving the others
                continue
            threading.Thread(target=answer, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, name="tp-handoff", daemon=True).start()
    return listener.address
