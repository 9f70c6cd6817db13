"""Cache scopes in the key chain: disjoint keys across scopes, equal keys within one, the same
in every process, and the scope a router or worker derives from a key and a cache_salt."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

from pdrouter.wire.pd import cache_scope, tenant_of_key
from tests.repo import REPO_ROOT
from workers.pool.keys import (
    DEFAULT_NAMESPACE,
    ROOT_TAG,
    SCOPE_TAG,
    block_hashes,
    block_keys,
    model_fingerprint,
    next_block_hash,
)

FP = model_fingerprint("tiny", "float16", 2, 4, 16, 16, 1)
TOKENS = [(i * 7919) % 50_000 for i in range(70)]  # 4 full blocks of 16 + a tail of 6
ALICE = cache_scope(tenant_of_key("key-alice"), None)
BOB = cache_scope(tenant_of_key("key-bob"), None)

_CHILD = """
import json, sys
from pdrouter.wire.pd import cache_scope, tenant_of_key
from workers.pool.keys import block_keys
fp, tokens, key, salt = json.loads(sys.argv[1])
scope = cache_scope(tenant_of_key(key), salt)
print(json.dumps([scope, block_keys(fp, tokens, 16, scope=scope)]))
"""


def test_different_scopes_give_disjoint_keys_at_every_block():
    unscoped = set(block_keys(FP, TOKENS, 16))
    alice = block_keys(FP, TOKENS, 16, scope=ALICE)
    bob = block_keys(FP, TOKENS, 16, scope=BOB)
    assert len(alice) == len(bob) == len(unscoped) == 5
    assert not set(alice) & set(bob)
    assert not set(alice) & unscoped and not set(bob) & unscoped
    # A scope's keys diverge from the first block on, not only at the root's own hash.
    assert block_hashes(FP, TOKENS[:16], 16, ALICE) != block_hashes(FP, TOKENS[:16], 16, BOB)


def test_same_scope_gives_the_same_keys_and_shares_prefixes():
    assert block_keys(FP, TOKENS, 16, scope=ALICE) == block_keys(FP, TOKENS, 16, scope=ALICE)
    longer = block_keys(FP, [*TOKENS, 1, 2, 3], 16, scope=ALICE)
    assert longer[:4] == block_keys(FP, TOKENS, 16, scope=ALICE)[:4]


def test_no_scope_keeps_the_unscoped_chain():
    assert block_keys(FP, TOKENS, 16, scope=None) == block_keys(FP, TOKENS, 16)
    assert cache_scope(None, None) is None


def test_scoped_root_matches_the_documented_formula():
    keys = block_keys(FP, TOKENS[:32], 16, scope=ALICE)
    root = hashlib.sha256(ROOT_TAG + FP.encode()).digest()
    digest = hashlib.sha256(root + SCOPE_TAG + ALICE.encode()).digest()
    for i, key in enumerate(keys):
        data = b"".join(t.to_bytes(4, "little", signed=True) for t in TOKENS[i * 16 : (i + 1) * 16])
        digest = hashlib.sha256(digest + data).digest()
        assert key == f"{DEFAULT_NAMESPACE}/{FP}/{digest.hex()}"
    # The device cache's one-step function agrees with the pool keys'.
    first = next_block_hash(FP, None, tuple(TOKENS[:16]), ALICE)
    assert keys[0].rsplit("/", 1)[1] == first


def test_scope_of_tenants_and_salts():
    alice = tenant_of_key("key-alice")
    assert alice == hashlib.sha256(b"pdrouter:tenant:v1\0key-alice").hexdigest()
    assert "key-alice" not in alice
    scopes = {
        cache_scope(alice, None),
        cache_scope(alice, "s1"),
        cache_scope(alice, "s2"),
        cache_scope(tenant_of_key("key-bob"), "s1"),
        cache_scope(None, "s1"),
        cache_scope(None, "s2"),
    }
    assert None not in scopes and len(scopes) == 6  # every pair its own scope
    assert cache_scope(alice, "s1") == cache_scope(alice, "s1")
    # The pair is encoded unambiguously: moving text between tenant and salt changes it.
    assert cache_scope("ab", "c") != cache_scope("a", "bc")


def _scoped_keys_in_child(hash_seed: str, key: str, salt: str | None) -> list:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps([FP, TOKENS, key, salt])],
        env={"PYTHONHASHSEED": hash_seed, "PATH": ""},
        capture_output=True,
        text=True,
        check=True,
        cwd=str(REPO_ROOT),
    )
    return json.loads(out.stdout)


def test_same_scoped_keys_in_two_processes_with_different_hash_seeds():
    scope = cache_scope(tenant_of_key("key-alice"), "salt")
    here = [scope, block_keys(FP, TOKENS, 16, scope=scope)]
    assert _scoped_keys_in_child("1", "key-alice", "salt") == here
    assert _scoped_keys_in_child("2", "key-alice", "salt") == here
    other = _scoped_keys_in_child("3", "key-bob", "salt")
    assert not set(other[1]) & set(here[1])
