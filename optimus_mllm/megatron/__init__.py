"""One flag on an existing Megatron job (``entry``), Megatron-LM's flags (``arguments``,
``flags``, ``unread_flags``), Megatron-LM's own loop and its seams (``lm``, ``seams``), the
stand-in for ``megatron.training`` (``core_training``) and the CPU launcher (``cpu``:
``python -m optimus_mllm.megatron.cpu``).

A Megatron script's one-line opt-in stays::

    from optimus_mllm.megatron import pretrain  # adds --optimus-schedule auto|PLAN_JSON

``pretrain`` is ``entry.pretrain``, imported when first asked for, so that importing a submodule
(the CPU launcher above all) loads nothing more than it did as a module of its own.
"""

from __future__ import annotations

from typing import Any

__all__ = ["pretrain"]


def __getattr__(name: str) -> Any:
    if name == "pretrain":
        from optimus_mllm.megatron.entry import pretrain

        return pretrain
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
