"""What an OpenAI request body may hold beyond its schema: finite JSON numbers and bounded
sets of stop strings and stop token ids (pdrouter.wire.openai.parse_request applies them, on
router and workers alike: the router refuses before P starts).

    NaN, Infinity, -Infinity    400 anywhere in the body, an ignored field included
    stop                        400 for an empty string, past MAX_STOP_STRINGS strings,
                                a string past MAX_STOP_STRING_CHARS characters, or all
                                of them past MAX_STOP_TOTAL_CHARS
    stop_token_ids              400 for a negative id or past MAX_STOP_TOKEN_IDS ids

The constants are Python's json extensions, which the JSON grammar lacks; the parser of the
request models accepts them and skips unknown fields unread, so one in an unknown field went
through, and reached the router's re-encoding of the body (to add a seed), which answered 500.

OpenAI allows 4 stop sequences; 16 leaves room for clients written for other servers, while
bounding the work they cost: every generated token is checked against every stop string, and
15,000 of them cost one request 8-13x the decode CPU and slowed every other request 12x.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import NoReturn

from pdrouter.wire.protocol_error import ProtocolError

MAX_STOP_STRINGS = 16
# vLLM's engine keeps per-request token-id sets (logit_bias, allowed ids, stop ids) to 1024;
# every id is masked at each step until min_tokens and checked at each token, and 62,000 of
# them at n=16 cost a decode worker 11.8 s of CPU (1.9 s without).
MAX_STOP_TOKEN_IDS = 1024
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOTAL_CHARS = 1024
# The bytes that spell a non-standard JSON constant (NaN, Infinity, -Infinity).
_NON_FINITE_MARKS = (b"NaN", b"Infinity")


def check_stop_strings(strings: Sequence[str]) -> None:
    """ValueError (the field validator's way to say 400 naming `stop`) for an empty string
    or past the bounds."""
    if any(s == "" for s in strings):
        raise ValueError("stop strings must be non-empty")
    if len(strings) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings (got {len(strings)})")
    longest = max(map(len, strings), default=0)
    if longest > MAX_STOP_STRING_CHARS:
        raise ValueError(
            f"a stop string has at most {MAX_STOP_STRING_CHARS} characters (got {longest})"
        )
    total = sum(map(len, strings))
    if total > MAX_STOP_TOTAL_CHARS:
        raise ValueError(
            f"stop strings have at most {MAX_STOP_TOTAL_CHARS} characters in all (got {total})"
        )


def check_stop_token_ids(ids: Sequence[int]) -> None:
    """ValueError (400 naming `stop_token_ids`) for a negative id or past the bound."""
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids (got {len(ids)})")
    if ids and min(ids) < 0:
        raise ValueError("stop_token_ids must be non-negative token ids")


def _non_finite(constant: str) -> NoReturn:
    raise ProtocolError(
        f"request body is not valid JSON: {constant} is not a JSON value (numbers are finite)"
    )


def refuse_non_finite(body: bytes) -> None:
    """ProtocolError when body holds a NaN, Infinity or -Infinity token anywhere. Only a body
    that holds such bytes at all (in a string, say) is parsed a second time, by the standard
    library's parser."""
    nan, infinity = _NON_FINITE_MARKS  # two plain searches: no generator per request
    if nan not in body and infinity not in body:
        return
    try:
        json.loads(body, parse_constant=_non_finite)
    except ProtocolError:
        raise
    except (ValueError, RecursionError):
        return  # malformed or too deep otherwise: the models' parse names the error
