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
from typing import Any

from pdrouter.wire.pd import DecodeEvent

_UINT = rb"(?:0|[1-9][0-9]*)"
_EVENT = (
    rb'data: \{"token_ids":\[(' + _UINT + rb"(?:," + _UINT + rb')*)\],"text":("[^"\\\x00-\x1f]*"),'
    rb'"num_output_tokens":(' + _UINT + rb")\}\n\n"
)
_ONE = re.compile(_EVENT)  # its groups: the ids, the text's JSON string, the count
_RUN = re.compile(b"(?:" + _EVENT.replace(b"(", b"(?:").replace(b"(?:?:", b"(?:") + b")+")


class TokenEvent(tuple):
    """One token's event as D wrote it: (its ids' digits, comma-separated; its text as D's
    JSON string; its count's digits), the regular expression's groups. Made by tuple's own
    constructor (token_events: no Python code runs per event) and parsed only where a field
    is asked for: the relay splices text_json and reads the count of a read's last event
    only, and the ids wait in OutputIds until a resume needs them. The other fields are
    DecodeEvent's defaults, set from its model below (index 0: a sequence group's events
    name their sequence, so they never match and are validated instead)."""

    __slots__ = ()

    ids_json: bytes = property(itemgetter(0))  # type: ignore[assignment]
    text_json: bytes = property(itemgetter(1))  # type: ignore[assignment]

    ends_stream = False  # DecodeEvent's property: a token event is never the final one

    @property
    def token_ids(self) -> list[int]:
        return list(map(int, self[0].split(b",")))

    @property
    def num_token_ids(self) -> int:
        return self[0].count(b",") + 1  # the expression matched one id at least

    @property
    def num_output_tokens(self) -> int:
        return int(self[2])

    @property
    def text(self) -> str:
        return self[1][1:-1].decode()


# Every field the expression does not match is at its default (D leaves defaults out); the
# fields it matches stay TokenEvent's own properties, even should one of them get a default.
for _name, _field in DecodeEvent.model_fields.items():
    if not _field.is_required() and _name not in TokenEvent.__dict__:
        setattr(TokenEvent, _name, _field.get_default(call_default_factory=True))


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
    return list(map(TokenEvent, _ONE.findall(run)))


class OutputIds:
    """The output token ids of a request so far (P's first token, then D's), for a resume's
    DecodeRequest.output_token_ids: token events' ids kept as D's digits, parsed only when
    asked for (ids()), which most streams never are after their first attempt."""

    __slots__ = ("_digits", "_ids")

    def __init__(self, ids: list[int]) -> None:
        self._ids = ids
        self._digits: list[bytes] = []  # after _ids, in order

    def add(self, ev: Any) -> None:
        """D's next event (a TokenEvent or a DecodeEvent)."""
        if type(ev) is TokenEvent:
            self._digits.append(ev[0])
        elif ev.token_ids:
            self._parse()
            self._ids += ev.token_ids

    def ids(self) -> list[int]:
        self._parse()
        return self._ids

    def _parse(self) -> None:
        if self._digits:
            self._ids += map(int, b",".join(self._digits).split(b","))
            self._digits.clear()
