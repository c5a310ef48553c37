"""Megatron-LM's command line (``megatron/training/arguments.py`` and ``get_args``), which the
megatron-core wheel does not ship: the flags a ViT + GPT job sets, under Megatron-LM's names,
destinations and defaults at tag ``core_v0.16.1`` (the model's sizes and shape, parallelism, batch,
optimizer, precision, timing), ``validate_args`` deriving from them what Megatron-LM's derives
(layer counts, model chunks, global batch, ...), and the parsed flags the job's providers read
back. ``optimus_mllm.megatron`` says what each model flag becomes, or why it is refused;
``tests/unit/test_plan_megatron_flags.py`` checks the two against Megatron-LM's own where a
checkout is at hand.

Both ``pretrain``s parse here: Megatron-style (``optimus_mllm.megatron.core_training``) and with
``--optimus-schedule`` (``optimus_mllm.megatron``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from optimus_mllm.errors import OptimusError

_ARGS: argparse.Namespace | None = None


ExtraArgsProvider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]


def parse_args(
    extra_args_provider: ExtraArgsProvider | None = None, argv: list[str] | None = None
) -> argparse.Namespace:
    """Megatron-LM's ``parse_args`` contract: its flags, plus whatever ``extra_args_provider``
    adds."""
    return build_parser(extra_args_provider).parse_args(argv)


def build_parser(
    extra_args_provider: ExtraArgsProvider | None = None,
    parser_class: type[argparse.ArgumentParser] = argparse.ArgumentParser,
    prog: str | None = None,
) -> argparse.ArgumentParser:
    """The script's flags: Megatron-LM's names, destinations and defaults (tag ``core_v0.16.1``:
    ``megatron/training/arguments.py``, and ``pretrain_vlm.py``'s ``add_vlm_extra_args``).

    ``parser_class`` and ``prog`` let a command report a bad flag its own way (``optimus-plan``: one
    line)."""
    parser = parser_class(
        prog=prog, description="Megatron-style ViT + GPT pretraining", allow_abbrev=False
    )
    add = parser.add_argument
    add("--tensor-model-parallel-size", type=int, default=1)
    add("--pipeline-model-parallel-size", type=int, default=1)
    # at most one of the two; validate_args turns it into virtual_pipeline_model_parallel_size
    add("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    add("--num-virtual-stages-per-pipeline-rank", type=int, default=None)
    # uneven and custom pipeline layouts (optimus_mllm.megatron refuses them)
    add("--decoder-first-pipeline-num-layers", type=int, default=None)
    add("--decoder-last-pipeline-num-layers", type=int, default=None)
    add("--pipeline-model-parallel-layout", type=str, default=None)
    add("--account-for-embedding-in-pipeline-split", action="store_true")
    add("--account-for-loss-in-pipeline-split", action="store_true")
    add("--context-parallel-size", type=int, default=1)
    add("--expert-model-parallel-size", type=int, default=1)
    # the model: Megatron-LM's flags and defaults; the sizes have none (validate_args requires them)
    add("--num-layers", type=int, default=None)
    add("--decoder-num-layers", type=int, default=None)
    add("--encoder-num-layers", type=int, default=None)
    add("--hidden-size", type=int, default=None)
    add("--ffn-hidden-size", type=int, default=None)
    add("--num-attention-heads", type=int, default=None)
    add("--kv-channels", type=int, default=None)
    add("--group-query-attention", action="store_true")
    add("--num-query-groups", type=int, default=1)
    add("--seq-length", type=int, default=None)
    add("--dataloader-seq-length", type=int, default=None)
    add("--max-position-embeddings", type=int, default=None)
    add("--vocab-size", type=int, default=None)
    add(
        "--position-embedding-type",
        type=str,
        default="learned_absolute",
        choices=["learned_absolute", "rope", "mrope", "relative", "none"],
    )
    add("--rotary-percent", type=float, default=1.0)
    add("--rotary-base", type=int, default=10000)
    add("--use-rope-scaling", action="store_true")
    add("--normalization", type=str, default="LayerNorm", choices=["LayerNorm", "RMSNorm"])
    add("--norm-epsilon", dest="layernorm_epsilon", type=float, default=1e-5)
    add("--apply-layernorm-1p", dest="layernorm_zero_centered_gamma", action="store_true")
    add("--qk-layernorm", action="store_true")
    add("--disable-bias-linear", action="store_false", dest="add_bias_linear")
    add("--add-qkv-bias", action="store_true")
    add("--swiglu", action="store_true")
    add("--squared-relu", action="store_true")
    add("--openai-gelu", action="store_true")
    add("--quick-geglu", action="store_true")
    add("--num-experts", type=int, default=None)
    add("--multi-latent-attention", action="store_true")
    add("--init-method-std", type=float, default=0.02)
    add("--apply-query-key-layer-scaling", action="store_true")
    add("--untie-embeddings-and-output-weights", action="store_true")
    add("--hidden-dropout", type=float, default=0.1)
    add("--attention-dropout", type=float, default=0.1)
    # Megatron-LM's default is transformer_engine, which the Optimus runtime does not run yet
    add(
        "--transformer-impl",
        type=str,
        default="transformer_engine",
        choices=["local", "transformer_engine", "inference_optimized"],
    )
    add("--recompute-granularity", type=str, default=None, choices=["full", "selective"])
    add("--recompute-method", type=str, default=None, choices=["uniform", "block"])
    add("--recompute-num-layers", type=int, default=None)
    add("--fp8-format", dest="fp8", type=str, default=None, choices=["e4m3", "hybrid"])
    # the vision model (pretrain_vlm.py: a copy of the language model's layers)
    add("--img-h", type=int, default=224)
    add("--img-w", type=int, default=224)
    add("--patch-dim", type=int, default=16)
    add("--num-channels", type=int, default=3)
    add("--disable-vision-class-token", action="store_true")
    add("--freeze-LM", action="store_true")
    add("--freeze-ViT", action="store_true")
    add("--micro-batch-size", type=int, default=None)
    add("--global-batch-size", type=int, default=None)
    add("--train-iters", type=int, default=None)
    add("--lr", type=float, default=None)
    # optimizer, clipping, LR schedule and loss scaling: Megatron-LM's flags and defaults
    add("--optimizer", type=str, choices=["adam", "sgd"], default="adam")
    add("--min-lr", type=float, default=0.0)
    add("--lr-decay-style", type=str, choices=["constant", "linear", "cosine"], default="linear")
    add("--lr-warmup-iters", type=int, default=0)
    add("--lr-decay-iters", type=int, default=None)
    add("--weight-decay", type=float, default=0.01)
    add("--adam-beta1", type=float, default=0.9)
    add("--adam-beta2", type=float, default=0.999)
    add("--adam-eps", type=float, default=1e-8)
    add("--sgd-momentum", type=float, default=0.9)
    add("--clip-grad", type=float, default=1.0)
    add("--loss-scale", type=float, default=None)
    add("--initial-loss-scale", type=float, default=2.0**32)
    add("--min-loss-scale", type=float, default=1.0)
    add("--loss-scale-window", type=float, default=1000)
    add("--hysteresis", type=int, default=2)
    add("--use-distributed-optimizer", action="store_true")
    add("--seed", type=int, default=1234)
    add("--timing-log-level", type=int, default=0, choices=range(0, 3))
    add("--timing-log-option", type=str, default="minmax", choices=["max", "minmax", "all"])
    add("--bf16", action="store_true")
    add("--fp16", action="store_true")
    add("--sequence-parallel", action="store_true")
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    return parser


def validate_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Megatron-LM's ``validate_args`` for the flags this project reads: what it derives, and what
    it refuses, here as one line naming the flag (an ``OptimusError``) where Megatron asserts.

    Like Megatron's, it updates ``args`` in place and returns it. The uneven and custom pipeline
    layouts, which ``optimus_mllm.megatron`` refuses, are not read here. What it derives:
    ``world_size``, ``data_parallel_size``, ``global_batch_size`` (micro batch x DP when not
    given), ``virtual_pipeline_model_parallel_size`` (None for one chunk per stage) from
    ``--num-layers-per-virtual-pipeline-stage`` or ``--num-virtual-stages-per-pipeline-rank``,
    ``num_layers`` and ``encoder_num_layers`` (each the other when only one is given; both is
    refused), ``ffn_hidden_size`` and ``kv_channels``, ``add_qkv_bias`` (set with the linear
    biases) and ``sequence_parallel`` (off without TP). ``pretrain_vlm.py`` then builds the LLM
    with ``decoder_num_layers`` layers when given, else ``num_layers``, and the vision model with
    ``encoder_num_layers``.

    Args:
        args: a ``parse_args`` namespace of this module's parser.
        world_size: the job's number of ranks (Megatron reads ``WORLD_SIZE``).

    Returns:
        ``args``, validated.
    """
    for flag in _POSITIVE:
        value = getattr(args, _dest(flag))
        if value is not None and value < 1:
            raise OptimusError(f"{flag} {value}: must be a positive integer")
    tp, pp, cp = (
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        args.context_parallel_size,
    )
    if world_size % (tp * pp * cp):
        raise OptimusError(
            f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp} x "
            f"--context-parallel-size {cp} does not divide the world size {world_size}; launch a "
            f"multiple of {tp * pp * cp} processes"
        )
    args.world_size, args.data_parallel_size = world_size, world_size // (tp * pp * cp)
    if args.micro_batch_size is None:
        raise OptimusError("--micro-batch-size is missing: Megatron-LM requires it")
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    args.virtual_pipeline_model_parallel_size = _virtual_stages(args)
    if args.num_layers is not None:
        if args.encoder_num_layers is not None:
            raise OptimusError(
                f"--num-layers {args.num_layers} with --encoder-num-layers "
                f"{args.encoder_num_layers}: Megatron-LM refuses both; give the vision model's "
                "depth as --encoder-num-layers and the LLM's as --decoder-num-layers"
            )
        args.encoder_num_layers = args.num_layers
    elif args.encoder_num_layers is not None:
        args.num_layers = args.encoder_num_layers
    else:
        raise OptimusError(
            "--num-layers or --encoder-num-layers is missing: Megatron-LM requires one (with "
            "pretrain_vlm.py, --encoder-num-layers for the vision model and --decoder-num-layers "
            "for the LLM)"
        )
    for flag in ("--hidden-size", "--num-attention-heads", "--max-position-embeddings"):
        if getattr(args, _dest(flag)) is None:
            raise OptimusError(f"{flag} is missing: Megatron-LM requires it")
    if args.seq_length is None:
        raise OptimusError("--seq-length is missing: the text tokens of a sample")
    if args.max_position_embeddings < args.seq_length:
        raise OptimusError(
            f"--max-position-embeddings {args.max_position_embeddings} is less than --seq-length "
            f"{args.seq_length}; Megatron-LM requires at least the sequence length"
        )
    if args.ffn_hidden_size is None:  # with --swiglu, about the parameters of 4 * hidden
        hidden = args.hidden_size
        args.ffn_hidden_size = int(4 * hidden * 2 / 3 / 64) * 64 if args.swiglu else 4 * hidden
    if args.kv_channels is None:
        if args.hidden_size % args.num_attention_heads:
            raise OptimusError(
                f"--num-attention-heads {args.num_attention_heads} does not divide --hidden-size "
                f"{args.hidden_size}; give --kv-channels or a dividing head count"
            )
        args.kv_channels = args.hidden_size // args.num_attention_heads
    if args.fp16 and args.bf16:
        raise OptimusError("--fp16 with --bf16: Megatron-LM takes one of the two")
    if tp == 1:
        args.sequence_parallel = False
    if args.add_bias_linear:  # Megatron keeps the two in sync; --add-qkv-bias is the narrower
        args.add_qkv_bias = True
    return args


