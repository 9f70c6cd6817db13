"""CallScanner: the calls of a forced tool answer, read as the text arrives.

A `required` answer is `[{"name":"f","parameters":{...}},...]`, the grammar's compact JSON
with its keys in that order; a `named` answer is the arguments alone. The scanner reads such
text piece by piece and says, as soon as the text shows it, that a call begins (its index and
name) and which characters of its arguments arrived, so a stream can send OpenAI's deltas as
the model writes them:

    feed('[{"name":"get_w')                 -> []
    feed('eather","parameters":{"ci')       -> [CallStart(0, "get_weather"), Arguments(0, '{"ci')]
    feed('ty":"Oslo"}},{"name":"f",')       -> [Arguments(0, 'ty":"Oslo"}'), CallStart(1, "f")]

The arguments are the answer's own text of the `parameters` value (not a re-serialization),
so the deltas of a stream add up to exactly the arguments a whole answer carries
(`required_arguments`).

Only the structure is tracked here (nesting depth, strings and their escapes, the key each
value belongs to); whether the whole is valid JSON is the parser's business at the finish.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass(frozen=True)
class CallStart:
    index: int
    name: str


@dataclass(frozen=True)
class Arguments:
    index: int
    text: str


ScanEvent = CallStart | Arguments

# Depths in a required answer: 1 inside the list, 2 inside a call's object.
_CALL_DEPTH = 2


@dataclass
class CallScanner:
    """Incremental reader of one forced answer (mode "required" or "named")."""

    mode: str
    function_name: str | None = None  # named: the forced function
    num_calls: int = 0  # call objects opened
    num_started: int = 0  # calls whose CallStart was given (their name read)
    _depth: int = 0
    _in_string: bool = False
    _escape: bool = False
    _string: list[str] = field(default_factory=list)  # a key or a name being read
    _reading: str | None = None  # what the open string is: "key" | "name" | None
    _key: str | None = None  # the key whose value comes next, after its ":"
    _value_of: str | None = None  # the key whose value is being read
    _args_depth: int | None = None  # depth where the arguments' value began

    def feed(self, text: str) -> list[ScanEvent]:
        """What text, following everything fed before, shows of the calls."""
        if self.mode == "named":
            return self._named(text)
        events: list[ScanEvent] = []
        args: list[str] = []
        for char in text:
            if self._args_depth is not None and not self._ends_arguments(char):
                args.append(char)
                self._track(char)
                continue
            if args:
                events.append(Arguments(self.num_calls - 1, "".join(args)))
                args = []
            self._structure(char, events)
        if args:
            events.append(Arguments(self.num_calls - 1, "".join(args)))
        return events

    def _named(self, text: str) -> list[ScanEvent]:
        events: list[ScanEvent] = []
        if self.num_calls == 0 and text:
            self.num_calls = self.num_started = 1
            events.append(CallStart(0, self.function_name or ""))
        if text:
            events.append(Arguments(0, text))
        return events

    def _ends_arguments(self, char: str) -> bool:
        """Whether char, outside the arguments' strings, closes their value (the call
        object's next "," or its "}")."""
        if self._in_string or self._depth != self._args_depth or char not in ",}":
            return False
        self._args_depth = None
        return True

    def _track(self, char: str) -> None:
        """Depth and strings inside the arguments' value."""
        if self._in_string:
            if self._escape:
                self._escape = False
            elif char == "\\":
                self._escape = True
            elif char == '"':
                self._in_string = False
        elif char == '"':
            self._in_string = True
        elif char in "{[":
            self._depth += 1
        elif char in "}]":
            self._depth -= 1

    def _structure(self, char: str, events: list[ScanEvent]) -> None:
        """One character of the list and call objects around the arguments."""
        if self._in_string:
            self._string_char(char, events)
            return
        if char == '"' and self._depth == _CALL_DEPTH:
            self._in_string, self._string = True, []
            value_of, self._value_of = self._value_of, None
            self._reading = "key" if value_of is None else "name" if value_of == "name" else None
        elif char in "{[":
            self._depth += 1
            if char == "{" and self._depth == _CALL_DEPTH:
                self.num_calls += 1
                self._key = self._value_of = None
        elif char in "}]":
            self._depth -= 1
        elif char == ":" and self._depth == _CALL_DEPTH:
            self._value_of, self._key = self._key, None
            if self._value_of == "parameters":
                self._args_depth, self._value_of = _CALL_DEPTH, None

    def _string_char(self, char: str, events: list[ScanEvent]) -> None:
        if self._escape:
            self._escape = False
        elif char == "\\":
            self._escape = True
        elif char == '"':
            self._in_string = False
            text = _decoded("".join(self._string))
            if self._reading == "name" and self.num_calls:
                self.num_started += 1
                events.append(CallStart(self.num_calls - 1, text))
            elif self._reading == "key":
                self._key = text
            self._reading = None
            return
        self._string.append(char)


def _decoded(raw: str) -> str:
    """A JSON string's value from its raw text between the quotes."""
    try:
        return json.loads(f'"{raw}"')
    except json.JSONDecodeError:
        return raw


def required_arguments(text: str) -> list[tuple[str, str]]:
    """(name, arguments text) of each call of a whole `required` answer, as a stream of it
    reads them (the arguments exactly as written)."""
    scanner = CallScanner("required")
    calls: list[list[str]] = []
    for event in scanner.feed(text):
        if isinstance(event, CallStart):
            calls.append([event.name, ""])
        else:
            calls[event.index][1] += event.text
    return [(name, arguments) for name, arguments in calls]
