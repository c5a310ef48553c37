"""YAML the user gives us (config files, ``--override`` values), read strictly and within bounds.

PyYAML's ``safe_load`` lets a later duplicate key silently replace an earlier one (a second
``training:`` block drops the first), recurses once per nesting level until Python's stack runs out,
and raises plain ``ValueError`` for integers of more than 4300 digits. Here a duplicate key, a file
that is not UTF-8 text or larger than ``MAX_FILE_BYTES``, nesting deeper than ``MAX_DEPTH`` and any
number that Python cannot hold are each one :class:`YAMLInputError` saying what is wrong and where.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from optimus_mllm.config.files import read_regular_file

MAX_FILE_BYTES = 1 << 20  # a config is a few KB; /dev/zero or a dataset named by mistake is not one
MAX_DEPTH = 32  # a config nests four levels


class YAMLInputError(ValueError):
    """What is wrong with a YAML text, with its line where there is one."""


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping."""


def _mapping(loader: _StrictLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    loader.flatten_mapping(node)
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        if isinstance(key, (str, int, float, bool)) or key is None:
            if key in seen:
                raise YAMLInputError(
                    f"key {key!r} is given twice (line {key_node.start_mark.line + 1}); keep one"
                )
            seen.add(key)
    return loader.construct_mapping(node, deep=True)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def parse_yaml(text: str) -> Any:
    """The value of a YAML text; YAMLInputError if it is not valid, bounded YAML."""
    try:
        value = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise YAMLInputError(f"is not valid YAML{where}") from None
    except RecursionError:
        raise YAMLInputError(f"nests deeper than {MAX_DEPTH} levels") from None
    except ValueError as exc:  # an integer too long to convert, or our duplicate key
        if isinstance(exc, YAMLInputError):
            raise
        raise YAMLInputError(
            f"holds a number Python cannot read ({str(exc).split(':')[0]})"
        ) from None
    if _depth(value) > MAX_DEPTH:
        raise YAMLInputError(f"nests deeper than {MAX_DEPTH} levels")
    return value


def read_yaml_file(path: Path) -> Any:
    """The value of the YAML file at ``path``; OSError as ``read_regular_file`` raises it (also for
    a FIFO or device), YAMLInputError otherwise."""
    data = read_regular_file(path, MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise YAMLInputError(f"is larger than {MAX_FILE_BYTES >> 20} MiB, too large for a config")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise YAMLInputError(f"is not UTF-8 text (byte {exc.start})") from None
    return parse_yaml(text)


def _depth(value: Any, level: int = 0) -> int:
    if level > MAX_DEPTH:
        return level
    if isinstance(value, dict):
        return max((_depth(v, level + 1) for v in value.values()), default=level + 1)
    if isinstance(value, list):
        return max((_depth(v, level + 1) for v in value), default=level + 1)
    return level
