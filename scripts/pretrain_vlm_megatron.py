"""A Megatron-style ViT + GPT pretraining script that opts in to Optimus with one flag.

    torchrun --nproc-per-node 4 scripts/pretrain_vlm_megatron.py [Megatron flags] [--optimus-schedule plan.json]

It is shaped like a Megatron-LM pretrain script: Megatron's argument names, ``parse_args`` with an
``extra_args_provider``, a training loop over megatron-core's pipeline schedule. The Optimus
opt-in is the three marked lines: the extra-args hook, the ``megatron_patches`` call, and choosing the
runtime from the flag. Without ``--optimus-schedule`` the encoder runs Megatron-style in the first
pipeline stage; with it, the encoder's kernels run in the LLM's bubbles as the schedule says. Make the
schedule for the same model with ``optimus-plan --config MODEL.yaml --artifact plan.json`` (the
defaults below, with ``--disable-vision-class-token``, are ``configs/megatron_tiny.yaml``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist

import megatron_patches
from optimus_mllm.cli.common import quiet_library_warnings
from optimus_mllm.errors import OptimusError
from optimus_mllm.megatron import add_optimus_args, config_from_megatron_args, runtime_for_args
from optimus_mllm.planner import ParallelPlan, plan


ExtraArgsProvider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]


def parse_args(extra_args_provider: ExtraArgsProvider | None = None,
               argv: list[str] | None = None) -> argparse.Namespace:
    """Megatron-LM's ``parse_args`` contract: its flags, plus whatever ``extra_args_provider`` adds."""
    return build_parser(extra_args_provider).parse_args(argv)


def build_parser(extra_args_provider: ExtraArgsProvider | None = None) -> argparse.ArgumentParser:
    """The script's flags: Megatron-LM's names and defaults."""
    parser = argparse.ArgumentParser(description="Megatron-style ViT + GPT pretraining", allow_abbrev=False)
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
    add("--position-embedding-type", default="learned_absolute",
        choices=["learned_absolute", "rope", "yarn", "mrope", "relative", "none"])
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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(extra_args_provider=add_optimus_args, argv=argv)  # Optimus: adds --optimus-schedule
    quiet_library_warnings(torch.cuda.is_available())
    try:  # the same decision on every rank, before any rank connects (one leaving mid-handshake breaks it)
        world_size = int(os.environ["WORLD_SIZE"])
        config = config_from_megatron_args(args, world_size, int(os.environ.get("LOCAL_WORLD_SIZE", 8)))
        mode, artifact = runtime_for_args(args, config)  # Optimus: the flag picks the runtime
    except OptimusError as exc:
        if os.environ.get("RANK", "0") == "0":
            print(f"pretrain_vlm_megatron.py: error: {exc}", file=sys.stderr)
        return 2
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    megatron_patches.apply()  # Optimus: megatron-core's CUDA assumptions patched for CPU (no-op on GPU)
    from megatron.core import parallel_state
    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
    from megatron.core.timers import Timers

    from optimus_mllm.runtime.trainer import Trainer

    timers = Timers(args.timing_log_level, args.timing_log_option)  # Megatron's; the runtime keeps them timing
    # pretrain_vlm.py's vision layer for --transformer-impl local; Optimus splits it into its kernels
    vision_layer_spec = get_vit_layer_with_local_spec()
    trainer = Trainer(config, plan(config).llm_plan, mode, artifact, timers=timers,
                      encoder_layer_specs={"vit": vision_layer_spec})
    reports_loss = (parallel_state.is_pipeline_last_stage(ignore_virtual=True)
                    and parallel_state.get_tensor_model_parallel_rank() == 0
                    and parallel_state.get_data_parallel_rank() == 0)
    label = "plain" if artifact is None else f"optimus, encoder plan {ParallelPlan(**artifact['encoder_plan'])}"
    for iteration in range(args.train_iters):
        result = trainer.train_step(iteration)
        if reports_loss:
            print(f"iteration {iteration + 1}/{args.train_iters} | lm loss {result.loss:.4f} | {label}", flush=True)
    # Megatron-LM's training_log: the schedule's timers, min/max over ranks, printed by the last rank
    report = timers.get_all_timers_string(["forward-compute", "backward-compute"], normalizer=args.train_iters)
    if dist.get_rank() == dist.get_world_size() - 1 and report:
        print(report, flush=True)
    trainer.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
