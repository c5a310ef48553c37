"""Which TP modes the runtime trains: 1d (megatron-core's) only, until the 2D, 3D and METP layers
(this package, ``runtime/metp``) are built into the trainer's models and its encoder ops (issues
36, 37). The planner plans every mode (``tp_memory``, ``cost_model``); a job given a plan in
another mode stops here, before any rank connects, rather than train 1D under the other's figures.
No torch, so ``optimus_mllm.train`` checks a config before it starts the ranks."""

from __future__ import annotations

from optimus_mllm.config import TPMode
from optimus_mllm.errors import ConfigError


def refuse_untrained_tp_modes(llm_mode: TPMode, encoder_mode: TPMode) -> None:
    """Raise ``ConfigError`` naming the field whose TP mode the runtime cannot train yet."""
    for field, mode in (
        ("parallel.llm.tp_mode", llm_mode),
        ("parallel.encoder.tp_mode", encoder_mode),
    ):
        if mode != "1d":
            raise ConfigError(
                field,
                f"the runtime trains only 1d yet (issue 36/37); the planner's figures for {mode} "
                "are model-only",
            )
