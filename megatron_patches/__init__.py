"""The only place in optimus-mllm that patches megatron-core.

megatron-core's pipeline schedules hard-code CUDA in a few spots (see ``_cpu.py``). On a host
without CUDA, ``apply()`` points exactly those at the CPU so the schedules run under gloo (tests,
CI); where CUDA is available it installs nothing. ``remove()`` puts back the original objects.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from megatron_patches._cpu import MegatronPatchError, cpu_patches

__all__ = ["MegatronPatchError", "apply", "is_applied", "patched", "remove"]

_ABSENT = object()  # the attribute was inherited, not set on its owner
_originals: list[tuple[object, str, object]] = []  # (owner, name, owner's own value or _ABSENT)


def apply() -> None:
    """Install the CPU patches; a no-op if they are installed or CUDA is available.

    Raises MegatronPatchError, installing nothing, if this megatron-core lacks a patched attribute.
    """
    if _originals or torch.cuda.is_available():
        return
    patches = cpu_patches()  # resolves every target first: a missing one installs nothing
    for patch in patches:
        _originals.append((patch.owner, patch.name, vars(patch.owner).get(patch.name, _ABSENT)))
        setattr(patch.owner, patch.name, patch.replacement)


def remove() -> None:
    """Restore every patched attribute to its original object; a no-op if nothing is installed."""
    while _originals:
        owner, name, original = _originals.pop()
        if original is _ABSENT:
            delattr(owner, name)
        else:
            setattr(owner, name, original)


def is_applied() -> bool:
    """Whether the CPU patches are installed now."""
    return bool(_originals)


@contextlib.contextmanager
def patched() -> Iterator[None]:
    """apply() for the duration of the block; leaves patches that were already installed."""
    was_applied = is_applied()
    apply()
    try:
        yield
    finally:
        if not was_applied:
            remove()
