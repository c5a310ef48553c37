"""The names in Megatron-LM's ``megatron.training.training`` through which Optimus enters its loop.

Megatron-LM's ``pretrain`` has no hook for a second model part with its own parallel plan, so the
Optimus runtime (``optimus_mllm.megatron.seams``) wraps four names that ``training.py`` looks up
at call time: ``get_megatron_optimizer`` (the encoder stage's parameters join the optimizer),
``get_forward_backward_func`` (each step runs megatron-core's schedule with the encoder ops at its
hook points), ``save_checkpoint`` and ``load_checkpoint`` (the encoder's weights under LLaVA's
keys). Each wrapper receives the original and calls it; nothing else of ``megatron.training``
changes. Production code: installed on GPUs as on the CPU, only while a job with
``--optimus-schedule`` runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from megatron_patches.lookup import Originals, Patch, import_module, install, require, restore

Wrap = Callable[[Callable[..., Any]], Callable[..., Any]]

SEAMS = (
    "get_megatron_optimizer",
    "get_forward_backward_func",
    "save_checkpoint",
    "load_checkpoint",
)


@contextlib.contextmanager
def training_seams(wrappers: dict[str, Wrap]) -> Iterator[None]:
    """While inside: each of ``SEAMS`` in ``megatron.training.training`` is ``wrappers[name]``
    applied to Megatron-LM's own function; restored on leaving."""
    unknown = set(wrappers) - set(SEAMS)
    if unknown:
        raise ValueError(f"training_seams: no seam named {sorted(unknown)}")
    training = import_module("megatron.training.training")
    originals: Originals = []
    install(
        [Patch(training, name, wrap(require(training, name))) for name, wrap in wrappers.items()],
        originals,
    )
    try:
        yield
    finally:
        restore(originals)
