"""Every door of every server the project starts, in one table per server (AuthGate).

A deployment authenticates in four ways: client keys (`--api-key`, one or several; the keys
of `--api-keys-file`, the router's alone), the admin key (`--admin-key`), and the internal
secret the router sends its workers (`--internal-secret`). "Client auth" below means a client
key of either kind is configured on that server (on a worker: `--api-key` or
`--router-only`). Whatever the combination, every path answers 401 without the credential its
row names, except the liveness probe `/health`, which says only whether the server is up
(`{"status": ...}`): the detailed view (instance URLs, fingerprints, model internals) needs
what the *_DETAIL_PATH (/metrics) of the same server needs.

    router  /health                    open (liveness); details as /metrics
            /instances*, /debug/*      admin key (closed when no admin key but a client key
                                       is set; open when no key at all is set)
            /metrics, /docs*, /redoc,  admin key with client auth (closed without an admin
            /openapi.json              key); else open: a cluster without client keys is a
                                       loopback development setup
            everything else (/v1/*,    with client auth: any key of --api-key or of the keys
            /tokenize, /detokenize,    file; else open
            /tokenizer_info, unknown)
    worker  /internal/*                the internal secret (open when none is set)
            /health                    open (liveness); details as /metrics
            /v1/*, /tokenize,          --api-key or the internal secret; with --router-only
            /detokenize,               and no --api-key, the internal secret alone (a client
            /tokenizer_info            key holder calling a worker would dodge the router's
                                       per-key limits); with neither, open
            everything else (/metrics, the internal secret or the admin key with --api-key or
            /docs, /openapi.json)      --router-only; else open
    pool owner  /health                open (liveness); details with the admin key
            everything else (/metrics) admin key (open when none is set)

`pdrouter launch` always sets an admin key and an internal secret (random unless given), gives
the workers its --api-key, and starts them with --router-only when the router has a keys file
(pdrouter.launch.spec.ClusterSpec.keys_file_mode), so no worker of a keyed cluster answers
anyone without a credential.
"""

from __future__ import annotations

from pdrouter.common.auth import OPEN, AuthGate, Credential, KeyRing
from pdrouter.wire.tokenize import DETOKENIZE_PATH, TOKENIZE_PATH, TOKENIZER_INFO_PATH

LIVENESS_PATH = "/health"
ROUTER_ADMIN_PATHS = ("/instances", "/instances/", "/debug/")
ROUTER_OBSERVE_PATHS = ("/metrics", "/docs", "/docs/", "/redoc", "/openapi.json")
WORKER_CLIENT_PATHS = ("/v1/", TOKENIZE_PATH, DETOKENIZE_PATH, TOKENIZER_INFO_PATH)
ADMIN: frozenset[Credential] = frozenset({"admin"})
CLIENT: frozenset[Credential] = frozenset({"client"})
INTERNAL: frozenset[Credential] = frozenset({"internal"})
WORKER_ADMIN: frozenset[Credential] = frozenset({"internal", "admin"})
# /health answers in full to whoever may call this path of the same server (gate.admits).
ROUTER_DETAIL_PATH = WORKER_DETAIL_PATH = OWNER_DETAIL_PATH = "/metrics"


def _keys(**given: str | None) -> dict[Credential, str]:
    return {kind: value for kind, value in given.items() if value}  # type: ignore[misc]


def router_door(
    api_key: str | None, admin_key: str | None, key_ring: KeyRing | None = None
) -> AuthGate:
    """The router's table; key_ring: the keys file's keys (--api-keys-file), accepted beside
    --api-key's wherever a client key is. Open only when no key of any kind is set."""
    keys = _keys(client=api_key, admin=admin_key)
    client_auth = bool(api_key) or key_ring is not None
    admin = ADMIN if keys or client_auth else OPEN
    observe = ADMIN if client_auth else OPEN
    routes = (
        (LIVENESS_PATH, OPEN),
        *((path, admin) for path in ROUTER_ADMIN_PATHS),
        *((path, observe) for path in ROUTER_OBSERVE_PATHS),
    )
    return AuthGate(keys, routes, CLIENT if client_auth else OPEN, key_ring)


def worker_door(
    api_key: str | None,
    internal_secret: str | None,
    admin_key: str | None,
    router_only: bool = False,
) -> AuthGate:
    """A worker's table. /internal/* needs the secret whenever one is set; with an API key or
    router_only (a worker behind a router with a keys file) every other path but /health is
    locked too: the client routes to the API key or the secret, the rest to the secret or the
    admin key."""
    assert internal_secret or not router_only, "router_only needs an internal secret"
    keys = _keys(client=api_key, internal=internal_secret, admin=admin_key)
    locked = bool(api_key) or router_only
    internal = INTERNAL if internal_secret else OPEN
    client = (frozenset({"client", "internal"}) if api_key else INTERNAL) if locked else OPEN
    admin = WORKER_ADMIN if locked else OPEN
    routes = (
        (LIVENESS_PATH, OPEN),
        ("/internal/", internal),
        *((path, client) for path in WORKER_CLIENT_PATHS),
    )
    return AuthGate(keys, routes, admin)


def owner_door(admin_key: str | None) -> AuthGate:
    """The pool owner's table: everything but /health needs the admin key, when set."""
    return AuthGate(_keys(admin=admin_key), ((LIVENESS_PATH, OPEN),), ADMIN if admin_key else OPEN)
