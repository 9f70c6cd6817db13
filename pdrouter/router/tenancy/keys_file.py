"""API keys from a file (--api-keys-file), each with an id and its limits; reloaded on change.

    {"keys": [
      {"id": "team-a", "key": "sk-...", "requests_per_minute": 600, "tokens_per_minute": 200000,
       "max_concurrent": 16, "priority": 0, "max_priority": -5},
      {"id": "batch",  "key": "sk-...", "priority": 10}
    ]}

Every limit is optional (absent: none). `priority` is the key's default request priority
(vLLM's convention: lower is served first) for requests that name none; `max_priority` the
most urgent (lowest) priority its requests may claim, by the body's `priority` or the
X-Priority header (absent: its `priority`, so a key claims nothing more urgent than its
default; a claim past it is clamped to it, tenancy.gate). The id is what the
metrics and logs show; the key itself never leaves this module. A key is looked up by its
SHA-256 digest in a dict, so the lookup's time says nothing about any key's bytes.

A file that cannot be read or parsed is refused at start (the router does not start); on a
reload the keys already loaded stay in force and the error is logged.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field

from pdrouter.common.auth import bearer_token

log = logging.getLogger(__name__)

_LIMIT_FIELDS = ("requests_per_minute", "tokens_per_minute", "max_concurrent")


@dataclass(frozen=True)
class ApiKey:
    """One client key: its id (shown), its secret (never shown), its limits."""

    key_id: str
    secret: str = field(repr=False)
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None
    priority: int = 0  # the default of its requests that name none
    # The most urgent (lowest) priority its requests may claim: never below it.
    max_priority: int = 0


def parse_keys(text: str, source: str) -> dict[bytes, ApiKey]:
    """The keys of a keys file's text, by the SHA-256 digest of the secret; ValueError naming
    source and the entry for anything wrong."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{source}: not valid JSON: {exc}") from None
    entries = doc.get("keys") if isinstance(doc, dict) else None
    if not isinstance(entries, list):
        raise ValueError(f'{source}: expected {{"keys": [...]}}')
    digest_to_key: dict[bytes, ApiKey] = {}
    ids: set[str] = set()
    for i, entry in enumerate(entries):
        key = _parse_entry(entry, f"{source}: keys[{i}]")
        digest = digest_of(key.secret)
        if key.key_id in ids or digest in digest_to_key:
            raise ValueError(f"{source}: keys[{i}] repeats an id or a key")
        ids.add(key.key_id)
        digest_to_key[digest] = key
    return digest_to_key


def _parse_entry(entry: object, where: str) -> ApiKey:
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: expected an object")
    key_id, secret = entry.get("id"), entry.get("key")
    if not isinstance(key_id, str) or not key_id or not isinstance(secret, str) or not secret:
        raise ValueError(f'{where}: needs a non-empty "id" and "key"')
    unknown = set(entry) - {"id", "key", "priority", "max_priority", *_LIMIT_FIELDS}
    if unknown:
        raise ValueError(f"{where} ({key_id}): unknown fields {sorted(unknown)}")
    limits = {}
    for name in _LIMIT_FIELDS:
        value = entry.get(name)
        if value is not None and (type(value) is not int or value < 1):
            raise ValueError(f"{where} ({key_id}): {name} must be an integer >= 1")
        limits[name] = value
    priority = entry.get("priority", 0)
    if type(priority) is not int:
        raise ValueError(f"{where} ({key_id}): priority must be an integer")
    max_priority = entry.get("max_priority", priority)
    if type(max_priority) is not int or max_priority > priority:
        # Lower is more urgent: a cap less urgent than the default would refuse the default.
        raise ValueError(
            f"{where} ({key_id}): max_priority must be an integer at most priority ({priority})"
        )
    return ApiKey(key_id, secret, priority=priority, max_priority=max_priority, **limits)


def digest_of(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


class KeysFile:
    """The keys of one file, read at start and again by reload() (on change, on SIGHUP)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._stamp = self._stat()
        self.digest_to_key = self._read()
        self.num_reloads = 0

    def match(self, authorization: str | None) -> ApiKey | None:
        """The key an `Authorization: Bearer <key>` header carries, else None."""
        token = bearer_token(authorization)
        if token is None:
            return None
        return self.digest_to_key.get(digest_of(token))

    def changed(self) -> bool:
        return self._stat() != self._stamp

    def reload(self) -> bool:
        """Read the file again; False (and the old keys kept) when it cannot be used."""
        stamp = self._stat()
        try:
            keys = self._read()
        except (OSError, ValueError) as exc:
            log.error("API keys file not reloaded, the previous keys stay in force: %s", exc)
            self._stamp = stamp  # logged once per change, not once per poll
            return False
        self._stamp, self.digest_to_key = stamp, keys
        self.num_reloads += 1
        log.info("API keys file %s reloaded: %d keys", self.path, len(keys))
        return True

    def _read(self) -> dict[bytes, ApiKey]:
        with open(self.path, encoding="utf-8") as f:
            return parse_keys(f.read(), self.path)

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size, st.st_ino
