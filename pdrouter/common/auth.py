"""Who may call what: client API keys, the admin key, and the router-to-worker secret.

    client -> router   /v1/*            Authorization: Bearer <api key>     (--api-key, or a
                                                                         key of --api-keys-file)
    admin  -> router   /instances*      Authorization: Bearer <admin key>   (--admin-key)
    router -> worker   /internal/*      X-PD-Internal-Secret: <secret>      (--internal-secret)

Every comparison is constant-time (secrets.compare_digest), so a caller cannot learn a key a
byte at a time from response times. The scheme `Bearer` is matched in any case (`bearer`,
`BEARER`: RFC 7235 auth schemes are case-insensitive); the key itself exactly. A key left
unset mostly means that door is open (doors.py says where not): the servers bind 127.0.0.1
unless told otherwise, and a deployment that listens elsewhere sets the keys.

AuthGate is the one rule every server applies ahead of its routes: which credentials a path
accepts (pdrouter.common.doors writes each server's table), checked before any routing, so an
unknown path, a wrong method or a route added later answers 401 like the others: without the
key, a wrong method on a served path gets 401, not 405 (a 405 would tell who holds no key which
routes exist); with it, the 405 and its Allow header (pdrouter.common.allow).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Awaitable, Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from pdrouter.wire.errors import APIError, clip, error_body

INTERNAL_SECRET_HEADER = "X-PD-Internal-Secret"

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def secret_matches(given: str | None, expected: str | None) -> bool:
    """True when expected is unset, or given equals it (constant time)."""
    if expected is None:
        return True
    return given is not None and secrets.compare_digest(given.encode(), expected.encode())


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header (the scheme in any case, one or
    more spaces after it), None for any other header or none."""
    if authorization is None:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.lstrip(" ")


def bearer_matches(authorization: str | None, key: str | None) -> bool:
    """True when key is unset, or the Authorization header is `Bearer <key>` (the scheme in
    any case)."""
    if key is None:
        return True
    return secret_matches(bearer_token(authorization), key)


def api_keys(value: str | None) -> tuple[str, ...]:
    """The client keys an --api-key value holds: one, or several separated by commas (each
    its own prefix cache tenant, pdrouter.wire.pd.tenant_of_key)."""
    return tuple(key for key in (value or "").split(",") if key)


def matching_api_key(authorization: str | None, value: str | None) -> str | None:
    """The key of value (api_keys) the Authorization header carries, else None; every key
    is compared, each in constant time."""
    found = None
    for key in api_keys(value):
        if bearer_matches(authorization, key):
            found = key
    return found


def require_bearer(authorization: str | None, key: str | None, what: str) -> None:
    """Raise a 401 APIError (OpenAI error shape) unless the header carries key.

    what names the key in the message ("API key", "admin key"), never its value.
    """
    if not bearer_matches(authorization, key):
        code = "invalid_api_key" if what == "API key" else "invalid_admin_key"
        raise APIError(
            401,
            f"invalid or missing {what} (send 'Authorization: Bearer <{what}>')",
            "invalid_request_error",
            code=code,
            extra_headers={"WWW-Authenticate": "Bearer"},  # as the doors' 401 (refuse)
        )


def internal_headers(secret: str | None) -> dict[str, str]:
    """The headers the router sends on every hop to a worker."""
    return {INTERNAL_SECRET_HEADER: secret} if secret is not None else {}


Credential = Literal["client", "admin", "internal"]
OPEN: frozenset[Credential] = frozenset()  # a path anyone may call (the liveness probe)
_WHAT = {
    "client": ("API key", "Authorization: Bearer <API key>", "invalid_api_key"),
    "admin": ("admin key", "Authorization: Bearer <admin key>", "invalid_admin_key"),
    "internal": ("internal secret", f"{INTERNAL_SECRET_HEADER}: <secret>", "invalid_secret"),
}


class KeyRing(Protocol):
    """Client keys looked up rather than compared (the router's --api-keys-file:
    pdrouter.router.tenancy.keys_file.KeysFile, which re-reads its file on change)."""

    def match(self, authorization: str | None) -> object | None: ...


