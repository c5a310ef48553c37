"""Which TP modes the runtime trains: 1d (megatron-core's) everywhere, and metp for the encoder
(``runtime/metp``'s layers, one encoder op per attention and per MLP: ``layer_ops``,
``cost_model.METP_OPS``). The planner plans every mode (``tp_memory``, ``cost_model``); a job given
a plan the runtime cannot train stops here, before any rank connects, rather than train another
model under the plan's figures. No torch, so ``optimus_mllm.train`` checks a config before it starts
the ranks."""

from __future__ import annotations

from optimus_mllm.config import TPMode
from optimus_mllm.errors import ConfigError

# where an METP encoder trains: under the Optimus schedule and the Megatron-style baseline (the
# encoder whole in the first stage, METP over the LLM's TP group); the balanced baseline splits
# its layers with the LLM's 1D ones
_METP_ENCODER_MODES = ("optimus", "baseline")


def refuse_untrained_tp_modes(
    llm_mode: TPMode,
    encoder_mode: TPMode,
    sequence_parallel: bool,
    runtime: str,
    own_layers: bool = False,
) -> None:
    """Raise ``ConfigError`` naming the field whose TP mode the runtime cannot train yet.

    Args:
        llm_mode: the LLM plan's mode; trained in 1d only.
        encoder_mode: the encoder plan's mode; trained in 1d and metp.
        sequence_parallel: ``training.sequence_parallel``; METP's encoder chain and layers keep
            1/tp of the tokens, as sequence parallelism does, so it needs it.
        runtime: the Trainer's mode (``optimus``, ``baseline``, ``balanced``).
        own_layers: the job brings its encoder's layers (a model_provider's or a layer spec);
            METP builds its own.
    """
    if llm_mode != "1d":
        raise ConfigError("parallel.llm.tp_mode", _model_only(llm_mode, "1d"))
    if encoder_mode in ("1d", "metp"):
        problem = None
        if encoder_mode == "metp" and not sequence_parallel:
            problem = "metp keeps 1/tp of the tokens a rank; set training.sequence_parallel: true"
        elif encoder_mode == "metp" and runtime not in _METP_ENCODER_MODES:
            problem = f"metp encoders train under Optimus or --baseline, not the {runtime} baseline"
        elif encoder_mode == "metp" and own_layers:
            problem = "metp builds this project's ViT layers; a model_provider's or spec's cannot"
        if problem:
            raise ConfigError("parallel.encoder.tp_mode", problem)
        return
    raise ConfigError("parallel.encoder.tp_mode", _model_only(encoder_mode, "1d and metp"))


def _model_only(mode: TPMode, trained: str) -> str:
    return (
        f"the runtime trains only {trained} yet (issue 36/37); the planner's figures for {mode} "
        "are model-only"
    )