def _virtual_stages(args: argparse.Namespace) -> int | None:
    """``virtual_pipeline_model_parallel_size`` as Megatron-LM's ``validate_args`` resolves it.

    Megatron counts the layers of ``--num-layers`` when given, else of ``--decoder-num-layers``
    (with pretrain_vlm.py's ``--encoder-num-layers`` / ``--decoder-num-layers``, the LLM's)."""
    per_stage = args.num_layers_per_virtual_pipeline_stage
    stages = args.num_virtual_stages_per_pipeline_rank
    pp = args.pipeline_model_parallel_size
    if per_stage is not None and stages is not None:
        raise OptimusError(
            "--num-layers-per-virtual-pipeline-stage with --num-virtual-stages-per-pipeline-rank: "
            "Megatron-LM takes one of the two"
        )
    if per_stage is not None:
        layers, flag = (
            (args.num_layers, "--num-layers")
            if args.num_layers is not None
            else (args.decoder_num_layers, "--decoder-num-layers")
        )
        if layers is None:
            raise OptimusError(
                "--num-layers-per-virtual-pipeline-stage needs --num-layers or "
                "--decoder-num-layers, whose layers it divides"
            )
        if layers % pp or (layers // pp) % per_stage:
            raise OptimusError(
                f"--num-layers-per-virtual-pipeline-stage {per_stage} does not divide the "
                f"{layers / pp:g} layers of a pipeline stage ({flag} {layers} / "
                f"--pipeline-model-parallel-size {pp})"
            )
        stages = layers // pp // per_stage
    elif stages is None and args.num_layers is not None and args.num_layers % pp:
        raise OptimusError(
            f"--pipeline-model-parallel-size {pp} does not divide --num-layers {args.num_layers}"
        )
    return stages if stages != 1 else None


# flags that must be positive integers when given (the arithmetic divides by them)
_POSITIVE = (
    "--tensor-model-parallel-size",
    "--pipeline-model-parallel-size",
    "--context-parallel-size",
    "--num-layers",
    "--decoder-num-layers",
    "--encoder-num-layers",
    "--hidden-size",
    "--num-attention-heads",
    "--micro-batch-size",
    "--num-layers-per-virtual-pipeline-stage",
    "--num-virtual-stages-per-pipeline-rank",
)


def _dest(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")


def set_args(args: argparse.Namespace) -> None:
    global _ARGS
    _ARGS = args


def get_args() -> argparse.Namespace:
    """The job's parsed flags, as ``megatron.training.get_args`` returns them."""
    if _ARGS is None:
        raise RuntimeError("get_args() before pretrain() parsed the flags")
    return _ARGS


def add_optimus_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron's ``extra_args_provider``: the one flag Optimus needs, and the profile it may
    price the job with."""
    group = parser.add_argument_group(title="optimus")
    group.add_argument(
        "--optimus-schedule",
        metavar="auto|PLAN_JSON",
        default=None,
        help="run the encoders in the LLM's pipeline bubbles: 'auto' plans and schedules the job "
        "at start-up, PLAN_JSON is a saved schedule (optimus-plan --artifact); left out, the job "
        "runs Megatron-style",
    )
    group.add_argument(
        "--optimus-profile",
        metavar="P",
        default=None,
        help="with --optimus-schedule: price the job with this machine's kernel profile "
        "(optimus-profile --out P, as optimus-plan --profile) instead of the cost model's GPU "
        "constants; a saved schedule must have been made with the same profile",
    )
    return parser
