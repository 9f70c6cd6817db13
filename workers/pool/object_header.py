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

import functools
import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

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


@functools.lru_cache(maxsize=64)
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
        """From a key of workers.pool.keys (a block's logical key or a shard key): its
        fingerprint is the key's second field, its token count the block size or the
        partial key's n."""
        return cls(key, *_key_fields(key, block_size), payload_bytes)

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


def _key_fields(key: str, block_size: int) -> tuple[str, int]:
    """(fingerprint, tokens) a block key names."""
    parts = key.split("/", 3)
    if len(parts) < 3:
        raise ValueError(f"{key!r} is not a KV block key (namespace/fingerprint[/heads]/hash)")
    return parts[1], partial_num_tokens(key) if is_partial_key(key) else block_size


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


# The batch form the handoff uses: one [n, HEADER_BYTES] uint8 array per call, compared with
# the expected headers in one numpy operation (per key only the key's digest is hashed).
_KIND, _CHECKSUM = slice(6, 8), slice(48, 56)  # what the payload decides; the rest the key
_FROM_KEY = np.ones(HEADER_BYTES, dtype=bool)
_FROM_KEY[_KIND] = _FROM_KEY[_CHECKSUM] = False


def expected_headers(keys: Sequence[str], block_size: int, payload_bytes: int) -> np.ndarray:
    """[n, HEADER_BYTES] uint8: the header each key's object must carry, with its
    checksum and checksum kind left 0 (seal() fills them in)."""
    pack, digest = _LAYOUT.pack, fingerprint_digest
    rows = []
    for key in keys:  # the per-key work of a handoff: keep it to a split, a hash, a pack
        fp, tokens = _key_fields(key, block_size)
        row = (MAGIC, FORMAT_VERSION, 0, digest(fp), key_digest(key), tokens, 0, payload_bytes)
        rows.append(pack(*row, 0, 0))
    packed = b"".join(rows)
    return np.frombuffer(packed, dtype=np.uint8).reshape(len(keys), HEADER_BYTES).copy()


def seal(expected: np.ndarray, checksums: Sequence[int], kind: int) -> np.ndarray:
    """The expected headers [n, HEADER_BYTES] with each payload's checksum and its kind."""
    expected[:, _KIND] = np.frombuffer(struct.pack("<H", kind), dtype=np.uint8)
    expected[:, _CHECKSUM] = np.asarray(checksums, dtype="<u8").reshape(-1, 1).view(np.uint8)
    return expected


def rows_off_key(raw: np.ndarray, expected: np.ndarray) -> list[int]:
    """Rows of raw [n, HEADER_BYTES] whose fields other than the checksum differ from what
    the key expects (check_fields names the reason of each)."""
    same = (raw[:, _FROM_KEY] == expected[:, _FROM_KEY]).all(axis=1)
    return np.flatnonzero(~same).tolist()


def checksum_fields(raw: np.ndarray) -> tuple[list[int], list[int]]:
    """(checksum kinds, checksums) of the headers raw [n, HEADER_BYTES]."""
    kinds = raw[:, _KIND].copy().view("<u2").ravel().tolist()
    sums = raw[:, _CHECKSUM].copy().view("<u8").ravel().tolist()
    return kinds, sums
