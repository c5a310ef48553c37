"""The CPU emulation of megatron-core's CUDA assumptions: tests and CI only, never on a GPU.

megatron-core's pipeline schedules and training stack hard-code CUDA in a few spots: allocations and
synchronizations by device name (``devices``), the CUDA random-number generator (``rng``), and
``Tensor.type`` / ``Tensor.cuda`` inside a few calls (``tensor_methods``). On a host without CUDA,
``apply()`` points exactly those at the CPU, so that megatron-core's own code runs the schedules
under gloo; where CUDA is available it installs nothing. ``remove()`` puts back the original
objects.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from megatron_patches.cpu.devices import device_patches
from megatron_patches.cpu.rng import rng_patches
from megatron_patches.cpu.tensor_methods import tensor_method_patches
from megatron_patches.lookup import Originals, Patch, install, restore

_originals: Originals = []


def cpu_patches() -> list[Patch]:
    """Every patch CPU runs need; raises MegatronPatchError before anything is installed."""
    return [*device_patches(), *rng_patches(), *tensor_method_patches()]


def apply() -> None:
    """Install the CPU patches; a no-op if they are installed or CUDA is available.

    Raises MegatronPatchError, installing nothing, if this megatron-core lacks a patched attribute.
    """
    if _originals or torch.cuda.is_available():
        return
    patches = cpu_patches()  # resolves every target first: a missing one installs nothing
    install(patches, _originals)


def remove() -> None:
    """Restore every patched attribute to its original object; a no-op if nothing is installed."""
    restore(_originals)


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
