"""Decoded JSON read into an answer's dataclass, every field's type checked on the way.

The fields and their types are the dataclass's own (`answers.py`, `reports.py`), so the
reader never lists them again. A field the type allows to be null may also be absent, and a
field with a default may be absent (answers of older services lack it); anything else
missing, or of another type, is an `UnreadableAnswer` naming the field. Booleans are not
integers here, though Python says they are; an integer is a float (JSON has one kind of
number). A `dict[str, X]` is an object whose every value is an X; a value typed `Any` is
taken as decoded, unchecked.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from typing import Any, NamedTuple, TypeVar

_T = TypeVar("_T")


class UnreadableAnswer(ValueError):
    """An answer without its declared shape; the message names the field."""


class _FieldSpec(NamedTuple):
    name: str
    kind: Any  # the field's type without its `| None`
    nullable: bool
    default: Any  # dataclasses.MISSING when the field must be present


def read(kind: type[_T], body: object) -> _T:
    """An instance of the answer dataclass `kind` from a decoded JSON object."""
    return kind(**read_fields(kind, body))


def read_fields(kind: type[Any], body: object, where: str = "") -> dict[str, Any]:
    """The fields of `kind` read from a decoded JSON object, by name (nested answers built)."""
    if not isinstance(body, dict):
        raise UnreadableAnswer(f"{where.rstrip('.') or 'the answer'} is not a JSON object")
    values: dict[str, Any] = {}
    for spec in _fields(kind):
        value = body.get(spec.name)
        if value is None and spec.nullable:
            values[spec.name] = None
        elif spec.name not in body and spec.default is not dataclasses.MISSING:
            values[spec.name] = spec.default
        else:
            values[spec.name] = _value(spec.kind, value, where + spec.name)
    return values


_SPECS: dict[type[Any], tuple[_FieldSpec, ...]] = {}  # per answer class, read once


def _fields(kind: type[Any]) -> tuple[_FieldSpec, ...]:
    known = _SPECS.get(kind)
    if known is not None:
        return known
    hints = typing.get_type_hints(kind)
    specs = []
    for item in dataclasses.fields(kind):
        hint = hints[item.name]
        members = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        present = [member for member in members if member is not types.NoneType]
        if len(present) != 1:
            raise TypeError(f"{kind.__name__}.{item.name}: one type, maybe | None, is readable")
        specs.append(_FieldSpec(item.name, present[0], len(members) > 1, item.default))
    _SPECS[kind] = tuple(specs)
    return _SPECS[kind]


def _value(kind: Any, value: object, path: str) -> Any:
    if isinstance(kind, type) and dataclasses.is_dataclass(kind):
        return kind(**read_fields(kind, value, path + "."))
    if kind is Any:
        return value
    if typing.get_origin(kind) is dict:
        _, item = typing.get_args(kind)  # JSON object keys are strings
        if not isinstance(value, dict):
            raise UnreadableAnswer(f"field {path!r} is missing or not an object")
        return {
            name: _value(item, element, f"{path}[{json.dumps(name, ensure_ascii=False)}]")
            for name, element in value.items()
        }
    if typing.get_origin(kind) is list:
        (item,) = typing.get_args(kind)
        if not isinstance(value, list):
            raise UnreadableAnswer(f"field {path!r} is missing or not a list")
        if item is str:
            if not set(map(type, value)) <= {str}:  # one pass in C: answers carry hundreds of keys
                raise UnreadableAnswer(f"field {path!r} must be a list of strings")
            return value
        return [_value(item, element, f"{path}[{index}]") for index, element in enumerate(value)]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise UnreadableAnswer(f"field {path!r} is missing or not of type {kind.__name__}")
    return value
