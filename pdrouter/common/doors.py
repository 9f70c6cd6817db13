"""Every door of every server the project starts, in one table per server (AuthGate).

With a client key configured, every path answers 401 without the right credential, except the
liveness probe `/health`, which says only whether the server is up (`{"status": ...}`): the
detailed view (instance URLs, fingerprints, model internals) needs what *_DETAIL_PATH needs.

    router  /health                    open (liveness); details as /metrics
            /instances*, /debug/*      admin key (closed when only an API key is set)
            /metrics, /docs*, /redoc,  admin key when an API key is set (else open: a
            /openapi.json              keyless cluster is a loopback development setup)
            everything else (/v1/*)    API key
    worker  /internal/*                the router's shared secret
            /health                    open (liveness); details with the secret or admin key
            /v1/*, /tokenize*,         API key or the shared secret
            /detokenize
            everything else (/metrics) the shared secret or the admin key
    pool owner  /health                open (liveness); details with the admin key
            everything else (/metrics) admin key

Without any key a server is open as before (loopback development), but for the router's
admin API, which needs the admin key whenever one is set. A router with an API key but no
admin key keeps its admin paths closed to everyone rather than open.
"""

from __future__ import annotations

from pdrouter.common.auth import OPEN, AuthGate, Credential

LIVENESS_PATH = "/health"
ROUTER_ADMIN_PATHS = ("/instances", "/instances/", "/debug/")
ROUTER_OBSERVE_PATHS = ("/metrics", "/docs", "/docs/", "/redoc", "/openapi.json")
ADMIN: frozenset[Credential] = frozenset({"admin"})
CLIENT: frozenset[Credential] = frozenset({"client"})
INTERNAL: frozenset[Credential] = frozenset({"internal"})
WORKER_ADMIN: frozenset[Credential] = frozenset({"internal", "admin"})
# /health answers in full to whoever may call this path of the same server (gate.admits).
ROUTER_DETAIL_PATH = WORKER_DETAIL_PATH = OWNER_DETAIL_PATH = "/metrics"


def _keys(**given: str | None) -> dict[Credential, str]:
    return {kind: value for kind, value in given.items() if value}  # type: ignore[misc]


def router_door(api_key: str | None, admin_key: str | None) -> AuthGate:
    """The router's table; open only when neither key is set."""
    keys = _keys(client=api_key, admin=admin_key)
    admin = ADMIN if keys else OPEN
    observe = ADMIN if api_key else OPEN
    routes = (
        (LIVENESS_PATH, OPEN),
        *((path, admin) for path in ROUTER_ADMIN_PATHS),
        *((path, observe) for path in ROUTER_OBSERVE_PATHS),
    )
    return AuthGate(keys, routes, CLIENT if api_key else OPEN)


def worker_door(
    api_key: str | None, internal_secret: str | None, admin_key: str | None
) -> AuthGate:
    """A worker's table. /internal/* needs the secret whenever one is set (as before); with
    an API key every other path but /health is locked too."""
    keys = _keys(client=api_key, internal=internal_secret, admin=admin_key)
    internal = INTERNAL if internal_secret else OPEN
    client = frozenset({"client", "internal"}) if api_key else OPEN
    admin = WORKER_ADMIN if api_key else OPEN
    routes = (
        (LIVENESS_PATH, OPEN),
        ("/internal/", internal),
        *((path, client) for path in ("/v1/", "/tokenize", "/detokenize")),
    )
    return AuthGate(keys, routes, admin)


def owner_door(admin_key: str | None) -> AuthGate:
    """The pool owner's table: everything but /health needs the admin key, when set."""
    return AuthGate(_keys(admin=admin_key), ((LIVENESS_PATH, OPEN),), ADMIN if admin_key else OPEN)
