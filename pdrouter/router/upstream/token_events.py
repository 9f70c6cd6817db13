"""D's token events read without a model: a run of them matched whole, one C call per read.

    data: {"token_ids":[1001],"text":" w1","num_output_tokens":2}\\n\\n     one token's event,
    data: {"token_ids":[1002],"text":" w2","num_output_tokens":3}\\n\\n     as D writes it
    ... ──► [TokenEvent, TokenEvent, ...]                                (decode_event_sse)

Every token of every stream passes through the router, and building and validating a
DecodeEvent per token was the largest part of its relay (pydantic's validation of a read's
events alone was a fifth of a request's time). A token's event as our workers write it (the
defaults left out: ids, text, count, in that order) is all the relay needs and has one form,
so a run of them is checked by one regular expression and split by another; anything else
(the final event, logprobs, an error, another worker's form) is parsed and validated as
before (decode_stream.parse_events).

The text matched holds no escape, quote or control character, so its JSON string is its
UTF-8 bytes in quotes: byte for byte what the router's own encoder writes
(pdrouter.wire.responses.encode_json_string), ready to splice into the client's chunk.
"""

from __future__ import annotations

import re
from operator import itemgetter

_UINT = rb"(?:0|[1-9][0-9]*)"
_EVENT = (
    rb'data: \{"token_ids":\[(' + _UINT + rb"(?:," + _UINT + rb')*)\],"text":("[^"\\\x00-\x1f]*"),'
    rb'"num_output_tokens":(' + _UINT + rb")\}\n\n"
)
_ONE = re.compile(_EVENT)  # its groups: the ids, the text's JSON string, the count
_RUN = re.compile(b"(?:" + _EVENT.replace(b"(", b"(?:").replace(b"(?:?:", b"(?:") + b")+")


class TokenEvent(tuple):
    """One token's event: a DecodeEvent's fields without a model (every field but the three
    at DecodeEvent's default), and text_json, the text as D's JSON string."""

    __slots__ = ()

    token_ids: list[int] = property(itemgetter(0))  # type: ignore[assignment]
    num_output_tokens: int = property(itemgetter(1))  # type: ignore[assignment]
    text_json: bytes = property(itemgetter(2))  # type: ignore[assignment]

    finished = False
    ends_stream = False
    index = 0  # a sequence group's events name their sequence: they are validated instead
    more = False
    finish_reason = None
    logprobs = None
    num_blocks_loaded = None
    num_tokens_recomputed = None
    num_bytes_read = None
    num_blocks_loaded_ahead = None
    timings = None
    num_cached_tokens = None
    num_pool_cached_tokens = None
    num_host_cached_tokens = None

    @property
    def text(self) -> str:
        return self[2][1:-1].decode()


_new = tuple.__new__


def token_run(events: bytes) -> int:
    """How many bytes at the start of events (whole SSE events) are token events in our
    workers' form, valid UTF-8 (0: none)."""
    m = _RUN.match(events)
    if m is None:
        return 0
    end = m.end()
    if not events.isascii():
        try:
            events[:end].decode()
        except UnicodeDecodeError:  # not UTF-8: validation names it
            return 0
    return end


def token_events(run: bytes) -> list[TokenEvent]:
    """The events of a run that token_run measured."""
    return [
        _new(TokenEvent, (list(map(int, ids.split(b","))), int(count), text_json))
        for ids, text_json, count in _ONE.findall(run)
    ]
