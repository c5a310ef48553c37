"""Finding what a patch replaces in megatron-core, checked against the installed version.

Every module of ``megatron_patches`` resolves its targets through ``import_module`` and
``require``, so that a megatron-core release that renames or moves one fails at once with
``MegatronPatchError``, naming the attribute and the version, instead of patching nothing or the
wrong object.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any


class MegatronPatchError(RuntimeError):
    """A megatron-core attribute that a patch needs is missing (renamed in this version?)."""


@dataclass(frozen=True)
class Patch:
    """Replace ``owner.name`` (a module or class attribute) by ``replacement``."""

    owner: object
    name: str
    replacement: object


def megatron_version() -> str:
    return getattr(importlib.import_module("megatron.core"), "__version__", "unknown")


def import_module(path: str) -> ModuleType:
    """megatron-core's module ``path``; MegatronPatchError if this version has none."""
    try:
        return importlib.import_module(path)
    except ImportError as error:
        raise MegatronPatchError(
            f"megatron_patches: cannot import {path} (megatron-core {megatron_version()})"
        ) from error


def require(owner: object, name: str) -> Any:
    """``owner.name``; MegatronPatchError if this megatron-core version lacks it."""
    if not hasattr(owner, name):
        raise MegatronPatchError(
            f"megatron_patches: {getattr(owner, '__name__', owner)} has no attribute {name!r} "
            f"(megatron-core {megatron_version()}); update megatron_patches for this version"
        )
    return getattr(owner, name)


# What ``install`` records per patched attribute: (owner, name, the owner's own value or ABSENT)
Originals = list[tuple[object, str, object]]
ABSENT = object()  # the attribute was inherited, not set on its owner


def install(patches: list[Patch], originals: Originals) -> None:
    """Set every patch's replacement, recording in ``originals`` what it replaced."""
    for patch in patches:
        originals.append((patch.owner, patch.name, vars(patch.owner).get(patch.name, ABSENT)))
        setattr(patch.owner, patch.name, patch.replacement)


def restore(originals: Originals) -> None:
    """Put back, last first, everything ``install`` recorded in ``originals``, emptying it."""
    while originals:
        owner, name, original = originals.pop()
        if original is ABSENT:
            delattr(owner, name)
        else:
            setattr(owner, name, original)
