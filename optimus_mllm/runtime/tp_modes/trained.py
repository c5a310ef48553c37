"""Which TP modes the runtime trains: 1d (megatron-core's) everywhere, and metp and 2d for the
encoder (``runtime/metp``'s and ``layers_2d``'s layers as kernel-level ops: ``layer_ops``,
``cost_model.runtime_layer_ops``). The planner plans every mode (``tp_memory``, ``cost_model``); a
job given a plan the runtime cannot train stops here, before any rank connects, rather than train
another model under the plan's figures. No torch, so ``optimus_mllm.train`` checks a config before
it starts the ranks."""

from __future__ import annotations

from optimus_mllm.config import OptimusConfig, TPMode
from optimus_mllm.errors import ConfigError

# where an METP or 2D encoder trains: under the Optimus schedule and the Megatron-style baseline
# (the encoder whole in the first stage, on the LLM's TP group); the balanced baseline splits its
# layers with the LLM's 1D ones
_ENCODER_MODE_RUNTIMES = ("optimus", "baseline")


def refuse_untrained_tp_modes(
    llm_mode: TPMode,
    encoder_mode: TPMode,
    config: OptimusConfig,
    runtime: str,
    own_layers: bool = False,
) -> None:
    """Raise ``ConfigError`` naming the field whose TP mode the runtime cannot train yet.

    Args:
        llm_mode: the LLM plan's mode; trained in 1d only.
        encoder_mode: the encoder plan's mode; trained in 1d, metp and 2d.
        config: the job's; metp needs ``training.sequence_parallel`` (it keeps 1/tp of the tokens a
            rank, as its chain prices them), 2d needs it off (the grid splits samples and hidden)
            and no selective recomputation, no dropout (its steps have none).
        runtime: the Trainer's mode (``optimus``, ``baseline``, ``balanced``).
        own_layers: the job brings its encoder's layers (a model_provider's or a layer spec);
            metp and 2d build their own.
    """
    if llm_mode != "1d":
        raise ConfigError("parallel.llm.tp_mode", _model_only(llm_mode, "1d"))
    if encoder_mode in ("3d",):
        raise ConfigError("parallel.encoder.tp_mode", _model_only(encoder_mode, "1d, metp and 2d"))
    if encoder_mode == "1d":
        return
    problem = None
    sequence_parallel = config.training.sequence_parallel
    if encoder_mode == "metp" and not sequence_parallel:
        problem = "metp keeps 1/tp of the tokens a rank; set training.sequence_parallel: true"
    elif encoder_mode == "2d" and sequence_parallel:
        problem = "2d splits samples and hidden on its grid; set training.sequence_parallel: false"
    elif encoder_mode == "2d" and config.training.recompute == "selective":
        problem = "2d encoders recompute none or full layers; set training.recompute"
    elif encoder_mode == "2d" and any(
        enc.hidden_dropout or enc.attention_dropout for enc in config.encoders
    ):
        problem = "2d encoders train without dropout yet; set the encoders' dropouts to 0"
    elif runtime not in _ENCODER_MODE_RUNTIMES:
        problem = (
            f"{encoder_mode} encoders train under Optimus or --baseline, not the {runtime} baseline"
        )
    elif own_layers:
        problem = (
            f"{encoder_mode} builds this project's ViT layers; a model_provider's or spec's cannot"
        )
    if problem:
        raise ConfigError("parallel.encoder.tp_mode", problem)


def _model_only(mode: TPMode, trained: str) -> str:
    return (
        f"the runtime trains only {trained} yet (issue 36/37); the planner's figures for {mode} "
        "are model-only"
    )
