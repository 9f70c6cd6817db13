"""The header every KV object in the pool starts with, so that a read proves what it got.

A pool object is HEADER_BYTES of header, then the payload (one block of every layer, the
staging slot's bytes; a partial tail block is stored whole, its token count says how much
of it is meaningful). 64 bytes, little-endian, fixed offsets:

    offset  size  field
         0     4  magic          b"PDKV"
         4     2  version        FORMAT_VERSION (1)
         6     2  checksum_kind  CHECKSUM_XXH3 (host staging) or CHECKSUM_WORDSUM (GPU)
         8     8  fingerprint    blake2b-64 of the model fingerprint
        16    16  key_digest     blake2b-128 of the object's own key
        32     4  num_tokens     tokens the block holds (block size; n for a partial key)
        36     4  reserved       0
        40     8  payload_bytes  bytes after the header
        48     8  checksum       of the payload, by checksum_kind
        56     8  reserved       0

A read checks, in this order, and names the first field that is wrong (the reason counted
in pdworker_pool_integrity_failures_total): version (magic and version: not our object, or
bytes overwritten from the start), fingerprint (another model's object under a forged or
colliding key), length (the object is not HEADER_BYTES + payload_bytes long, or the header
says another payload length), tokens (a partial block stored under a full block's key, or
the reverse), key (a block of this model, stored under another key), checksum (the payload
is not the bytes that were put). Any of them makes the block a miss, never KV.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Literal

from workers.pool.keys import is_partial_key, partial_num_tokens

HEADER_BYTES = 64
MAGIC = b"PDKV"
FORMAT_VERSION = 1
CHECKSUM_XXH3 = 1  # xxh3-64 of the payload (workers/pool/payload_checksum.py)
CHECKSUM_WORDSUM = 2  # the GPU checksum (workers/pool/payload_checksum.py, wordsum_reference)
_LAYOUT = struct.Struct("<4sHH8s16sII QQQ")
assert _LAYOUT.size == HEADER_BYTES

FailureReason = Literal["version", "fingerprint", "length", "tokens", "key", "checksum"]
FAILURE_REASONS: tuple[FailureReason, ...] = (
    "version",
    "fingerprint",
    "length",
    "tokens",
    "key",
    "checksum",
)


def key_digest(key: str) -> bytes:
    """16 bytes naming a key (a header holds this, not the key: keys vary in length)."""
    return hashlib.blake2b(key.encode(), digest_size=16).digest()


def fingerprint_digest(fingerprint: str) -> bytes:
    """8 bytes naming a model fingerprint (any string: tests use short ones)."""
    return hashlib.blake2b(fingerprint.encode(), digest_size=8).digest()


@dataclass(frozen=True)
class ObjectHeader:
    """The fields of one header (encode/decode move it to and from its 64 bytes)."""

    fingerprint_digest: bytes  # fingerprint_digest(workers.pool.keys.model_fingerprint(...))
    key_digest: bytes  # key_digest(the object's key)
    num_tokens: int
    payload_bytes: int
    checksum: int
    checksum_kind: int = CHECKSUM_XXH3
    version: int = FORMAT_VERSION

    def encode(self) -> bytes:
        return _LAYOUT.pack(
            MAGIC,
            self.version,
            self.checksum_kind,
            self.fingerprint_digest,
            self.key_digest,
            self.num_tokens,
            0,
            self.payload_bytes,
            self.checksum,
            0,
        )


def decode(raw: bytes | memoryview) -> ObjectHeader | None:
    """The header in raw's first HEADER_BYTES, or None when they are not one of ours (bad
    magic, too short)."""
    if len(raw) < HEADER_BYTES:
        return None
    magic, version, kind, fp, digest, tokens, _, payload, checksum, _ = _LAYOUT.unpack_from(raw)
    if magic != MAGIC:
        return None
    return ObjectHeader(fp, digest, tokens, payload, checksum, kind, version)


@dataclass(frozen=True)
class ExpectedObject:
    """What the object under a key must say about itself, derived from the key alone."""

    key: str
    fingerprint: str
    num_tokens: int
    payload_bytes: int

    @classmethod
    def for_key(cls, key: str, block_size: int, payload_bytes: int) -> ExpectedObject:
        """From a key of workers.pool.keys.block_keys: its fingerprint is the key's second
        field ({namespace}/{fingerprint}/r{rank}/{hash}), its token count the block size or
        the partial key's n."""
        parts = key.split("/")
        if len(parts) < 4:
            raise ValueError(f"{key!r} is not a KV block key (namespace/fingerprint/rank/hash)")
        tokens = partial_num_tokens(key) if is_partial_key(key) else block_size
        return cls(key, parts[1], tokens, payload_bytes)

    def header(self, checksum: int, checksum_kind: int) -> ObjectHeader:
        """The header a writer puts before a payload of this checksum."""
        return ObjectHeader(
            fingerprint_digest(self.fingerprint),
            key_digest(self.key),
            self.num_tokens,
            self.payload_bytes,
            checksum,
            checksum_kind,
        )


def check_fields(header: ObjectHeader | None, expected: ExpectedObject) -> FailureReason | None:
    """The first header field (before the checksum) that does not match what the key says,
    or None when only the checksum is left to check."""
    if header is None or header.version != FORMAT_VERSION:
        return "version"
    if header.checksum_kind not in (CHECKSUM_XXH3, CHECKSUM_WORDSUM):
        return "version"
    if header.fingerprint_digest != fingerprint_digest(expected.fingerprint):
        return "fingerprint"
    if header.payload_bytes != expected.payload_bytes:
        return "length"
    if header.num_tokens != expected.num_tokens:
        return "tokens"
    if header.key_digest != key_digest(expected.key):
        return "key"
    return None
