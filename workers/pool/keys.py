"""Pool keys: pure, deterministic functions shared by prefill and decode.

A block's key depends on every token before it (chained hashes), so two prompts share a key
only when they share the whole prefix up to that block:

    h_root = sha256(ROOT_TAG || fingerprint)                 no cache scope
    h_root = sha256(sha256(ROOT_TAG || fingerprint) || SCOPE_TAG || scope)   a cache scope
    h_i    = sha256(h_{i-1} || int32le(tokens of block i))          full blocks
    h_p    = sha256(h_{last full} || int32le(tokens of the tail))    partial last block

    key    = {namespace}/{fingerprint}/{hex(h_i)}                       logical: the block
    key_p  = {namespace}/{fingerprint}/{hex(h_p)}:partial:{n}          n = tokens in tail
    shard  = {namespace}/{fingerprint}/h{start}-{end}of{total}/{hex(h_i)}[:partial:{n}]
    header_key(shard) = {shard}:header    the object's header (--pool-integrity on;
                                          workers/pool/object_header.py)

A pool object holds the KV heads [start, end) of the model's `total` KV heads of one block:
a worker of TP size t writes t shards per block, one per rank. The fingerprint names the
model, never a TP size, so every TP size computes the same logical keys, and a reader of
any TP size finds the shards covering its heads by name (workers/engine/tp/shards.py).

A cache scope (a tenant and/or a request's cache_salt, as pdrouter.wire.pd.cache_scope
derives it) enters the root, so every block of a scoped sequence has a key of its own: two
scopes never share a block, on a device prefix cache or in the pool, while one scope (or no
scope) keeps sharing exactly as before. Equal keys still mean equal KV.

Never Python's hash(): P and D are different processes with different hash seeds.
"""

from __future__ import annotations

import hashlib
import json
import struct

ROOT_TAG = b"pdrouter/kv/v1"
SCOPE_TAG = b":scope:"
DEFAULT_NAMESPACE = "pdkv"


def model_fingerprint(
    model_id: str,
    dtype: str,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    checkpoint_digest: str = "",
) -> str:
    """16 hex chars naming everything that makes two workers' KV blocks interchangeable.

    No TP size: a block's shards are named by the heads they hold (shard_key), so workers of
    different TP sizes share blocks, and the router's pairing check and cache index agree.

    checkpoint_digest (workers.engine.checkpoint_digest) covers the checkpoint's content, so
    two fine-tunes of one architecture under one folder name never share blocks; empty for a
    model without files (it then leaves the fingerprint as it was without the field)."""
    fields: dict[str, object] = {
        "model_id": model_id,
        "dtype": dtype,
        "num_layers": num_layers,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "block_size": block_size,
    }
    if checkpoint_digest:
        fields["checkpoint_digest"] = checkpoint_digest
    canonical = json.dumps(
        fields,
        sort_keys=True,
        separators=(",", ":"),
    )
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def _tokens_bytes(token_ids: list[int] | tuple[int, ...]) -> bytes:
    return struct.pack(f"<{len(token_ids)}i", *token_ids)


def chain_root(fingerprint: str, scope: str | None = None) -> bytes:
    """The parent of block 0: the fingerprint's root, narrowed by the cache scope if any."""
    root = hashlib.sha256(ROOT_TAG + fingerprint.encode()).digest()
    if scope is None:
        return root
    return hashlib.sha256(root + SCOPE_TAG + scope.encode()).digest()


def next_block_hash(
    fingerprint: str,
    parent_hash: str | None,
    token_ids: list[int] | tuple[int, ...],
    scope: str | None = None,
) -> str:
    """One step of the chain: the hex hash of a block from its predecessor's (None: block 0,
    whose parent is chain_root(fingerprint, scope); scope is only read there).

    block_hashes() is this step folded over a sequence; the engine's device prefix cache takes
    it one block at a time as a sequence grows, so a device hit and a pool hit never disagree.
    """
    parent = chain_root(fingerprint, scope) if parent_hash is None else bytes.fromhex(parent_hash)
    return hashlib.sha256(parent + _tokens_bytes(token_ids)).hexdigest()


def block_hashes(
    fingerprint: str,
    token_ids: list[int] | tuple[int, ...],
    block_size: int,
    scope: str | None = None,
) -> list[str]:
    """Chained hex hashes of the full blocks, then of the partial tail if there is one."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    hashes: list[str] = []
    parent: str | None = None
    for start in range(0, len(token_ids), block_size):
        parent = next_block_hash(fingerprint, parent, token_ids[start : start + block_size], scope)
        hashes.append(parent)
    return hashes


def block_keys(
    fingerprint: str,
    token_ids: list[int] | tuple[int, ...],
    block_size: int,
    namespace: str = DEFAULT_NAMESPACE,
    scope: str | None = None,
) -> list[str]:
    """One key per block of token_ids in order; the last one is a partial key if the tail is short.

    Block i holds tokens [i * block_size, (i + 1) * block_size); scope: the cache scope.
    These are logical keys; shard_key names the pool object of a range of KV heads.
    """
    hashes = block_hashes(fingerprint, token_ids, block_size, scope)
    prefix = f"{namespace}/{fingerprint}/"
    keys = [prefix + h for h in hashes]
    tail = len(token_ids) % block_size
    if tail:
        keys[-1] += f":partial:{tail}"
    return keys


def is_partial_key(key: str) -> bool:
    return ":partial:" in key


def partial_num_tokens(key: str) -> int:
    """Tokens held by the block a key names: n for a partial key; raises for a full key."""
    if not is_partial_key(key):
        raise ValueError(f"{key!r} is not a partial-block key")
    return int(key.rsplit(":", 1)[1])


HEADER_KEY_SUFFIX = ":header"


def header_key(key: str) -> str:
    """The key of the object holding a block's header (workers/pool/object_header.py), stored
    beside the block's payload under key."""
    return key + HEADER_KEY_SUFFIX


def heads_segment(start: int, end: int, total: int) -> str:
    """The key segment naming KV heads [start, end) of total: "h0-4of8"."""
    if not 0 <= start < end <= total:
        raise ValueError(f"bad head range [{start}, {end}) of {total}")
    return f"h{start}-{end}of{total}"


def shard_key(key: str, start: int, end: int, total: int) -> str:
    """The pool object of a logical key (block_keys) holding KV heads [start, end) of total."""
    namespace, fingerprint, rest = key.split("/", 2)
    return f"{namespace}/{fingerprint}/{heads_segment(start, end, total)}/{rest}"


def logical_key(key: str) -> str:
    """The logical key of a shard key (shard_key's inverse)."""
    namespace, fingerprint, _heads, rest = key.split("/", 3)
    return f"{namespace}/{fingerprint}/{rest}"
