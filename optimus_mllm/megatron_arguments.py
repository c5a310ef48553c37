"""Megatron-LM's command line (``megatron/training/arguments.py`` and ``get_args``), which the
megatron-core wheel does not ship: the flags a ViT + GPT job sets, under Megatron-LM's names and
defaults (the model's sizes and shape, parallelism, batch, optimizer, precision, timing), and the
parsed flags the job's providers read back. ``optimus_mllm.megatron`` says what each model flag
becomes, or why it is refused.

Both ``pretrain``s parse here: Megatron-style (``megatron_training``) and with
``--optimus-schedule`` (``optimus_mllm.megatron``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

_ARGS: argparse.Namespace | None = None


ExtraArgsProvider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]


def parse_args(
    extra_args_provider: ExtraArgsProvider | None = None, argv: list[str] | None = None
) -> argparse.Namespace:
    """Megatron-LM's ``parse_args`` contract: its flags, plus whatever ``extra_args_provider``
    adds."""
    return build_parser(extra_args_provider).parse_args(argv)


def build_parser(extra_args_provider: ExtraArgsProvider | None = None) -> argparse.ArgumentParser:
    """The script's flags: Megatron-LM's names and defaults."""
    parser = argparse.ArgumentParser(
        description="Megatron-style ViT + GPT pretraining", allow_abbrev=False
    )
    add = parser.add_argument
    add("--tensor-model-parallel-size", type=int, default=2)
    add("--pipeline-model-parallel-size", type=int, default=2)
    add("--num-layers-per-virtual-pipeline-stage", type=int, default=1)
    add("--context-parallel-size", type=int, default=1)
    add("--expert-model-parallel-size", type=int, default=1)
    # the model: Megatron-LM's flags and defaults (sizes: configs/megatron_tiny.yaml)
    add("--num-layers", type=int, default=4)
    add("--decoder-num-layers", type=int, default=None)
    add("--encoder-num-layers", type=int, default=2)
    add("--hidden-size", type=int, default=64)
    add("--ffn-hidden-size", type=int, default=256)
    add("--num-attention-heads", type=int, default=4)
    add("--kv-channels", type=int, default=None)
    add("--group-query-attention", action="store_true")
    add("--num-query-groups", type=int, default=1)
    add("--seq-length", type=int, default=48)
    add("--dataloader-seq-length", type=int, default=None)
    add("--max-position-embeddings", type=int, default=None)
    add("--vocab-size", type=int, default=256)
    add(
        "--position-embedding-type",
        default="learned_absolute",
        choices=["learned_absolute", "rope", "yarn", "mrope", "relative", "none"],
    )
    add("--rotary-percent", type=float, default=1.0)
    add("--rotary-base", type=int, default=10000)
    add("--use-rope-scaling", action="store_true")
    add("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"])
    add("--norm-epsilon", type=float, default=1e-5)
    add("--apply-layernorm-1p", action="store_true")
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
    add("--transformer-impl", default="local", choices=["local", "transformer_engine"])
    add("--recompute-granularity", default=None, choices=["full", "selective"])
    add("--recompute-method", default=None, choices=["uniform", "block"])
    add("--recompute-num-layers", type=int, default=None)
    add("--fp8-format", dest="fp8", default=None, choices=["e4m3", "hybrid"])
    # the vision model (pretrain_vlm.py: a copy of the language model's layers)
    add("--img-h", type=int, default=16)
    add("--img-w", type=int, default=16)
    add("--patch-dim", type=int, default=4)
    add("--num-channels", type=int, default=3)
    add("--disable-vision-class-token", action="store_true")
    add("--freeze-LM", action="store_true")
    add("--freeze-ViT", action="store_true")
    add("--micro-batch-size", type=int, default=2)
    add("--global-batch-size", type=int, default=16)
    add("--train-iters", type=int, default=3)
    add("--lr", type=float, default=1e-4)
    # optimizer, clipping, LR schedule and loss scaling: Megatron-LM's flags and defaults
    add("--optimizer", choices=["adam", "sgd"], default="adam")
    add("--min-lr", type=float, default=0.0)
    add("--lr-decay-style", choices=["constant", "linear", "cosine"], default="linear")
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
    add("--timing-log-option", default="minmax", choices=["max", "minmax", "all"])
    add("--bf16", action="store_true")
    add("--fp16", action="store_true")
    add("--sequence-parallel", action="store_true")
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    return parser


def set_args(args: argparse.Namespace) -> None:
    global _ARGS
    _ARGS = args


def get_args() -> argparse.Namespace:
    """The job's parsed flags, as ``megatron.training.get_args`` returns them."""
    if _ARGS is None:
        raise RuntimeError("get_args() before pretrain() parsed the flags")
    return _ARGS


def add_optimus_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron's ``extra_args_provider``: the one flag Optimus needs."""
    group = parser.add_argument_group(title="optimus")
    group.add_argument(
        "--optimus-schedule",
        metavar="auto|PLAN_JSON",
        default=None,
        help="run the encoders in the LLM's pipeline bubbles: 'auto' plans and schedules the job "
        "at start-up, PLAN_JSON is a saved schedule (optimus-plan --artifact); left out, the job "
        "runs Megatron-style",
    )
    return parser
