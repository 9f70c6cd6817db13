"""The client's body as P and D get it: the seed fixed, the priority the router resolved.

Both are spliced in before the first key when the body's text cannot already spell that key
(one set to null, or one written with \\u escapes); otherwise the body is decoded and encoded
again instead, so that the added key is the only one.
"""

from __future__ import annotations

import json
import random

from pdrouter.router.asgi import json_bytes

# The sampler takes any int seed; stay in 31 bits so every consumer's int type holds it.
_SEED_BITS = 31
# Seeds only need to differ between requests, not to be unpredictable: a per-process PRNG
# (seeded from os.urandom) instead of secrets, whose every call is a getrandom system call.
_seeds = random.Random()


def body_for_workers(raw: bytes, seed: int | None) -> bytes:
    """The client's body (already validated) as P and D get it: as sent, with a seed added
    when it has none (P samples the first token and D the rest: both must draw from one
    seed)."""
    if seed is not None:
        return raw
    return _with_key(raw, b"seed", _seeds.getrandbits(_SEED_BITS))


def with_priority(body: bytes, priority: int) -> bytes:
    """body (without a priority of its own) carrying priority, which the router took from
    the X-Priority header or the API key's default, so that P's and D's schedulers see it."""
    return _with_key(body, b"priority", priority)


def _with_key(raw: bytes, key: bytes, value: int) -> bytes:
    text = raw.lstrip()
    if text[:1] == b"{" and b'"' + key + b'"' not in text and b"\\u" not in text:
        return b'{"%s":%d,%s' % (key, value, text[1:])
    body = json.loads(raw)
    body[key.decode()] = value
    return json_bytes(body)