@dataclass(frozen=True)
class AuthGate:
    """Which credentials each path accepts, and the constant-time check of them.

    routes: (path, accepted) pairs, first match wins; a path ending in "/" matches every path
    under it. default: what every other path accepts (so a route added later is locked too).
    keys: the configured value of each credential; key_ring: client keys beside keys["client"]
    (a keys file). A path whose accepted credentials are all unconfigured is closed to
    everyone, an OPEN path to no one.
    """

    keys: Mapping[Credential, str] = field(repr=False)
    routes: tuple[tuple[str, frozenset[Credential]], ...]
    default: frozenset[Credential]
    key_ring: KeyRing | None = field(default=None, repr=False)

    def configured(self) -> frozenset[Credential]:
        """The credentials this server has a value for."""
        return frozenset(self.keys) | (
            frozenset({"client"}) if self.key_ring is not None else frozenset()
        )

    def accepted(self, path: str) -> frozenset[Credential]:
        for prefix, accepted in self.routes:
            if path == prefix or (prefix.endswith("/") and path.startswith(prefix)):
                return accepted
        return self.default

    def presented(self, header: Callable[[str], str | None]) -> frozenset[Credential]:
        """The configured credentials a request carries; header(lower-case name) -> value."""
        found: set[Credential] = set()
        authorization = header("authorization")
        client = self.keys.get("client")
        if client is not None and matching_api_key(authorization, client) is not None:
            found.add("client")
        elif self.key_ring is not None and self.key_ring.match(authorization) is not None:
            found.add("client")  # a keys-file key (its digest only when --api-key did not match)
        admin = self.keys.get("admin")
        if admin is not None and bearer_matches(authorization, admin):
            found.add("admin")
        secret = self.keys.get("internal")
        if secret is not None and secret_matches(header(INTERNAL_SECRET_HEADER.lower()), secret):
            found.add("internal")
        return frozenset(found)

    def locked(self, path: str) -> bool:
        """Whether path needs a credential (the OpenAPI document declares it)."""
        return bool(self.accepted(path))

    def admits(self, path: str, header: Callable[[str], str | None]) -> bool:
        accepted = self.accepted(path)
        return not accepted or bool(accepted & self.presented(header))

    def refusal_body(self, path: str) -> bytes:
        """The OpenAI-shaped 401 body naming what path needs (never a value)."""
        accepted = sorted(self.accepted(path))
        code = _WHAT[accepted[0]][2]
        if not self.accepted(path) & self.configured():
            message = f"{clip(path)} is closed: this server has no {_WHAT[accepted[0]][0]} set"
        elif accepted == ["internal"]:  # the router relays this one in its 502 (failures.py)
            message = (
                f"{clip(path)} needs the router's shared secret in the {INTERNAL_SECRET_HEADER} "
                "header"
            )
        else:
            message = "invalid or missing " + " or ".join(
                f"{_WHAT[k][0]} (send '{_WHAT[k][1]}')" for k in accepted
            )
        return json.dumps(error_body(message, "invalid_request_error", None, code)).encode()


def scope_header(scope: Scope) -> Callable[[str], str | None]:
    """header(name) over an ASGI scope's headers (name in lower case)."""

    def get(name: str) -> str | None:
        wanted = name.encode()
        for key, value in scope["headers"]:
            if key == wanted:
                return value.decode("latin-1")
        return None

    return get


async def refuse(
    gate: AuthGate, scope: Scope, send: Send, extra_headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    """Answer 401 (OpenAI error body, WWW-Authenticate) for a request the gate refused."""
    body = gate.refusal_body(scope["path"])
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"www-authenticate", b"Bearer"),
        *(extra_headers or []),
    ]
    await send({"type": "http.response.start", "status": 401, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class GateMiddleware:
    """Pure ASGI: every HTTP request the gate refuses answers 401 before any routing (a wrong
    method too: its 405 is for those who hold the key)."""

    def __init__(self, app: ASGIApp, gate: AuthGate, routes: Sequence[Any] = ()) -> None:
        self.app = app
        self.gate = gate
        self.routes = routes  # the app's route list (kept for callers that pass it)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self.gate.admits(scope["path"], scope_header(scope)):
            await refuse(self.gate, scope, send)
            return
        await self.app(scope, receive, send)
