"""The orchestrator's settings: per-hop bounds, attempts, backoff, the missing-KV policy, the
threshold under which D prefills a prompt itself."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdrouter.common.flags import flag
from pdrouter.wire.pd import MissingKVPolicy

# Below it, D's own prefill reached the second token sooner than P and the pool did (CPU,
# demo model, concurrency 4: docs/benchmarks/pd.md, "Conditional disaggregation: the
# crossover": local ahead at 32 and 48 tokens, behind from 64 or 96 depending on the run); a
# GPU's cheaper handoff and prefill move it: measure before changing it.
DEFAULT_LOCAL_PREFILL_BELOW_TOKENS = 48


@dataclass(frozen=True)
class HopTimeouts:
    """Per-hop bounds; no call to a worker waits without one."""

    connect_s: float = field(
        default=2.0,
        metadata=flag("--connect-timeout-s", "connect timeout of every call to a worker"),
    )
    prefill_s: float = field(
        default=300.0,
        metadata=flag(
            "--prefill-timeout-s", "bound on a prefill answer (queue + compute + pool write)"
        ),
    )
    decode_event_s: float = field(
        default=300.0,
        metadata=flag(
            "--decode-timeout-s",
            "bound on the gap between two events of a decode stream (the first included)",
        ),
    )
    write_s: float = 10.0


@dataclass(frozen=True)
class OrchestratorConfig:
    """Attempts and the missing-KV policy."""

    timeouts: HopTimeouts = HopTimeouts()
    max_prefill_attempts: int = field(
        default=3,
        metadata=flag(
            "--max-prefill-attempts", "prefill instances tried per request before giving up"
        ),
    )
    max_decode_attempts: int = field(
        default=3,
        metadata=flag(
            "--max-decode-attempts",
            "decode instances tried per request (unreachable or died mid-stream)",
        ),
    )
    retry_backoff_s: float = 0.05
    early_decode: bool = field(
        default=True,
        metadata=flag(
            "--no-early-decode",
            "send D its part of a request only once P has answered (default: D is picked "
            "at the start and gets a prefetch beside P's prefill, so it tokenizes, reserves "
            "the prompt's blocks and reads P's writes while P computes)",
            negate=True,
        ),
    )
    missing_kv_policy: MissingKVPolicy | None = field(
        default=None,
        metadata=flag(
            "--missing-kv-policy",
            "what decode does when pool blocks are missing (none: each "
            "decode instance's own default)",
        ),
    )
    local_prefill_below_tokens: int = field(
        default=DEFAULT_LOCAL_PREFILL_BELOW_TOKENS,
        metadata=flag(
            "--local-prefill-below-tokens",
            "conditional disaggregation: a prompt of which fewer tokens than this are missing "
            "from P's caches (device and pool) is prefilled by D itself, without the handoff "
            "through the pool (P tokenizes and decides); 0: every prompt goes through P. The "
            "default is the measured crossover of docs/benchmarks/pd.md",
        ),
    )

    def __post_init__(self) -> None:
        if self.local_prefill_below_tokens < 0:
            raise ValueError(
                f"--local-prefill-below-tokens must be >= 0, got {self.local_prefill_below_tokens}"
            )
