"""RouterConfig: everything `pdrouter serve` decides, built once at the edge (serve.py).

Each default is written here once; serve.py's flags take theirs from these dataclasses.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdrouter.common.body_limit import ROUTER_BYTES_PER_TOKEN
from pdrouter.common.http_guard import HeadLimits
from pdrouter.router.instances.instance import HealthThresholds
from pdrouter.router.orchestrator.config import OrchestratorConfig
from pdrouter.router.selection.admission import AdmissionConfig
from pdrouter.router.selection.breaker import BreakerConfig


@dataclass(frozen=True)
class RouterConfig:
    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    prefill_policy: str = "round_robin"
    decode_policy: str = "round_robin"
    orchestrator: OrchestratorConfig = field(default_factory=OrchestratorConfig)
    health_interval_s: float = 1.0
    startup_wait_s: float = 60.0
    api_key: str | None = None
    admin_key: str | None = None  # /instances* (and other admin endpoints); None: open
    internal_secret: str | None = None  # sent to workers on every hop (X-PD-Internal-Secret)
    heartbeat_ttl_s: float = 10.0  # a registered instance silent this long is removed
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    timeline_capacity: int = 1024  # recent requests whose timeline /debug/requests keeps
    upstream_client: str = "auto"  # h1 | aiohttp | auto = h1 (pdrouter.router.upstream.factory)
    # A longer request body is refused with 413; None: derived from the served context length
    # (pdrouter.common.body_limit), a longer body refused with 400 context_length_exceeded.
    max_body_bytes: int | None = None
    max_bytes_per_token: int = ROUTER_BYTES_PER_TOKEN  # the derived bound's bytes per token
    health: HealthThresholds = field(default_factory=HealthThresholds)
    head_limits: HeadLimits = field(default_factory=HeadLimits)  # request heads (http_guard)


# Every flag of `pdrouter serve` takes its default from here (serve.py).
DEFAULTS = RouterConfig(prefill_urls=(), decode_urls=())
