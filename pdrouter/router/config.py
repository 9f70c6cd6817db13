"""RouterConfig: everything `pdrouter serve` decides, built once at the edge (serve.py).

Each default is written here once (and in the dataclasses nested here); the flags of
`pdrouter serve` and their PDROUTER_* mirrors are generated from these fields
(pdrouter.common.flags): a field's flag(...) metadata names the flag and holds its help.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdrouter.common.body_limit import ROUTER_BYTES_PER_TOKEN
from pdrouter.common.flags import flag
from pdrouter.common.http_guard import HeadLimits
from pdrouter.common.tracing import TracingConfig
from pdrouter.router.instances.instance import HealthThresholds
from pdrouter.router.orchestrator.config import OrchestratorConfig
from pdrouter.router.selection.admission import AdmissionConfig
from pdrouter.router.selection.breaker import BreakerConfig
from pdrouter.router.selection.cache_aware import CacheRoutingConfig
from pdrouter.router.selection.policies import POLICIES
from pdrouter.router.tenancy.gate import TenancyConfig
from pdrouter.router.upstream.factory import UPSTREAM_CLIENTS

_POLICY_NAMES = tuple(sorted(POLICIES))


@dataclass(frozen=True)
class RouterConfig:
    prefill_urls: tuple[str, ...] = field(
        default=(),
        metadata=flag(
            "--prefill",
            "prefill instance base URLs, e.g. http://127.0.0.1:8101 (none: workers "
            "register themselves with `pdworker serve --router URL`)",
            metavar="URL",
        ),
    )
    decode_urls: tuple[str, ...] = field(
        default=(),
        metadata=flag(
            "--decode",
            "decode instance base URLs (give both --prefill and --decode, or neither)",
            metavar="URL",
        ),
    )
    host: str = field(default="127.0.0.1", metadata=flag("--host", "address to bind"))
    port: int = field(default=8000, metadata=flag("--port", "port to serve on"))
    log_level: str = field(default="info", metadata=flag("--log-level", "python logging level"))
    prefill_policy: str = field(
        default="round_robin",
        metadata=flag(
            "--prefill-policy", "how a prefill instance is chosen", choices=_POLICY_NAMES
        ),
    )
    decode_policy: str = field(
        default="round_robin",
        metadata=flag("--decode-policy", "how a decode instance is chosen", choices=_POLICY_NAMES),
    )
    orchestrator: OrchestratorConfig = field(default_factory=OrchestratorConfig)
    cache_routing: CacheRoutingConfig = field(default_factory=CacheRoutingConfig)
    health_interval_s: float = field(
        default=1.0,
        metadata=flag("--health-interval-s", "period of the /health checks of every instance"),
    )
    startup_wait_s: float = field(
        default=60.0,
        metadata=flag(
            "--startup-wait-s", "how long to wait at start for every instance to answer /health"
        ),
    )
    api_key: str | None = field(
        default=None,
        repr=False,
        metadata=flag(
            "--api-key",
            "require 'Authorization: Bearer KEY' on /v1/* and every other path but "
            "/health, and the admin key on /metrics and the API docs (none: open); several keys "
            "separated by commas, each its own prefix cache tenant; set it through "
            "PDROUTER_API_KEY: argv is public (docs/security.md)",
        ),
    )
    admin_key: str | None = field(
        default=None,
        repr=False,
        metadata=flag(
            "--admin-key",
            "require 'Authorization: Bearer KEY' on /instances* and /debug/* (and, "
            "with --api-key or --api-keys-file, /metrics, the API docs and the detailed "
            "/health); none: open, or closed when a client key is set. Set it through "
            "PDROUTER_ADMIN_KEY: argv is public",
        ),
    )
    internal_secret: str | None = field(
        default=None,
        repr=False,
        metadata=flag(
            "--internal-secret",
            "shared secret sent to workers on every hop "
            "(X-PD-Internal-Secret); workers started with the same --internal-secret refuse "
            "/internal/* without it",
        ),
    )
    share_cache_across_keys: bool = field(
        default=False,
        metadata=flag(
            "--share-cache-across-keys",
            "let clients of different API keys share prefix cache blocks (device caches, the "
            "pool, write-back): each one's cached_tokens and first-token time then tell "
            "whether another key sent the same prompt (docs/security.md). Off: each key is "
            "its own cache tenant; a request's cache_salt narrows it further either way",
        ),
    )
    heartbeat_ttl_s: float = field(
        default=10.0,
        metadata=flag(
            "--heartbeat-ttl-s", "a self-registered instance silent this long is removed"
        ),
    )
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    health: HealthThresholds = field(default_factory=HealthThresholds)
    timeline_capacity: int = field(
        default=1024,
        metadata=flag(
            "--timeline-capacity", "recent requests whose timeline GET /debug/requests/{id} keeps"
        ),
    )
    upstream_client: str = field(
        default="auto",
        metadata=flag(
            "--upstream-client",
            "HTTP client for calls to workers: h1 (our own HTTP/1.1 client "
            "on httptools: half aiohttp's time per call), aiohttp (about half httpx's CPU per "
            "request); auto: h1",
            choices=UPSTREAM_CLIENTS,
        ),
    )
    max_body_bytes: int | None = field(
        default=None,
        metadata=flag(
            "--max-body-bytes",
            "largest request body the OpenAI routes accept; a longer one is "
            "refused with 413 (default: derived from the served context length, max_model_len x "
            "--max-bytes-per-token + 64 KiB, a longer one refused with 400 "
            "context_length_exceeded before any worker is touched)",
        ),
    )
    max_bytes_per_token: int = field(
        default=ROUTER_BYTES_PER_TOKEN,
        metadata=flag(
            "--max-bytes-per-token",
            "bytes of request body allowed per token of context when "
            "--max-body-bytes is not given (a generous bound on a token's length in text)",
        ),
    )
    head_limits: HeadLimits = field(default_factory=HeadLimits)  # request heads (http_guard)
    tenancy: TenancyConfig = field(default_factory=TenancyConfig)  # keys file, queue
    tracing: TracingConfig = field(default_factory=TracingConfig)  # --otlp-endpoint


# The defaults, for code that reads one without building a config.
DEFAULTS = RouterConfig()
