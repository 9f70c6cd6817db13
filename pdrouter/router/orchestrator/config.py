"""The orchestrator's settings: per-hop bounds, attempts, backoff, the missing-KV policy."""

from __future__ import annotations

from dataclasses import dataclass

from pdrouter.wire.pd import MissingKVPolicy


@dataclass(frozen=True)
class HopTimeouts:
    """Per-hop bounds; no call to a worker waits without one."""

    connect_s: float = 2.0
    prefill_s: float = 300.0  # the whole prefill answer (queue + compute + pool write)
    decode_event_s: float = 300.0  # the gap between two events of D's stream (first included)
    write_s: float = 10.0


@dataclass(frozen=True)
class OrchestratorConfig:
    timeouts: HopTimeouts = HopTimeouts()
    max_prefill_attempts: int = 3
    max_decode_attempts: int = 3
    retry_backoff_s: float = 0.05
    missing_kv_policy: MissingKVPolicy | None = None  # None: each decode instance's default
