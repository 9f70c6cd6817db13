"""The router's cache scope: one tenant per API key (several keys in --api-key), hashed once,
combined with the request's cache_salt once per request; none shared across keys unless
--share-cache-across-keys; the prompt keys cache_aware matches start from it."""

from __future__ import annotations

import pytest

from pdrouter.common.auth import api_keys, matching_api_key
from pdrouter.common.doors import router_door
from pdrouter.router.config import RouterConfig
from pdrouter.router.instances.registry import Registry
from pdrouter.router.service import RouterService
from pdrouter.wire.errors import APIError
from pdrouter.wire.pd import (
    DecodeRequest,
    PrefillRequest,
    cache_scope,
    decode_request_json,
    prefill_request_json,
    tenant_of_key,
)
from pdrouter.wire.prompt_keys import prompt_keys

KEYS = "key-a,key-b"


def _service(**cfg) -> RouterService:
    return RouterService(RouterConfig(**cfg), Registry([], []))


def test_several_keys_each_open_the_door() -> None:
    assert api_keys(KEYS) == ("key-a", "key-b") and api_keys(None) == ()
    assert matching_api_key("Bearer key-b", KEYS) == "key-b"
    assert matching_api_key(f"Bearer {KEYS}", KEYS) is None  # the list is no key
    door = router_door(KEYS, "admin")
    for key in ("key-a", "key-b"):
        assert door.admits("/v1/models", {"authorization": f"Bearer {key}"}.get)
    assert not door.admits("/v1/models", {"authorization": "Bearer key-c"}.get)


def test_each_key_is_its_own_tenant() -> None:
    service = _service(api_key=KEYS)
    assert service.check_api_key("Bearer key-a") == tenant_of_key("key-a")
    assert service.check_api_key("Bearer key-b") == tenant_of_key("key-b")
    assert tenant_of_key("key-a") != tenant_of_key("key-b")
    with pytest.raises(APIError) as err:
        service.check_api_key("Bearer key-c")
    assert err.value.status == 401


def test_sharing_across_keys_and_no_keys_have_no_tenant() -> None:
    shared = _service(api_key=KEYS, share_cache_across_keys=True)
    assert shared.check_api_key("Bearer key-a") is None
    with pytest.raises(APIError):
        shared.check_api_key("Bearer nope")
    assert _service().check_api_key(None) is None


def test_prompt_keys_start_from_the_scope() -> None:
    doc = {"prompt": "x" * 200}
    alice = cache_scope(tenant_of_key("key-a"), None)
    bob = cache_scope(tenant_of_key("key-b"), None)
    names = {scope: prompt_keys(doc, cache_scope=scope) for scope in (None, alice, bob)}
    assert len({n[0] for n in names.values()}) == 3  # no key shared
    assert prompt_keys(doc, cache_scope=alice) == names[alice]


@pytest.mark.parametrize("scope", [None, cache_scope(None, "salt")])
def test_the_scope_travels_to_p_and_d_as_the_models_document(scope: str | None) -> None:
    body = b'{"model":"m","prompt":"hi","seed":1}'
    sent = prefill_request_json("r", "completions", body, scope)
    assert PrefillRequest.model_validate_json(sent).cache_scope == scope
    sent = decode_request_json("r", "completions", body, [1, 2], [3], None, None, scope)
    assert DecodeRequest.model_validate_json(sent).cache_scope == scope


def test_the_workers_accept_no_other_scope_than_a_digest() -> None:
    with pytest.raises(ValueError):
        PrefillRequest(request_id="r", endpoint="chat", body={}, cache_scope="tenant-a")
