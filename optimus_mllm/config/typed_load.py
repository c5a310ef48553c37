"""Frozen dataclasses from parsed YAML or JSON, strictly: the one loader of the config and the
schedule artifact.

``load_typed(cls, data, where)`` builds dataclass ``cls`` from a mapping, field by field from its
type hints: unknown keys, missing fields and values of the wrong type are refused with a
``ConfigError`` whose field is the value's path (``model.encoders[0].projector.type``,
``encoder_stages[3].ops[17].piece``) and whose message says what would be valid. ``to_json`` is the
way back, so what ``load_typed`` reads from ``to_json``'s output is equal to what was written.

Types understood: ``bool``, ``int``, ``float``, ``str``, ``Literal[...]``, frozen dataclasses,
``tuple[X, ...]`` (a non-empty list), ``tuple[X, Y]`` (a list of that length), ``dict[str, X]``,
``X | None``, and unions of scalars (``str | int | float | bool | None``). Numbers are bounded by
``MAX_NUMBER``: no size, count, time or rate either file holds comes near it, and a typo must not
run the planner for hours.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import re
import types
import typing
from typing import Any, Literal, TypeVar

from optimus_mllm.errors import ConfigError

MAX_NUMBER = 1e15  # above every size, count, rate and bandwidth a config holds (1e15 B/s is 1 PB/s)
# YAML 1.1 (PyYAML) reads 1e-4 as a string; a Megatron user writes lr: 1e-4
_YAML11_EXPONENT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")
_SCALAR_NAMES = {
    bool: "true or false",
    int: "an integer",
    float: "a number",
    str: "a string",
    type(None): "null",
}

T = TypeVar("T")


def load_typed(cls: type[T], data: Any, where: str) -> T:
    """Dataclass ``cls`` from the mapping ``data`` found at path ``where`` ("" for the top)."""
    label = where or "config"
    if not isinstance(data, dict):
        raise ConfigError(
            label, f"expected a mapping of {cls.__name__} fields, got {describe(data)}"
        )
    hints, fields = _schema(cls)
    for key in data:
        if key not in fields:
            raise ConfigError(join(where, str(key)), _unknown_key_message(str(key), fields))
    kwargs = {}
    for name, f in fields.items():
        path = join(where, name)
        if name in data:
            kwargs[name] = coerce(hints[name], data[name], path)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(path, "is required but missing")
    return cls(**kwargs)


@functools.cache
def _schema(cls: type) -> tuple[dict[str, Any], dict[str, dataclasses.Field]]:
    """A dataclass's field types and fields, worked out once: resolving the annotations is most of
    the time of a large file's load otherwise."""
    return typing.get_type_hints(cls), {f.name: f for f in dataclasses.fields(cls)}


@functools.cache
def _shape(tp: Any) -> tuple[Any, tuple[Any, ...], bool]:
    """A type's origin, arguments and whether it is a dataclass, worked out once per type."""
    return typing.get_origin(tp), typing.get_args(tp), dataclasses.is_dataclass(tp)


def coerce(tp: Any, value: Any, path: str) -> Any:
    """``value`` as type ``tp``, or a ConfigError naming ``path``."""
    origin, args, is_dataclass = _shape(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return coerce(inner[0], value, path)
        return _scalar_union(inner, value, path)
    if origin is Literal:
        if value not in args:
            raise ConfigError(path, f"must be one of {', '.join(map(str, args))}; got {value!r}")
        return value
    if origin is tuple:
        return _tuple(args, value, path)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(path, f"expected a mapping, got {describe(value)}")
        return {key: coerce(args[1], v, f"{path}[{key!r}]") for key, v in value.items()}
    if is_dataclass:
        return load_typed(tp, value, path)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, f"expected true or false, got {describe(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, f"expected an integer, got {describe(value)}")
        if abs(value) > MAX_NUMBER:
            raise ConfigError(
                path, f"{short(value)} is beyond any config value (at most {MAX_NUMBER:.0e})"
            )
        return value
    if tp is float:
        if isinstance(value, str) and _YAML11_EXPONENT.fullmatch(value.strip()):
            value = float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(path, f"expected a number, got {describe(value)}")
        if isinstance(value, float) and not math.isfinite(value) or abs(value) > MAX_NUMBER:
            raise ConfigError(
                path, f"must be a finite number of at most {MAX_NUMBER:.0e}, got {short(value)}"
            )
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(path, f"expected a string, got {describe(value)}")
        return value
    # a bug in a schema, not user input
    raise TypeError(f"unsupported schema type {tp!r} at {path}")


def _tuple(args: tuple[Any, ...], value: Any, path: str) -> tuple[Any, ...]:
    if len(args) == 2 and args[1] is Ellipsis:
        if not isinstance(value, list) or not value:
            raise ConfigError(path, f"expected a non-empty list, got {describe(value)}")
        return tuple(coerce(args[0], v, f"{path}[{i}]") for i, v in enumerate(value))
    if not isinstance(value, list) or len(value) != len(args):
        raise ConfigError(path, f"expected a list of {len(args)} entries, got {describe(value)}")
    return tuple(coerce(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value)))


def _scalar_union(kinds: list[Any], value: Any, path: str) -> Any:
    """The first of the scalar ``kinds`` that takes ``value`` as it is (an integer stays one)."""
    for kind in kinds:
        try:
            return coerce(kind, value, path)
        except ConfigError:
            continue
    names = ", ".join(_SCALAR_NAMES[k] for k in [*kinds, type(None)])
    raise ConfigError(path, f"expected one of {names}; got {describe(value)}")


def to_json(value: Any) -> Any:
    """A dataclass (and what it holds) as the JSON value ``load_typed`` reads back."""
    if dataclasses.is_dataclass(value):
        return {f.name: to_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (tuple, list)):
        return [to_json(v) for v in value]
    if isinstance(value, dict):
        return {key: to_json(v) for key, v in value.items()}
    return value


def describe(value: Any) -> str:
    """A value and its type, as an error message shows what it got."""
    return f"{short(value)} ({type(value).__name__})"


def short(value: Any) -> str:
    """``repr`` cut to a readable length (an integer of 5000 digits is not one)."""
    text = (
        repr(value)
        if not isinstance(value, int) or abs(value) < 10**30
        else f"a {len(str(abs(value)))}-digit integer"
    )
    return text if len(text) <= 60 else text[:57] + "..."


def join(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


def _unknown_key_message(key: str, fields: dict[str, dataclasses.Field]) -> str:
    # a field the loader sets (the config's ``source``) is not offered as a key to write
    valid = [k for k, f in fields.items() if not f.metadata.get("set_by_loader")]
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f"did you mean '{close[0]}'? " if close else ""
    return f"unknown key; {hint}valid keys: {', '.join(valid)}"
