"""One flag on an existing Megatron job: ``--optimus-schedule plan.json``.

A Megatron-LM pretrain script opts in with its own argument hook and one patch call::

    args = parse_args(extra_args_provider=add_optimus_args)  # adds --optimus-schedule
    megatron_patches.apply()                                # CPU shims; nothing to patch on a GPU
    config = config_from_megatron_args(args, world_size)
    mode, artifact = runtime_for_args(args, config)         # "optimus" with the flag, else "baseline"
    trainer = Trainer(config, plan(config).llm_plan, mode, artifact)

Without the flag the job runs as Megatron-LM runs a multimodal model (encoders in the first pipeline
stage); with it, the encoders get the artifact's own plan and their kernels run at the artifact's
hook points inside megatron-core's schedule. ``scripts/pretrain_vlm_megatron.py`` is such a script.
The artifact comes from ``optimus-plan --config MODEL.yaml --artifact plan.json`` for the same model
and plan; it is refused, with the reason, when it was made for another job.
"""

from __future__ import annotations

import argparse
from typing import Any

from optimus_mllm.config import OptimusConfig, config_from_dict
from optimus_mllm.errors import OptimusError
from optimus_mllm.planner import plan
from optimus_mllm.scheduler.artifact import load_job_artifact


def add_optimus_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron's ``extra_args_provider``: the one flag Optimus needs."""
    group = parser.add_argument_group(title="optimus")
    group.add_argument("--optimus-schedule", metavar="PLAN_JSON", default=None,
                       help="run the encoders with this Optimus schedule (optimus-plan --artifact); "
                            "left out, the job runs Megatron-style")
    return parser


# Megatron-LM's optimizer flags that the training config takes under the same names
_OPTIMIZER_ARGS = ("optimizer", "lr", "min_lr", "lr_decay_style", "lr_warmup_iters", "lr_decay_iters", "weight_decay",
                   "adam_beta1", "adam_beta2", "adam_eps", "sgd_momentum", "clip_grad", "loss_scale",
                   "initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis")


def config_from_megatron_args(args: argparse.Namespace, world_size: int, gpus_per_node: int = 8) -> OptimusConfig:
    """The Optimus config of a job described by Megatron-LM's argument names.

    LLM: ``num_layers``, ``hidden_size``, ``num_attention_heads``, ``ffn_hidden_size``, ``seq_length``,
    ``vocab_size``, ``untie_embeddings_and_output_weights``; vision: ``encoder_num_layers``, ``img_h``,
    ``img_w``, ``patch_dim``, ``num_channels`` and the encoder width flags ``encoder_hidden_size``,
    ``encoder_num_attention_heads``, ``encoder_ffn_hidden_size``; ``hidden_dropout`` and
    ``attention_dropout`` for both (Megatron-LM's ``pretrain_vlm.py`` copies the language model's
    config for the vision model); parallelism and training:
    ``tensor_model_parallel_size``, ``pipeline_model_parallel_size``,
    ``num_layers_per_virtual_pipeline_stage``, ``micro_batch_size``, ``global_batch_size``,
    ``train_iters``, ``seed``, ``bf16``/``fp16``, ``sequence_parallel``; optimizer: ``optimizer``, ``lr``,
    ``min_lr``, ``lr_decay_style``, ``lr_warmup_iters``, ``lr_decay_iters``, ``weight_decay``,
    ``adam_beta1``, ``adam_beta2``, ``adam_eps``, ``sgd_momentum``, ``clip_grad``, ``loss_scale``,
    ``initial_loss_scale``, ``min_loss_scale``, ``loss_scale_window``, ``hysteresis``,
    ``use_distributed_optimizer``."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if world_size % (tp * pp):
        raise OptimusError(f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp} does not "
                           f"divide the world size {world_size}; launch a multiple of {tp * pp} processes")
    per_chunk = args.num_layers_per_virtual_pipeline_stage
    vp = args.num_layers // (pp * per_chunk) if per_chunk else 1
    if args.img_h % args.patch_dim or args.img_w % args.patch_dim:
        raise OptimusError(f"--img-h {args.img_h} and --img-w {args.img_w} must be multiples of --patch-dim "
                           f"{args.patch_dim}")
    patches = (args.img_h // args.patch_dim) * (args.img_w // args.patch_dim)
    dropout = {"hidden_dropout": args.hidden_dropout, "attention_dropout": args.attention_dropout}
    raw: dict[str, Any] = {
        "name": "megatron-args",
        "cluster": {"num_gpus": world_size, "gpus_per_node": min(gpus_per_node, world_size)},
        "model": {
            "encoders": [{"name": "vit", "num_layers": args.encoder_num_layers,
                          "hidden_size": args.encoder_hidden_size,
                          "num_attention_heads": args.encoder_num_attention_heads,
                          "ffn_hidden_size": args.encoder_ffn_hidden_size, "seq_length": patches,
                          "patch_size": args.patch_dim, "in_channels": args.num_channels, **dropout}],
            "llm": {"num_layers": args.num_layers, "hidden_size": args.hidden_size,
                    "num_attention_heads": args.num_attention_heads, "ffn_hidden_size": args.ffn_hidden_size,
                    "seq_length": args.seq_length, "vocab_size": args.vocab_size,
                    "untie_embeddings_and_output_weights": args.untie_embeddings_and_output_weights, **dropout},
        },
        "training": {"global_batch_size": args.global_batch_size, "micro_batch_size": args.micro_batch_size,
                     "precision": "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32",
                     "sequence_parallel": args.sequence_parallel, "train_iters": args.train_iters,
                     "seed": args.seed, "distributed_optimizer": args.use_distributed_optimizer,
                     **{name: getattr(args, name) for name in _OPTIMIZER_ARGS}},
        "parallel": {"llm": {"dp": world_size // (tp * pp), "pp": pp, "tp": tp, "vp": vp}},
    }
    return config_from_dict(raw)


def runtime_for_args(args: argparse.Namespace, config: OptimusConfig) -> tuple[str, dict[str, Any] | None]:
    """("optimus", the checked artifact) with ``--optimus-schedule``; ("baseline", None) without it."""
    if args.optimus_schedule is None:
        return "baseline", None
    return "optimus", load_job_artifact(args.optimus_schedule, plan(config), config, config.cluster.num_gpus)
