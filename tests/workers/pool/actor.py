"""A pool client in its own process, driven by a test over a loopback connection.

    python -m tests.workers.pool.actor HOST:PORT        (authkey in $PDPOOL_ACTOR_KEY, hex)

Tests need writers and readers that are real, separate processes (P and D are) and that can
be killed mid-call; this script is that process. It answers each command with a dict:
{"ok": True, ...} or {"ok": False, "error": <PoolError class name>, "message": ...}, always
with "elapsed_s", so a test can assert both the typed error and how long it took.

Values are pattern(seed, index, nbytes): position-dependent, so a swapped, shifted or torn
block never compares equal.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from multiprocessing.connection import Client
from typing import Any

import numpy as np

from workers.pool.client import KVPoolClient, PoolClientConfig
from workers.pool.errors import PoolError


def pattern(seed: int, index: int, nbytes: int) -> np.ndarray:
    """nbytes of uint8, unique to (seed, index) and to each 8-byte position."""
    salt = int.from_bytes(hashlib.sha256(f"{seed}/{index}".encode()).digest()[:8], "little")
    words = np.arange(-(-nbytes // 8), dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    return (words ^ np.uint64(salt)).view(np.uint8)[:nbytes]


def digest(data: np.ndarray) -> str:
    return hashlib.sha256(data.tobytes()).hexdigest()


class Actor:
    def __init__(self) -> None:
        self.client: KVPoolClient | None = None
        self.slots: list[int] = []

    def connect(self, **config: Any) -> dict[str, Any]:
        self.client = KVPoolClient(PoolClientConfig(**config)).connect()
        self.slots = self.client.slots.allocate(config["num_slots"]) or []
        return {"owner_addr": config.get("owner_addr")}

    def fill(self, seed: int, count: int) -> dict[str, Any]:
        """Write pattern(seed, i) into the first count slots."""
        assert self.client is not None, "connect first"
        buffer = self.client.buffer
        for i in range(count):
            buffer.slot(self.slots[i])[:] = pattern(seed, i, buffer.slot_bytes)
        return {}

    def put(
        self, keys: list[str], seed: int | None = None, sizes: list[int] | None = None
    ) -> dict[str, Any]:
        """Put the first len(keys) slots (filled with seed's pattern first unless seed is None)."""
        assert self.client is not None, "connect first"
        if seed is not None:
            self.fill(seed, len(keys))
        result = self.client.put_from(keys, self.slots[: len(keys)], sizes)
        return {"statuses": [s.value for s in result.statuses], "codes": list(result.codes)}

    def get(self, keys: list[str]) -> dict[str, Any]:
        assert self.client is not None, "connect first"
        buffer = self.client.buffer
        for slot in self.slots[: len(keys)]:
            buffer.slot(slot)[:] = 0xAB  # poison: a key that reports OK must overwrite it
        result = self.client.get_into(keys, self.slots[: len(keys)])
        digests = [
            digest(buffer.slot(self.slots[i])[:code]) if code >= 0 else None
            for i, code in enumerate(result.codes)
        ]
        err = result.error()
        return {
            "statuses": [s.value for s in result.statuses],
            "codes": list(result.codes),
            "digests": digests,
            "error": type(err).__name__ if err else None,
        }

    def exists(self, keys: list[str]) -> dict[str, Any]:
        assert self.client is not None, "connect first"
        return {"exists": self.client.exists(keys)}

    def remove(self, keys: list[str]) -> dict[str, Any]:
        assert self.client is not None, "connect first"
        return {"statuses": [s.value for s in self.client.remove(keys).statuses]}

    def stats(self) -> dict[str, Any]:
        assert self.client is not None, "connect first"
        return {"stats": self.client.stats().__dict__}

    def health(self) -> dict[str, Any]:
        assert self.client is not None, "connect first"
        health = self.client.health()
        return {"state": health.state, "reason": health.reason, "generation": health.generation}

    def close(self) -> dict[str, Any]:
        if self.client is not None:
            self.client.close()
        return {}

    def ping(self) -> dict[str, Any]:
        return {"pid": os.getpid()}


def main() -> int:
    host, port = sys.argv[1].rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ["PDPOOL_ACTOR_KEY"]))
    actor = Actor()
    while True:
        try:
            command, kwargs = conn.recv()
        except EOFError:
            return 0
        if command == "exit":
            return 0
        start = time.monotonic()
        try:
            reply = {"ok": True, **getattr(actor, command)(**kwargs)}
        except PoolError as exc:
            reply = {"ok": False, "error": type(exc).__name__, "message": str(exc)}
        reply["elapsed_s"] = time.monotonic() - start
        conn.send(reply)


if __name__ == "__main__":
    sys.exit(main())
