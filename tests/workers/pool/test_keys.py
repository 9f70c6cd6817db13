"""Key scheme: deterministic across processes, chained, partial tails, fingerprint-scoped."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest

from tests.repo import REPO_ROOT
from workers.pool.keys import (
    DEFAULT_NAMESPACE,
    ROOT_TAG,
    block_hashes,
    block_keys,
    is_partial_key,
    logical_key,
    model_fingerprint,
    partial_num_tokens,
    shard_key,
)

FP_ARGS = ("tiny", "float16", 2, 4, 16, 16)
TOKENS = [(i * 7919) % 50_000 for i in range(70)]  # 4 full blocks of 16 + a tail of 6

_CHILD = """
import json, sys
from workers.pool.keys import block_keys, model_fingerprint
fp = model_fingerprint(*json.loads(sys.argv[1]))
print(json.dumps([fp, block_keys(fp, json.loads(sys.argv[2]), 16)]))
"""


def _keys_in_child(hash_seed: str) -> list:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(FP_ARGS), json.dumps(TOKENS)],
        env={"PYTHONHASHSEED": hash_seed, "PATH": ""},
        capture_output=True,
        text=True,
        check=True,
        cwd=str(REPO_ROOT),
    )
    return json.loads(out.stdout)


def test_same_keys_in_two_processes_with_different_hash_seeds():
    fp = model_fingerprint(*FP_ARGS)
    here = [fp, block_keys(fp, TOKENS, 16)]
    assert _keys_in_child("1") == here
    assert _keys_in_child("2") == here


def test_key_layout_and_chaining_match_the_documented_formula():
    fp = model_fingerprint(*FP_ARGS)
    keys = block_keys(fp, TOKENS, 16)
    assert len(keys) == 5
    digest = hashlib.sha256(ROOT_TAG + fp.encode()).digest()
    for i, key in enumerate(keys):
        chunk = TOKENS[i * 16 : (i + 1) * 16]
        data = b"".join(t.to_bytes(4, "little", signed=True) for t in chunk)
        digest = hashlib.sha256(digest + data).digest()
        suffix = ":partial:6" if i == 4 else ""
        assert key == f"{DEFAULT_NAMESPACE}/{fp}/{digest.hex()}{suffix}"


def test_partial_keys():
    fp = model_fingerprint(*FP_ARGS)
    keys = block_keys(fp, TOKENS, 16)
    assert [is_partial_key(k) for k in keys] == [False] * 4 + [True]
    assert partial_num_tokens(keys[-1]) == 6
    with pytest.raises(ValueError, match="not a partial-block key"):
        partial_num_tokens(keys[0])
    # Exact multiples of the block size have no partial key.
    assert not any(is_partial_key(k) for k in block_keys(fp, TOKENS[:64], 16))
    # A longer tail is a different key (the tail's tokens and count are both in it) ...
    longer = block_keys(fp, TOKENS[:69], 16)
    assert longer[:4] == keys[:4] and longer[4] != keys[4]
    assert partial_num_tokens(longer[4]) == 5
    # ... and once the tail fills up, block 4 gets a full key, a different one.
    filled = block_keys(fp, TOKENS + [1] * 10, 16)
    assert filled[:4] == keys[:4]
    assert not is_partial_key(filled[4]) and filled[4] != keys[4].split(":")[0]


def test_prefix_sharing_and_divergence():
    fp = model_fingerprint(*FP_ARGS)
    base = block_keys(fp, TOKENS, 16)
    changed = list(TOKENS)
    changed[20] += 1  # inside block 1
    other = block_keys(fp, changed, 16)
    assert other[0] == base[0]
    assert all(a != b for a, b in zip(base[1:], other[1:], strict=True))


def test_fingerprint_change_changes_every_key():
    fp = model_fingerprint(*FP_ARGS)
    base = block_keys(fp, TOKENS, 16)
    variants = [
        ("other-model", "float16", 2, 4, 16, 16),
        ("tiny", "bfloat16", 2, 4, 16, 16),
        ("tiny", "float16", 3, 4, 16, 16),
        ("tiny", "float16", 2, 8, 16, 16),
        ("tiny", "float16", 2, 4, 32, 16),
        ("tiny", "float16", 2, 4, 16, 16, "digest"),
    ]
    fingerprints = {fp}
    for args in variants:
        other_fp = model_fingerprint(*args)
        fingerprints.add(other_fp)
        other = block_keys(other_fp, TOKENS, 16)
        assert len(other) == len(base)
        for a, b in zip(base, other, strict=True):
            assert a != b
            assert a.rsplit("/", 1)[1] != b.rsplit("/", 1)[1]  # the hash, not just the prefix
    assert len(fingerprints) == len(variants) + 1
    assert all(len(f) == 16 and int(f, 16) >= 0 for f in fingerprints)


def test_namespace_in_key_and_shard_keys_name_their_heads():
    fp = model_fingerprint(*FP_ARGS)
    logical = block_keys(fp, TOKENS, 16, namespace="a")
    assert logical[0].startswith(f"a/{fp}/") and logical[0].count("/") == 2
    assert shard_key(logical[0], 0, 2, 4) == f"a/{fp}/h0-2of4/" + logical[0].split("/")[2]
    assert shard_key(logical[-1], 2, 4, 4).endswith(":partial:6")
    assert logical_key(shard_key(logical[-1], 2, 4, 4)) == logical[-1]
    assert shard_key(logical[0], 0, 2, 4) != shard_key(logical[0], 2, 4, 4)
    assert shard_key(logical[0], 0, 4, 4) != shard_key(logical[0], 0, 2, 4)
    with pytest.raises(ValueError, match="bad head range"):
        shard_key(logical[0], 2, 2, 4)
    assert block_hashes(fp, TOKENS, 16) == [
        k.split("/")[-1].split(":")[0] for k in block_keys(fp, TOKENS, 16)
    ]
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        block_keys(fp, TOKENS, 0)
    assert block_keys(fp, [], 16) == []
