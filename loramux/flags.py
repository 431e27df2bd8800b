"""Command-line flags generated from config dataclasses: each option is declared once, as a field.

    @dataclass
    class EngineConfig:
        max_loras: int = flag(1, metavar="N")
        \"\"\"Adapters resident on the GPU, and usable in one step.\"\"\"

    add_flags(parser, EngineConfig)              # --max-loras N, its help the field's doc
    EngineConfig(**flag_values(EngineConfig, args))

A field takes part when its metadata carries a `Flag` (`flag` builds both). The flag's name is the
field's (``--max-loras``) unless given; its help is the field's docstring (the string literal
under it, as vLLM's configs document theirs), with each ````name```` of another option written
as its flag; its default is the field's. A boolean that defaults to True gets ``--no-NAME`` too.

Also here: the byte sizes flags take (``8GiB``, ``512MiB``, ``1073741824``).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import re
import textwrap
from collections.abc import Callable
from dataclasses import MISSING, dataclass
from typing import Any

__all__ = ["Flag", "add_flags", "field_docs", "flag", "flag_values", "flagged_fields", "option_names", "parse_byte_size",
           "parse_byte_size_or_zero"]


_FIELD_DEFAULT = object()  # a flag whose default is its field's


@dataclass(frozen=True)
class Flag:
    """How a config field appears on the command line.

    :ivar names: the flag and its aliases (default: ``--field-name``).
    :ivar dest: the attribute argparse stores it in (default: the field's name).
    :ivar type: text -> value; a `ValueError` it raises is shown as the flag's error.
    :ivar flag_default: the flag's default when it is not the field's: a value, or a callable
        read when the parser is built (the environment's default, say).
    :ivar group: the help section it is listed in.
    :ivar describe: more help, made when the parser is built (a JSON flag's keys, say).
    """

    names: tuple[str, ...] = ()
    dest: str | None = None
    type: Callable[[str], Any] | None = None
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    nargs: str | None = None
    action: str | None = None
    flag_default: Any = _FIELD_DEFAULT
    group: str | None = None
    describe: Callable[[], str] | None = None


def flag(default: Any, *names: str, **options: Any) -> Any:
    """A dataclass field with ``default`` (a list: a fresh copy for each object) that is also a
    flag (`Flag`'s options)."""
    metadata = {"flag": Flag(names=names, **options)}
    if isinstance(default, list):
        return dataclasses.field(default_factory=functools.partial(list, default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of dataclass ``cls`` (and its bases), joined into one paragraph."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__[:-1]):
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        body = ast.parse(source).body[0].body
        for node, after in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def flagged_fields(cls: type) -> list[tuple[dataclasses.Field, Flag]]:
    return [(f, f.metadata["flag"]) for f in dataclasses.fields(cls) if "flag" in f.metadata]


def option_names(cls: type) -> dict[str, str]:
    """field name -> its flag (``max_loras`` -> ``--max-loras``)."""
    return {f.name: (spec.names[-1] if spec.names else _long_name(f.name)) for f, spec in flagged_fields(cls)}


def _long_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def _flag_names(field: dataclasses.Field, spec: Flag) -> list[str]:
    names = list(spec.names) or [_long_name(field.name)]
    return sorted(names, key=lambda n: n.startswith("--"))  # short aliases first, as argparse shows them


def add_flags(parser: argparse.ArgumentParser, cls: type, *, groups: dict[str, Any] | None = None,
              flag_names: dict[str, str] | None = None) -> None:
    """Add a flag for every field of ``cls`` that has one (see the module docstring).

    :param groups: help sections by name (argument groups already made); a field's ``group``
        missing from it gets a new one, added to it.
    :param flag_names: field name -> flag of the options its docs may mention (besides ``cls``'s).
    """
    groups = {} if groups is None else groups
    docs = field_docs(cls)
    names = {**(flag_names or {}), **option_names(cls)}
    for field, spec in flagged_fields(cls):
        target = parser
        if spec.group is not None:
            if spec.group not in groups:
                groups[spec.group] = parser.add_argument_group(spec.group)
            target = groups[spec.group]
        default = field.default if spec.flag_default is _FIELD_DEFAULT else spec.flag_default
        if callable(default) and spec.flag_default is not _FIELD_DEFAULT:
            default = default()
        if default is MISSING:
            default = field.default_factory() if field.default_factory is not MISSING else None
        kwargs: dict[str, Any] = dict(dest=spec.dest or field.name, default=default)
        action = spec.action
        if action is None and isinstance(field.default, bool):
            action = argparse.BooleanOptionalAction if field.default else "store_true"
        if action is not None:
            kwargs["action"] = action
        convert = spec.type or (_annotated_type(field) if action is None else None)
        if convert is not None:
            kwargs["type"] = _shown_errors(convert)
        if spec.metavar is None and convert is int:
            kwargs["metavar"] = "N"
        for key in ("metavar", "choices", "nargs"):
            if getattr(spec, key) is not None:
                kwargs[key] = getattr(spec, key)
        doc = docs.get(field.name, "") + (f" {spec.describe()}" if spec.describe is not None else "")
        kwargs["help"] = _help(doc, names, default, action)
        target.add_argument(*_flag_names(field, spec), **kwargs)


def _annotated_type(field: dataclasses.Field) -> type | None:
    """int or float, from the annotation (``int | None``, ``list[int] | None``); else None (text)."""
    annotation = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", "")
    first = annotation.split("|")[0].strip().removeprefix("list[").rstrip("]")
    return {"int": int, "float": float}.get(first)


def flag_values(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The fields of ``cls`` that ``args`` gives (by each flag's ``dest``); a flag left at None
    is not given, so the field keeps its own default."""
    values = {}
    for field, spec in flagged_fields(cls):
        value = getattr(args, spec.dest or field.name, None)
        if value is not None:
            values[field.name] = value
    return values


_OPTION = re.compile(r"``(\w+)``")


def _help(doc: str, names: dict[str, str], default: Any, action: Any) -> str:
    """The field's doc, options named as flags, and the default unless the doc says it."""
    text = _OPTION.sub(lambda m: names.get(m[1], m[1]), doc).replace("%", "%%")
    if default is None or default is False or default == [] or action == "store_true" or "default" in doc.lower():
        return text
    return f"{text.rstrip('.')} (default: %(default)s)."


def _shown_errors(convert: Callable[[str], Any]) -> Callable[[str], Any]:
    """``convert``, its `ValueError` shown by argparse as the flag's error (not "invalid value")."""

    @functools.wraps(convert)
    def checked(text: str) -> Any:
        try:
            return convert(text)
        except argparse.ArgumentTypeError:
            raise
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return checked


# -- sizes ---------------------------------------------------------------------------------------

_BYTE_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([kmgt])(i?)b?|b)?\s*$", re.IGNORECASE)


def parse_byte_size(text: str, *, minimum: int = 1) -> int:
    """``1073741824``, ``512MiB``, ``8GiB``, ``2GB``, ``1.5G`` -> bytes (``KiB``: 1024, ``KB``: 1000)."""
    match = _BYTE_SIZE.match(text)
    if match is None:
        raise ValueError(f"{text!r} is not a size in bytes; write e.g. 8GiB, 512MiB, 2GB or 1073741824")
    number, unit, binary = match.groups()
    base = 1024 if binary else 1000
    size = int(float(number) * base ** ("kmgt".index(unit.lower()) + 1 if unit else 0))
    if size < minimum:
        raise ValueError(f"{text!r} is less than {minimum} byte{'s' * (minimum != 1)}")
    return size


def parse_byte_size_or_zero(text: str) -> int:
    """`parse_byte_size`, where 0 (turning a reservation off) is allowed too."""
    return parse_byte_size(text, minimum=0)
