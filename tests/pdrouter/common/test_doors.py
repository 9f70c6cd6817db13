"""The door tables: what each server accepts on each path, and the AuthGate checks behind it."""

from __future__ import annotations

import json

import pytest

from pdrouter.common.auth import INTERNAL_SECRET_HEADER, AuthGate
from pdrouter.common.doors import owner_door, router_door, worker_door

API, ADMIN, SECRET = "sk-api-1", "admin-2", "secret-3"
NONE: dict[str, str] = {}
CLIENT = {"authorization": f"Bearer {API}"}
ADMIN_H = {"authorization": f"Bearer {ADMIN}"}
INTERNAL = {INTERNAL_SECRET_HEADER.lower(): SECRET}
CREDENTIALS = {"none": NONE, "client": CLIENT, "admin": ADMIN_H, "internal": INTERNAL}


def _admitted(gate: AuthGate, path: str) -> list[str]:
    """Which of the four callers the gate lets through on path."""
    return [name for name, headers in CREDENTIALS.items() if gate.admits(path, headers.get)]


ROUTER_PATHS = {
    "/health": ["none", "client", "admin", "internal"],
    "/v1/chat/completions": ["client"],
    "/v1/models": ["client"],
    "/instances": ["admin"],
    "/instances/p0/drain": ["admin"],
    "/debug/requests/x": ["admin"],
    "/metrics": ["admin"],
    "/openapi.json": ["admin"],
    "/docs": ["admin"],
    "/docs/oauth2-redirect": ["admin"],
    "/": ["client"],
    "/instancesx": ["client"],  # a prefix is only a prefix at a "/"
    "/no-such-path": ["client"],
}


@pytest.mark.parametrize(("path", "expected"), ROUTER_PATHS.items())
def test_a_keyed_router_admits_exactly_the_right_key_on_each_path(
    path: str, expected: list[str]
) -> None:
    assert _admitted(router_door(API, ADMIN), path) == expected


def test_router_without_keys_is_open_and_with_an_admin_key_only_guards_its_admin_api() -> None:
    everyone = list(CREDENTIALS)
    assert all(_admitted(router_door(None, None), p) == everyone for p in ROUTER_PATHS)
    admin_only = router_door(None, ADMIN)
    assert _admitted(admin_only, "/instances") == ["admin"]
    assert _admitted(admin_only, "/debug/requests/x") == ["admin"]
    assert _admitted(admin_only, "/metrics") == everyone
    assert _admitted(admin_only, "/v1/completions") == everyone
    # An API key without an admin key: the admin paths are closed to everyone.
    api_only = router_door(API, None)
    assert _admitted(api_only, "/instances") == []
    assert _admitted(api_only, "/metrics") == []
    assert _admitted(api_only, "/health") == everyone
    body = json.loads(api_only.refusal_body("/instances"))
    assert body["error"] == {
        "message": "/instances is closed: this server has no admin key set",
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_admin_key",
    }


WORKER_PATHS = {
    "/health": ["none", "client", "admin", "internal"],
    "/v1/completions": ["client", "internal"],
    "/v1/models": ["client", "internal"],
    "/internal/prefill": ["internal"],
    "/metrics": ["admin", "internal"],
    "/openapi.json": ["admin", "internal"],
    "/no-such-path": ["admin", "internal"],
}


@pytest.mark.parametrize(("path", "expected"), WORKER_PATHS.items())
def test_a_keyed_worker_admits_exactly_the_right_credential_on_each_path(
    path: str, expected: list[str]
) -> None:
    assert _admitted(worker_door(API, SECRET, ADMIN), path) == expected


def test_a_worker_without_an_api_key_guards_only_its_internal_routes() -> None:
    gate = worker_door(None, SECRET, ADMIN)
    assert _admitted(gate, "/internal/decode") == ["internal"]
    assert _admitted(gate, "/v1/completions") == list(CREDENTIALS)
    assert _admitted(gate, "/metrics") == list(CREDENTIALS)
    assert _admitted(worker_door(None, None, None), "/internal/decode") == list(CREDENTIALS)


def test_pool_owner_needs_the_admin_key_everywhere_but_health() -> None:
    gate = owner_door(ADMIN)
    assert _admitted(gate, "/health") == list(CREDENTIALS)
    assert _admitted(gate, "/metrics") == ["admin"]
    assert _admitted(gate, "/anything") == ["admin"]
    assert _admitted(owner_door(None), "/metrics") == list(CREDENTIALS)


def test_refusals_name_what_is_needed_never_a_value() -> None:
    gate = worker_door(API, SECRET, ADMIN)
    message = json.loads(gate.refusal_body("/v1/models"))["error"]["message"]
    assert message == (
        "invalid or missing API key (send 'Authorization: Bearer <API key>') or internal "
        f"secret (send '{INTERNAL_SECRET_HEADER}: <secret>')"
    )
    for value in (API, SECRET, ADMIN):
        assert value not in message and value not in repr(gate)
    # A wrong key, a key without its scheme, a non-ASCII header: refusals, not crashes.
    for headers in (
        {"authorization": "Bearer wrong"},
        {"authorization": API},
        {"authorization": "Bearer \u00e9"},
        {INTERNAL_SECRET_HEADER.lower(): SECRET + "x"},
    ):
        assert not gate.admits("/v1/models", headers.get)


class _Ring:
    """A keys file's lookup (pdrouter.router.tenancy.keys_file.KeysFile.match), one key."""

    def match(self, authorization: str | None) -> object | None:
        return object() if authorization == f"Bearer {FILE_KEY}" else None


FILE_KEY = "sk-file-4"
FILE = {"authorization": f"Bearer {FILE_KEY}"}


def test_a_router_with_a_keys_file_admits_its_keys_as_client_keys_and_locks_observation() -> None:
    for api_key in (None, API):
        gate = router_door(api_key, ADMIN, _Ring())
        callers = {**CREDENTIALS, "file": FILE}
        admitted = {
            path: [n for n, h in callers.items() if gate.admits(path, h.get)]
            for path in ("/v1/models", "/tokenize", "/tokenizer_info", "/metrics", "/health")
        }
        client = ["client", "file"] if api_key else ["file"]
        assert admitted == {
            "/v1/models": client,
            "/tokenize": client,
            "/tokenizer_info": client,
            "/metrics": ["admin"],
            "/health": [*CREDENTIALS, "file"],
        }
    # No admin key: the admin and observation paths are closed, not open.
    assert _admitted(router_door(None, None, _Ring()), "/metrics") == []
    assert _admitted(router_door(None, None, _Ring()), "/instances") == []


def test_a_router_only_worker_admits_the_secret_alone_unless_it_has_an_api_key() -> None:
    gate = worker_door(None, SECRET, ADMIN, router_only=True)
    for path in ("/v1/completions", "/tokenize", "/detokenize", "/tokenizer_info"):
        assert _admitted(gate, path) == ["internal"], path
    assert _admitted(gate, "/metrics") == ["admin", "internal"]
    assert _admitted(gate, "/health") == list(CREDENTIALS)
    both = worker_door(API, SECRET, ADMIN, router_only=True)
    assert _admitted(both, "/tokenizer_info") == ["client", "internal"]
