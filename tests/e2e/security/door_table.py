"""The doors docs/security.md documents, written out again independently of
pdrouter.common.doors, so that the walk (test_doors_matrix.py) checks the code against the
documented table rather than against itself.

    who_may(config, server, path) -> the callers that get past the door

Callers: "none" (no credential), "wrong" (a wrong key and a wrong secret), "user" (the
--api-key), "file user" (a key of --api-keys-file), "admin" (the admin key), "secret" (the
internal secret). `pdrouter launch` always sets an admin key and an internal secret.
"""

from __future__ import annotations

from dataclasses import dataclass

CALLERS = ("none", "wrong", "user", "file user", "admin", "secret")
EVERYONE = frozenset(CALLERS)
ADMIN = frozenset({"admin"})
SECRET = frozenset({"secret"})


@dataclass(frozen=True)
class DoorConfig:
    """Which client auth a launched cluster has."""

    name: str
    api_key: bool
    keys_file: bool

    @property
    def client_auth(self) -> bool:
        return self.api_key or self.keys_file

    @property
    def users(self) -> frozenset[str]:
        return frozenset(
            name for name, has in (("user", self.api_key), ("file user", self.keys_file)) if has
        )


CONFIGS = (
    DoorConfig("none", api_key=False, keys_file=False),
    DoorConfig("api-key", api_key=True, keys_file=False),
    DoorConfig("keys-file", api_key=False, keys_file=True),
    DoorConfig("both", api_key=True, keys_file=True),
)
TOKENIZER_PATHS = ("/tokenize", "/detokenize", "/tokenizer_info")


def _under(path: str, *prefixes: str) -> bool:
    return any(path == p or path.startswith(p.rstrip("/") + "/") for p in prefixes)


def _router(config: DoorConfig, path: str) -> frozenset[str]:
    if path == "/health":
        return EVERYONE  # liveness only
    if _under(path, "/instances", "/debug"):
        return ADMIN
    if _under(path, "/metrics", "/docs", "/redoc", "/openapi.json"):
        return ADMIN if config.client_auth else EVERYONE
    return config.users if config.client_auth else EVERYONE


def _worker(config: DoorConfig, path: str) -> frozenset[str]:
    if path == "/health":
        return EVERYONE
    if _under(path, "/internal"):
        return SECRET
    if not config.client_auth:  # a keyless cluster's workers: open but for /internal/*
        return EVERYONE
    if _under(path, "/v1") or path in TOKENIZER_PATHS:
        # The --api-key (which has no limits) or the router; a keys file's keys never: their
        # limits are the router's alone.
        return SECRET | frozenset({"user"} if config.api_key else ())
    return SECRET | ADMIN


def who_may(config: DoorConfig, server: str, path: str) -> frozenset[str]:
    """The callers the documented table admits on path of server ("router", "prefill",
    "decode", "mixed", "pool owner")."""
    if server == "router":
        return _router(config, path)
    if server == "pool owner":
        return EVERYONE if path == "/health" else ADMIN
    return _worker(config, path)


def detail_callers(config: DoorConfig, server: str) -> frozenset[str]:
    """Who gets the detailed /health (as /metrics)."""
    return who_may(config, server, "/metrics")
