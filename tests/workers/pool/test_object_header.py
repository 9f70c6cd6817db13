"""The pool object header (workers/pool/object_header.py): its exact bytes, and each field a
read checks, in order, with the reason it names; the checksums beside it
(workers/pool/payload_checksum.py)."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from workers.pool.keys import block_keys
from workers.pool.object_header import (
    CHECKSUM_WORDSUM,
    CHECKSUM_XXH3,
    HEADER_BYTES,
    ExpectedObject,
    ObjectHeader,
    check_fields,
    checksum_fields,
    decode,
    expected_headers,
    fingerprint_digest,
    key_digest,
    rows_off_key,
    seal,
)
from workers.pool.payload_checksum import host_checksums, wordsum_reference, xxh3

FP, OTHER_FP, BLOCK, PAYLOAD = "0123456789abcdef", "fedcba9876543210", 4, 256
KEYS = block_keys(FP, list(range(10)), BLOCK)  # two full blocks, a partial tail of 2 tokens


def test_the_header_bytes_are_the_documented_layout() -> None:
    header = ExpectedObject.for_key(KEYS[0], BLOCK, PAYLOAD).header(0x1122334455667788, 1)
    raw = header.encode()
    assert len(raw) == HEADER_BYTES == 64
    assert raw[:4] == b"PDKV"
    assert struct.unpack_from("<HH", raw, 4) == (1, CHECKSUM_XXH3)
    assert raw[8:16] == fingerprint_digest(FP)
    assert raw[16:32] == key_digest(KEYS[0])
    assert struct.unpack_from("<IIQQQ", raw, 32) == (BLOCK, 0, PAYLOAD, 0x1122334455667788, 0)
    assert decode(raw) == header


def test_expected_fields_come_from_the_key() -> None:
    full, partial = (ExpectedObject.for_key(k, BLOCK, PAYLOAD) for k in (KEYS[0], KEYS[2]))
    assert (full.fingerprint, full.num_tokens, full.payload_bytes) == (FP, BLOCK, PAYLOAD)
    assert (partial.fingerprint, partial.num_tokens) == (FP, 2)
    with pytest.raises(ValueError, match="not a KV block key"):
        ExpectedObject.for_key("no-slashes", BLOCK, PAYLOAD)


def _fields_reason(header: ObjectHeader | None, key: str = KEYS[0]) -> str | None:
    return check_fields(header, ExpectedObject.for_key(key, BLOCK, PAYLOAD))


def test_each_wrong_field_names_its_reason() -> None:
    good = ExpectedObject.for_key(KEYS[0], BLOCK, PAYLOAD).header(7, CHECKSUM_XXH3)
    other_model = block_keys(OTHER_FP, list(range(10)), BLOCK)[0]
    cases = {
        "ok": (good, None),
        "junk bytes": (decode(bytes(range(64))), "version"),
        "too short": (decode(good.encode()[:40]), "version"),
        "newer version": (ObjectHeader(**{**good.__dict__, "version": 2}), "version"),
        "unknown checksum": (ObjectHeader(**{**good.__dict__, "checksum_kind": 9}), "version"),
        "another model": (
            ExpectedObject.for_key(other_model, BLOCK, PAYLOAD).header(7, CHECKSUM_XXH3),
            "fingerprint",
        ),
        "shorter payload": (ObjectHeader(**{**good.__dict__, "payload_bytes": 128}), "length"),
        "partial as full": (
            ExpectedObject.for_key(KEYS[2], BLOCK, PAYLOAD).header(7, CHECKSUM_XXH3),
            "tokens",
        ),
        "another block": (
            ExpectedObject.for_key(KEYS[1], BLOCK, PAYLOAD).header(7, CHECKSUM_XXH3),
            "key",
        ),
    }
    got = {name: _fields_reason(header) for name, (header, _) in cases.items()}
    assert got == {name: reason for name, (_, reason) in cases.items()}
    assert decode(b"\0" * 64) is None and decode(b"PDKV") is None


def test_wordsum_matches_its_formula_and_sees_every_word_change() -> None:
    words = np.array([1, 2, 0xFFFFFFFF, 5], dtype="<u4")
    want = (1 * 1 + 2 * 3 + 0xFFFFFFFF * 5 + 5 * 7) % (1 << 64)
    assert wordsum_reference(words.view(np.uint8)) == want
    rng = np.random.default_rng(0)
    payload = rng.integers(0, 256, PAYLOAD, dtype=np.uint8)
    base = wordsum_reference(payload)
    for at in (0, 17, PAYLOAD - 1):  # one changed byte, anywhere
        changed = payload.copy()
        changed[at] ^= 0x80
        assert wordsum_reference(changed) != base
    swapped = payload.view("<u4").copy()
    swapped[[0, 1]] = swapped[[1, 0]]
    assert wordsum_reference(swapped.view(np.uint8)) != base
    with pytest.raises(ValueError, match="whole 32-bit words"):
        wordsum_reference(payload[:3])


def test_host_checksums_by_kind() -> None:
    view = np.random.default_rng(1).integers(0, 256, (3, PAYLOAD), dtype=np.uint8)
    assert host_checksums(view, [2, 0], CHECKSUM_XXH3) == [xxh3(view[2]), xxh3(view[0])]
    assert host_checksums(view, [1], CHECKSUM_WORDSUM) == [wordsum_reference(view[1])]
    with pytest.raises(ValueError, match="unknown checksum kind"):
        host_checksums(view, [0], 7)


def test_the_batch_form_seals_and_finds_exactly_the_rows_off_their_key() -> None:
    expected = expected_headers(KEYS, BLOCK, PAYLOAD)
    assert expected.shape == (3, HEADER_BYTES)
    for row, key in enumerate(KEYS):
        want = ExpectedObject.for_key(key, BLOCK, PAYLOAD).header(0, 0).encode()
        assert expected[row].tobytes() == want
    sealed = seal(expected.copy(), [5, 6, 2**64 - 1], CHECKSUM_WORDSUM)
    assert [decode(r.tobytes()).checksum for r in sealed] == [5, 6, 2**64 - 1]  # type: ignore[union-attr]
    assert checksum_fields(sealed) == ([CHECKSUM_WORDSUM] * 3, [5, 6, 2**64 - 1])
    assert rows_off_key(sealed, expected) == []  # the checksum is not the key's to say
    swapped = sealed[[0, 2, 1]]  # block 1's header on the tail's object and back
    assert rows_off_key(swapped, expected) == [1, 2]
