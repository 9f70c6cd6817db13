"""Command-line flags generated from frozen dataclass fields: each setting written once.

A field becomes a flag by naming it in its metadata; its type, default and choices come from
the field itself:

    @dataclass(frozen=True)
    class AppConfig:
        max_pending_requests: int = field(default=256, metadata=flag(
            "--max-pending-requests", "requests held at once; past it 503 + Retry-After"))

    add_flags(parser, WorkerConfig)      # one argparse flag per such field, nested included
    cfg = from_args(WorkerConfig, args)  # the dataclass back from the parsed flags

The annotation gives the flag's shape: int / float / str -> one value of that type;
`X | None` -> X, default None; bool -> a switch (negate=True: the switch turns a True default
off, e.g. --no-prefix-cache); tuple[X, ...] -> a list (`nargs`, or "append": once per value);
Literal[...] -> choices. A nested dataclass field (also `X | None` and tuple[X, ...] of one)
is walked: its flags form an argument group of --help, titled by the field. Every flag's help
ends with its default and its environment mirror (pdrouter.common.cli_args).

from_args fills a field from its flag, a nested dataclass field by walking it, and leaves the
other fields at their defaults; fields the command line sets only indirectly (derived from
several flags) are given by the caller as keywords.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from pdrouter.common.cli_args import add_flag

T = TypeVar("T")
_KEY = "flag"
_UNSET: Any = object()
# What a value looks like in --help's synopsis, by (type, whether the flag ends in -s).
_METAVARS = {
    (int, False): "N",
    (int, True): "SECONDS",
    (float, True): "SECONDS",
    (float, False): "X",
}


@dataclass(frozen=True)
class FlagSpec:
    """How a field appears on the command line (built by flag())."""

    name: str  # "--max-pending-requests"
    help: str
    aliases: tuple[str, ...] = ()  # other spellings of the flag ("-tp")
    choices: Sequence[str] | None = None  # else from a Literal annotation
    metavar: str | None = None
    negate: bool = False  # bool field: the switch sets False
    # A tuple field's list shape; "append" (once per value) also for a field that holds one
    # value of several instances (a registration per --router).
    nargs: Literal["*", "+", "append"] = "*"
    parse: Callable[[str], Any] | None = None  # one token -> the field's value
    cli_default: Any = _UNSET  # the command line's default where it differs from the field's
    required: bool = False


def flag(name: str, help: str, **options: Any) -> Mapping[str, FlagSpec]:
    """Field metadata that makes the field the flag `name` (options: FlagSpec's fields)."""
    return types.MappingProxyType({_KEY: FlagSpec(name, help, **options)})


def _dest(spec: FlagSpec) -> str:
    return spec.name.lstrip("-").replace("-", "_")


def _unwrap(hint: Any) -> tuple[Any, bool]:
    """(the type inside `X | None` and `tuple[X, ...]`, whether it is such a tuple)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if typing.get_origin(hint) is tuple:
        return typing.get_args(hint)[0], True
    return hint, False


def _field_default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _reported(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """parse, its ValueError's message shown by argparse as is ("argument --size: not a size:
    'lots'"), not as "invalid parse_size_bytes value"."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


def _flag_kwargs(f: dataclasses.Field[Any], spec: FlagSpec, hint: Any) -> dict[str, Any]:
    """add_argument's keywords for field f."""
    inner, is_tuple = _unwrap(hint)
    kwargs: dict[str, Any] = {"dest": _dest(spec), "help": spec.help}
    if inner is bool:
        return {**kwargs, "action": "store_true"}
    choices = spec.choices
    if typing.get_origin(inner) is Literal:
        choices, inner = choices or typing.get_args(inner), str
    if choices is not None:
        kwargs["choices"] = list(choices)  # argparse shows them as the metavar
    metavar = spec.metavar or _METAVARS.get((inner, spec.name.endswith("-s")))
    if metavar and not (choices and not spec.metavar):
        kwargs["metavar"] = metavar
    if spec.required:
        return {**kwargs, "required": True, "type": spec.parse or inner}
    default = _field_default(f) if spec.cli_default is _UNSET else spec.cli_default
    if spec.parse is not None:
        return {**kwargs, "type": _reported(spec.parse), "default": default}
    if spec.nargs == "append":  # a tuple, or one value per instance of the field
        return {**kwargs, "action": "append", "type": inner, "default": None}
    if is_tuple:
        return {**kwargs, "nargs": spec.nargs, "type": inner, "default": list(default or ())}
    return {**kwargs, "type": inner, "default": default}


def _nested(hint: Any) -> type | None:
    inner, _ = _unwrap(hint)
    return inner if dataclasses.is_dataclass(inner) else None


def add_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """One flag per flag()-marked field of cls and of the dataclasses it nests (each nested
    one an argument group). A flag named twice (one setting shared by two dataclasses, e.g.
    --admin-key) is added once."""
    _add_flags(parser, cls, None, "", set())


def _add_flags(
    parser: argparse.ArgumentParser, cls: type, group: Any, title: str, added: set[str]
) -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        spec: FlagSpec | None = f.metadata.get(_KEY)
        nested = _nested(hints[f.name])
        if spec is not None and spec.name not in added:
            added.add(spec.name)
            kwargs = _flag_kwargs(f, spec, hints[f.name])
            add_flag(parser, spec.name, group, aliases=spec.aliases, **kwargs)
        elif spec is None and nested is not None:
            name = f"{title} {f.name}".strip().replace("_", " ")
            doc = (nested.__doc__ or "").strip().split("\n\n")[0]
            described = doc if doc and not doc.startswith(nested.__name__ + "(") else None
            sub = parser.add_argument_group(name, " ".join((described or "").split()) or None)
            _add_flags(parser, nested, sub, name, added)


def value_of(cls: type, name: str, args: argparse.Namespace) -> Any:
    """The value the flag of cls's field `name` gives, as the field's type wants it."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    spec: FlagSpec = f.metadata[_KEY]
    value = getattr(args, _dest(spec))
    if spec.negate:
        return not value
    return tuple(value) if isinstance(value, list) else value


def from_args(cls: type[T], args: argparse.Namespace, **given: Any) -> T:
    """cls built from the parsed flags; given fields override (or supply) values."""
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in given:
            kwargs[f.name] = given[f.name]
        elif _KEY in f.metadata:
            kwargs[f.name] = value_of(cls, f.name, args)
        elif dataclasses.is_dataclass(hints[f.name]):
            kwargs[f.name] = from_args(hints[f.name], args)
    return cls(**kwargs)
