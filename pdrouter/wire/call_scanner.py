"""CallScanner: the calls of a tool answer, read as the text arrives.

A `required` answer is `[{"name":"f","parameters":{...}},...]`, the grammar's compact JSON
with its keys in that order; a `named` answer is the arguments alone; a `hermes` text is an
auto answer from its first `<tool_call>` tag on, each tag holding `{"name": ..., "arguments":
...}` as the model wrote it (any key order, any blanks between tokens). The scanner reads such
text piece by piece and says, as soon as the text shows it, that a call begins (its index and
name) and which characters of its arguments arrived, so a stream can send OpenAI's deltas as
the model writes them:

    feed('[{"name":"get_w')                 -> []
    feed('eather","parameters":{"ci')       -> [CallStart(0, "get_weather"), Arguments(0, '{"ci')]
    feed('ty":"Oslo"}},{"name":"f",')       -> [Arguments(0, 'ty":"Oslo"}'), CallStart(1, "f")]

The arguments are the answer's own text of the `parameters` (`arguments`) value, blanks
around it dropped (not a re-serialization); a `hermes` call whose arguments are a JSON string
gets the string's value, in one piece when it closes. Scanning is the same whatever the pieces,
so the deltas of a stream add up to exactly the arguments a whole answer carries
(`written_arguments`).

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

# The depth inside a call's object (required: inside the list first), and the keys whose
# value is the arguments, by mode.
_CALL_DEPTH = {"required": 2, "hermes": 1}
_ARGUMENT_KEYS = {"required": ("parameters",), "hermes": ("arguments", "parameters")}


@dataclass
class CallScanner:
    """Incremental reader of one forced answer (mode "required" or "named")."""

    mode: str
    function_name: str | None = None  # named: the forced function
    num_calls: int = 0  # call objects opened
    num_started: int = 0  # calls whose CallStart was given (their name read)
    argued: set[int] = field(default_factory=set)  # calls given any Arguments
    # The index of the call being read (calls count in the order their names are read, so
    # a malformed object without a name leaves no gap); None until its name is read.
    _current: int | None = None
    _depth: int = 0
    _in_string: bool = False
    _escape: bool = False
    _string: list[str] = field(default_factory=list)  # a key or a name being read
    _reading: str | None = None  # what the open string is: "key" | "name" | None
    _key: str | None = None  # the key whose value comes next, after its ":"
    _value_of: str | None = None  # the key whose value is being read
    _args_depth: int | None = None  # depth where the arguments' value began
    _args_started: bool = False  # its first character (not a blank) read
    _args_string: list[str] | None = None  # hermes: a string value, kept until it closes
    _blanks: list[str] = field(default_factory=list)  # blanks sent only if more follows
    _early: list[str] = field(default_factory=list)  # arguments read before the call's name

    def feed(self, text: str) -> list[ScanEvent]:
        """What text, following everything fed before, shows of the calls."""
        if self.mode == "named":
            return self._named(text)
        events: list[ScanEvent] = []
        args: list[str] = []
        for char in text:
            if self._args_depth is not None:
                if not self._ends_arguments(char):
                    self._args_char(char, args)
                    self._track(char)
                    continue
                if self._args_string is not None:
                    args.append(_decoded("".join(self._args_string[1:-1])))
                self._args_string, self._args_started, self._blanks = None, False, []
            self._arguments(args, events)
            args = []
            self._structure(char, events)
        self._arguments(args, events)
        return events

    def _args_char(self, char: str, args: list[str]) -> None:
        """One character of the arguments' value: sent, or kept (a blank, a string value)."""
        if not self._args_started:
            if char.isspace():
                return
            self._args_started = True
            if char == '"' and self.mode == "hermes":
                self._args_string = []
        if self._args_string is not None:
            self._args_string.append(char)
        elif char.isspace() and not self._in_string:
            self._blanks.append(char)
        else:
            args.extend(self._blanks)
            self._blanks.clear()
            args.append(char)

    def _arguments(self, args: list[str], events: list[ScanEvent]) -> None:
        """args as the current call's Arguments event; kept while its name is unread."""
        if not args:
            return
        if self._current is None:
            self._early.extend(args)
        else:
            self.argued.add(self._current)
            events.append(Arguments(self._current, "".join(args)))

    def _named(self, text: str) -> list[ScanEvent]:
        events: list[ScanEvent] = []
        if self.num_calls == 0 and text:
            self.num_calls = self.num_started = 1
            events.append(CallStart(0, self.function_name or ""))
        if text:
            self.argued.add(0)
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
        call_depth = _CALL_DEPTH[self.mode]
        if char == '"' and self._depth == call_depth:
            self._in_string, self._string = True, []
            value_of, self._value_of = self._value_of, None
            self._reading = "key" if value_of is None else "name" if value_of == "name" else None
        elif char in "{[":
            self._depth += 1
            if char == "{" and self._depth == call_depth:
                self.num_calls += 1
                self._key = self._value_of = self._current = None
                self._early.clear()
        elif char in "}]":
            self._depth -= 1
        elif char == ":" and self._depth == call_depth:
            self._value_of, self._key = self._key, None
            if self._value_of in _ARGUMENT_KEYS[self.mode]:
                self._args_depth, self._value_of = call_depth, None

    def _string_char(self, char: str, events: list[ScanEvent]) -> None:
        if self._escape:
            self._escape = False
        elif char == "\\":
            self._escape = True
        elif char == '"':
            self._in_string = False
            text = _decoded("".join(self._string))
            if self._reading == "name" and self.num_calls and self._current is None:
                self._current = self.num_started
                self.num_started += 1
                events.append(CallStart(self._current, text))
                if self._early:  # the arguments came first
                    self.argued.add(self._current)
                    events.append(Arguments(self._current, "".join(self._early)))
                    self._early.clear()
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


# The arguments of a call that gives none (a stream sends them at its finish).
NO_ARGUMENTS = "{}"


def written_arguments(text: str, mode: str) -> list[tuple[str, str]]:
    """(name, arguments text) of each call of a whole answer (mode required or hermes), as a
    stream of it reads them (the arguments as written; NO_ARGUMENTS when it gives none)."""
    scanner = CallScanner(mode)
    calls: list[list[str]] = []
    for event in scanner.feed(text):
        if isinstance(event, CallStart):
            calls.append([event.name, ""])
        else:
            calls[event.index][1] += event.text
    return [(name, arguments or NO_ARGUMENTS) for name, arguments in calls]
