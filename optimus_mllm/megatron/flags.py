"""A Megatron-LM job's flags read as the Optimus config they describe, and what its
``--optimus-schedule`` runs.

``config_from_megatron_args`` makes the config from a namespace as Megatron-LM's ``validate_args``
leaves it, reading the model flags as ``pretrain_vlm.py`` reads them: each flag that shapes the
model is honoured (``HONOURED_FLAGS``) or refused in one line (``REFUSED_FLAGS``).
``flag_schedule`` is the schedule the flag's value names: a saved artifact, checked against the
job, or with ``auto`` the fastest made now. ``images_bound`` is the most images a microbatch
holds, where the job's flags state it, which the schedule is planned for. ``optimus-plan --
FLAGS``, the Megatron-LM seams (``optimus_mllm.megatron.seams``) and the look-alike loop
(``megatron.train_vlm``) read a job through here.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from optimus_mllm.config import OptimusConfig, config_from_dict
from optimus_mllm.costing.cost_model import CostModel, profile_device_problem
from optimus_mllm.costing.workload import max_images_per_microbatch
from optimus_mllm.errors import OptimusError
from optimus_mllm.megatron.arguments import (
    validate_args,
)
from optimus_mllm.planner import plan
from optimus_mllm.planner.planner import PlannerResult
from optimus_mllm.scheduler.artifact import (
    load_artifact,
    load_job_artifact,
    schedule_to_artifact,
)
from optimus_mllm.scheduler.artifact_format import ScheduleArtifact
from optimus_mllm.scheduler.baselines import runnable_megatron_lm_baseline
from optimus_mllm.scheduler.bubble_scheduler import best_schedule, optimus_gains

# Megatron-LM's optimizer flags that the training config takes under the same names
_OPTIMIZER_ARGS = (
    "optimizer",
    "lr",
    "min_lr",
    "lr_decay_style",
    "lr_warmup_iters",
    "lr_decay_iters",
    "weight_decay",
    "adam_beta1",
    "adam_beta2",
    "adam_eps",
    "sgd_momentum",
    "clip_grad",
    "loss_scale",
    "initial_loss_scale",
    "min_loss_scale",
    "loss_scale_window",
    "hysteresis",
)


@dataclass(frozen=True)
class RefusedFlag:
    """A Megatron-LM flag that changes the model in a way the Optimus runtime does not build: a
    value outside ``accepted`` (by default Megatron-LM's default alone) is refused, naming the flag
    and the fix."""

    flag: str
    dest: str
    default: Any  # Megatron-LM's, for a namespace without the flag
    why: str
    accepted: tuple[Any, ...] | None = None  # None: (default,)

    def allows(self, value: Any) -> bool:
        return value in (self.accepted if self.accepted is not None else (self.default,))


# Every Megatron-LM flag that shapes the model, and what the config makes of it. The vision model is
# a copy of the language model's TransformerConfig with --encoder-num-layers layers, as
# Megatron-LM's pretrain_vlm.py builds it, so the LLM's shape flags shape the ViT too.
HONOURED_FLAGS = {
    "--num-layers": (
        "the depth of the ViT, and of the LLM without --decoder-num-layers (Megatron-LM refuses it "
        "with --encoder-num-layers)"
    ),
    "--decoder-num-layers": "model.llm.num_layers (pretrain_vlm.py's LLM depth when given)",
    "--hidden-size": "model.llm.hidden_size and the ViT's",
    "--ffn-hidden-size": (
        "model.llm.ffn_hidden_size, the ViT's and the projector's (Megatron-LM's default: "
        "4 * hidden, with --swiglu int(8 * hidden / 3 / 64) * 64)"
    ),
    "--num-attention-heads": "model.llm.num_attention_heads and the ViT's",
    "--kv-channels": "kv_channels of both",
    "--group-query-attention": "num_query_groups of both (with --num-query-groups)",
    "--num-query-groups": "num_query_groups of both (with --group-query-attention)",
    "--swiglu": (
        "gated_linear_unit: true and activation: silu, of the LLM, the ViT and the projector's MLP"
    ),
    "--normalization": "normalization of both (LayerNorm, RMSNorm)",
    "--disable-bias-linear": "add_bias_linear: false, of the LLM, the ViT and the projector",
    "--add-qkv-bias": "no change while linear layers have biases (they include QKV's)",
    "--position-embedding-type": "model.llm.position_embedding_type (learned_absolute, rope, none)",
    "--untie-embeddings-and-output-weights": "model.llm.untie_embeddings_and_output_weights",
    "--hidden-dropout": "hidden_dropout of both",
    "--attention-dropout": "attention_dropout of both",
    "--vocab-size": "model.llm.vocab_size",
    "--seq-length": (
        "the text tokens; model.llm.seq_length adds the image tokens, as pretrain_vlm.py does"
    ),
    "--dataloader-seq-length": "the text tokens when given (else --seq-length)",
    "--encoder-num-layers": "the ViT's num_layers, and the LLM's without the two flags above",
    "--img-h": "the ViT's seq_length: (img_h / patch_dim) * (img_w / patch_dim) patch tokens",
    "--img-w": "the ViT's seq_length",
    "--patch-dim": "the ViT's patch_size",
    "--freeze-ViT": "the ViT's frozen: true (its projector still trains)",
    "--disable-vision-class-token": (
        "the ViT's drop_class_token: true (CLIP's class token, always built, is dropped before "
        "the projector; kept, it is one more image token)"
    ),
    "--recompute-granularity": (
        "training.recompute (full: every layer, uniform, 1 layer per checkpoint)"
    ),
}

REFUSED_FLAGS = (
    RefusedFlag(
        "--position-embedding-type",
        "position_embedding_type",
        "learned_absolute",
        "is not one the runtime builds; use learned_absolute, rope or none",
        ("learned_absolute", "rope", "none"),
    ),
    RefusedFlag(
        "--rotary-percent",
        "rotary_percent",
        1.0,
        "partial rotary embeddings are not built; use 1.0",
    ),
    RefusedFlag("--rotary-base", "rotary_base", 10000, "the runtime's rotary base is 10000"),
    RefusedFlag(
        "--use-rope-scaling", "use_rope_scaling", False, "RoPE scaling is not built; leave it out"
    ),
    RefusedFlag("--norm-epsilon", "layernorm_epsilon", 1e-5, "the runtime's norms use 1e-5"),
    RefusedFlag(
        "--apply-layernorm-1p",
        "layernorm_zero_centered_gamma",
        False,
        "zero-centred norms are not built; leave it out",
    ),
    RefusedFlag("--qk-layernorm", "qk_layernorm", False, "QK layernorm is not built; leave it out"),
    RefusedFlag("--squared-relu", "squared_relu", False, "the MLP is GELU or SwiGLU (--swiglu)"),
    RefusedFlag("--openai-gelu", "openai_gelu", False, "the MLP is GELU or SwiGLU (--swiglu)"),
    RefusedFlag("--quick-geglu", "quick_geglu", False, "the MLP is GELU or SwiGLU (--swiglu)"),
    RefusedFlag(
        "--num-experts",
        "num_experts",
        None,
        "mixture-of-experts layers are not built; leave it out",
    ),
    RefusedFlag(
        "--multi-latent-attention",
        "multi_latent_attention",
        False,
        "multi-latent attention is not built",
    ),
    RefusedFlag(
        "--init-method-std",
        "init_method_std",
        0.02,
        "weights are drawn plan-independently with std 0.02 (optimus_mllm/runtime/weights.py)",
    ),
    RefusedFlag(
        "--apply-query-key-layer-scaling",
        "apply_query_key_layer_scaling",
        False,
        "attention scores are scaled by 1/sqrt(head dim) only",
    ),
    RefusedFlag(
        "--transformer-impl",
        "transformer_impl",
        "transformer_engine",
        "the runtime runs megatron-core's local layer spec; pass --transformer-impl local",
        ("local",),
    ),
    RefusedFlag(
        "--decoder-first-pipeline-num-layers",
        "decoder_first_pipeline_num_layers",
        None,
        "uneven pipeline stages are not planned; leave it out",
    ),
    RefusedFlag(
        "--decoder-last-pipeline-num-layers",
        "decoder_last_pipeline_num_layers",
        None,
        "uneven pipeline stages are not planned; leave it out",
    ),
    RefusedFlag(
        "--pipeline-model-parallel-layout",
        "pipeline_model_parallel_layout",
        None,
        "custom pipeline layouts are not planned; give the model chunks with "
        "--num-layers-per-virtual-pipeline-stage or --num-virtual-stages-per-pipeline-rank",
    ),
    RefusedFlag(
        "--account-for-embedding-in-pipeline-split",
        "account_for_embedding_in_pipeline_split",
        False,
        "the planner splits the transformer layers alone over the stages; leave it out",
    ),
    RefusedFlag(
        "--account-for-loss-in-pipeline-split",
        "account_for_loss_in_pipeline_split",
        False,
        "the planner splits the transformer layers alone over the stages; leave it out",
    ),
    RefusedFlag(
        "--context-parallel-size", "context_parallel_size", 1, "context parallelism is not planned"
    ),
    RefusedFlag(
        "--expert-model-parallel-size", "expert_model_parallel_size", 1, "there are no experts"
    ),
    RefusedFlag("--freeze-LM", "freeze_LM", False, "a frozen LLM is not planned; leave it out"),
    RefusedFlag(
        "--recompute-method",
        "recompute_method",
        None,
        "full recompute is uniform, one layer per checkpoint",
        (None, "uniform"),
    ),
    RefusedFlag(
        "--recompute-num-layers",
        "recompute_num_layers",
        None,
        "full recompute checkpoints one layer at a time",
        (None, 1),
    ),
    RefusedFlag("--fp8-format", "fp8", None, "fp8 training is not built; use --bf16 or --fp16"),
    RefusedFlag(
        "--num-channels", "num_channels", 3, "megatron-core's CLIPViTModel takes 3-channel images"
    ),
)


def config_from_megatron_args(
    args: argparse.Namespace, world_size: int, gpus_per_node: int = 8
) -> OptimusConfig:
    """The Optimus config of a job described by Megatron-LM's arguments.

    ``args`` is a namespace as Megatron-LM's ``validate_args`` leaves it (Megatron-LM's own, or
    ``optimus_mllm.megatron.arguments.validate_args``); one straight from ``parse_args`` (without
    ``virtual_pipeline_model_parallel_size``) is validated here first, on a copy. The model flags
    are read as Megatron-LM's ``pretrain_vlm.py`` reads them: the LLM from the language flags with
    ``--decoder-num-layers`` layers when given (else ``--num-layers``), the vision model a copy of
    the LLM's layers with ``--encoder-num-layers`` layers (``--num-layers`` when only that is
    given), images of ``--img-h`` x ``--img-w`` in ``--patch-dim`` patches, and the LLM's sequence
    the text tokens plus the image tokens. ``HONOURED_FLAGS`` lists what each flag sets; a flag of
    ``REFUSED_FLAGS`` with a value the runtime does not build is an ``OptimusError`` naming it. A
    flag the namespace lacks takes Megatron-LM's default. Parallelism and training:
    ``tensor_model_parallel_size``, ``pipeline_model_parallel_size``,
    ``virtual_pipeline_model_parallel_size``, ``micro_batch_size``, ``global_batch_size``,
    ``train_iters``, ``seed``, ``bf16``/``fp16``, ``sequence_parallel``,
    ``use_distributed_optimizer`` and the optimizer flags of ``_OPTIMIZER_ARGS``. Data:
    ``data.max_images_per_microbatch`` where examples/multimodal's flags bound it
    (``images_bound``). Pricing: ``cost_model.profile`` from ``--optimus-profile``.

    Args:
        args: Megatron-LM's arguments, validated or straight from ``parse_args``.
        world_size: the job's number of ranks.
        gpus_per_node: ranks per node (at most ``world_size``).

    Returns:
        The validated config.
    """
    for refused in REFUSED_FLAGS:
        value = getattr(args, refused.dest, refused.default)
        if not refused.allows(value):
            raise OptimusError(f"{refused.flag} {_shown(value)}: {refused.why}")
    if not hasattr(args, "virtual_pipeline_model_parallel_size"):  # as parse_args returns it
        args = validate_args(copy.copy(args), world_size)
    vocab_size = _vocab_size(args)
    for flag, why in _REQUIRED.items():  # Megatron-LM has no default for these
        if flag == "--vocab-size" and vocab_size is not None:
            continue
        if getattr(args, flag.removeprefix("--").replace("-", "_")) is None:
            raise OptimusError(f"{flag} is missing: {why}")
    for flag in _DIVISORS:  # the arithmetic below divides by these
        value = getattr(args, flag.removeprefix("--").replace("-", "_"))
        if value < 1:
            raise OptimusError(f"{flag} {value}: must be a positive integer")
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if world_size % (tp * pp):
        raise OptimusError(
            f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp} does not "
            f"divide the world size {world_size}; launch a multiple of {tp * pp} processes"
        )
    vp = args.virtual_pipeline_model_parallel_size or 1
    if args.img_h % args.patch_dim or args.img_w % args.patch_dim:
        raise OptimusError(
            f"--img-h {args.img_h} and --img-w {args.img_w} must be multiples of --patch-dim "
            f"{args.patch_dim}"
        )
    llm_layers = args.decoder_num_layers if args.decoder_num_layers is not None else args.num_layers
    patch_tokens = (args.img_h // args.patch_dim) * (args.img_w // args.patch_dim)
    # pretrain_vlm.py's CLIP always has one class token; the LLM gets it unless dropped
    drop_class_token = getattr(args, "disable_vision_class_token", False)
    image_tokens = patch_tokens + (0 if drop_class_token else 1)
    text_tokens = getattr(args, "dataloader_seq_length", None) or args.seq_length
    layers = _layer_shape(args)
    raw: dict[str, Any] = {
        "name": "megatron-args",
        "cluster": {"num_gpus": world_size, "gpus_per_node": min(gpus_per_node, world_size)},
        "model": {
            # pretrain_vlm.py's vision model: CLIPViTModel with vision_model_type "clip"
            "encoders": [
                {
                    "name": "vit",
                    **layers,
                    "num_layers": args.encoder_num_layers,
                    "seq_length": patch_tokens,
                    "patch_size": args.patch_dim,
                    "in_channels": 3,
                    "frozen": getattr(args, "freeze_ViT", False),
                    "model_subtype": "clip",
                    "class_token": True,
                    "drop_class_token": drop_class_token,
                    # pretrain_vlm.py's projector: the LLM's MLP (a copy of its config)
                    "projector": {
                        "ffn_hidden_size": layers["ffn_hidden_size"],
                        "activation": layers["activation"],
                        "gated_linear_unit": layers["gated_linear_unit"],
                        "add_bias_linear": layers["add_bias_linear"],
                    },
                }
            ],
            "llm": {
                **layers,
                "num_layers": llm_layers,
                "seq_length": text_tokens + image_tokens,
                "vocab_size": vocab_size,
                "position_embedding_type": getattr(
                    args, "position_embedding_type", "learned_absolute"
                ),
                "untie_embeddings_and_output_weights": args.untie_embeddings_and_output_weights,
            },
        },
        "training": {
            "global_batch_size": args.global_batch_size,
            "micro_batch_size": args.micro_batch_size,
            "precision": "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32",
            "sequence_parallel": args.sequence_parallel,
            "train_iters": args.train_iters,
            "seed": args.seed,
            "distributed_optimizer": args.use_distributed_optimizer,
            "recompute": getattr(args, "recompute_granularity", None) or "none",
            **{name: getattr(args, name) for name in _OPTIMIZER_ARGS},
        },
        "parallel": {"llm": {"dp": world_size // (tp * pp), "pp": pp, "tp": tp, "vp": vp}},
    }
    bound = images_bound(args)
    if bound.images is not None:
        raw["data"] = {"max_images_per_microbatch": bound.images}
    if getattr(args, "optimus_profile", None):
        raw["cost_model"] = {"profile": args.optimus_profile}
    try:
        return config_from_dict(raw)
    except OptimusError as exc:  # name the flag the user gave, not the config field it became
        field = str(exc).split(":", 1)[0]
        flag = _FIELD_FLAGS.get(field.replace("encoders[0]", "encoders"))
        if flag is None:
            raise
        raise OptimusError(f"{flag}: {exc}") from None


@dataclass(frozen=True)
class ImagesBound:
    """The most images a microbatch can hold, as the job states it (``images_bound``), and where
    that comes from, in words for the start-up line and the refusal of a bigger microbatch."""

    images: int | None  # None: the job states no bound
    source: str


# where a job without a stated bound could state one
_NO_BOUND = (
    "the job states no bound: examples/multimodal's --max-num-tiles / --use-thumbnail / "
    "--num-frames, or a plan file made by optimus-plan for a config with "
    "data.max_images_per_microbatch"
)


def images_bound(args: argparse.Namespace) -> ImagesBound:
    """The most images (tiles, frames) a microbatch holds, from the flags that state it.

    Megatron-LM's ``examples/multimodal`` (its ``multimodal_args.py`` adds the flags) cuts an image
    into at most ``--max-num-tiles`` tiles under ``--use-tiling``, plus a thumbnail tile under
    ``--use-thumbnail`` where it cut more than one, and a video into ``--num-frames`` frames of
    one tile each; the vision model runs every tile as one image. So a sample of one image or one
    video holds at most the larger of the two, and a microbatch ``--micro-batch-size`` times that.
    Samples with several images, and sequences packed from several samples
    (``--packing-seq-length``), are bounded by no flag; nor is ``pretrain_vlm.py``'s data, one
    image a sample, which the default plan (one image a sample) covers.
    """
    mbs = args.micro_batch_size
    if not hasattr(args, "max_num_tiles"):
        return ImagesBound(None, _NO_BOUND)
    if getattr(args, "packing_seq_length", 0):
        return ImagesBound(
            None,
            f"--packing-seq-length {args.packing_seq_length} packs any number of samples into a "
            f"sequence, so {_NO_BOUND}",
        )
    tiles, said = 1, "one tile an image (no --use-tiling)"
    if getattr(args, "use_tiling", False):
        thumbnail = getattr(args, "use_thumbnail", False) and args.max_num_tiles > 1
        tiles = args.max_num_tiles + thumbnail
        said = f"--max-num-tiles {args.max_num_tiles}" + (
            " + a --use-thumbnail tile" if thumbnail else ""
        )
    frames = getattr(args, "num_frames", 1)
    per_sample = max(tiles, frames)
    return ImagesBound(
        mbs * per_sample,
        f"--micro-batch-size {mbs} x {per_sample} a sample: {said}, --num-frames {frames}",
    )


def optimus_profile_problem(
    schedule: str | None, profile: str | None, device_kind: str
) -> str | None:
    """Why ``--optimus-profile profile`` cannot price the job of ``--optimus-schedule schedule``
    on ``device_kind`` (``cuda`` or ``cpu``), in one line; None where it can or is not given.
    Decided from the command line and the file alone, so alike on every rank before any
    connects."""
    if profile is None:
        return None
    if schedule is None:
        return (
            f"--optimus-profile {profile}: prices what --optimus-schedule runs; add "
            "--optimus-schedule auto, or drop --optimus-profile"
        )
    try:
        return profile_device_problem(profile, device_kind, "--optimus-profile")
    except OptimusError as error:  # a file that is not a profile of this release
        return str(error)


def with_schedule_bound(config: OptimusConfig, schedule: str) -> OptimusConfig:
    """``config`` with the planned maximum of the saved schedule ``schedule`` (a path; ``auto``
    leaves it as it is) where the job's flags state none: ``optimus-plan --config`` made it for a
    config with ``data.max_images_per_microbatch``. A job whose flags state another bound keeps
    its own, and ``load_job_artifact`` refuses the artifact naming the field."""
    if schedule == "auto" or config.data.max_images_per_microbatch is not None:
        return config
    planned = load_artifact(schedule).fingerprint.get("data.max_images_per_microbatch")
    if planned is None:
        return config
    data = dataclasses.replace(config.data, max_images_per_microbatch=int(planned))
    return dataclasses.replace(config, data=data)


def bound_source(config: OptimusConfig, bound: ImagesBound) -> str:
    """Where the planned maximum of ``config`` (``bound``'s, or its saved schedule's, or one
    image a sample) comes from, in words."""
    if config.data.max_images_per_microbatch is None:
        return f"one image a sample, --micro-batch-size {config.training.micro_batch_size}: " + (
            bound.source
        )
    if bound.images is None:
        return "the saved schedule's data.max_images_per_microbatch"
    return bound.source


def bound_line(config: OptimusConfig, bound: ImagesBound) -> str:
    """The start-up line that says which image counts the flag follows, and why that maximum."""
    most = max_images_per_microbatch(config)
    return (
        f"optimus: planned for at most {most} images a microbatch ({bound_source(config, bound)})"
        f"; a microbatch of 0 to {most} images trains, one of more is refused before its step"
    )


# what the config needs that Megatron-LM's validate_args leaves unset
_REQUIRED = {
    "--vocab-size": "the LLM's vocabulary size",
    "--train-iters": "the number of iterations (the planner does not read --train-samples)",
    "--lr": "the learning rate (Megatron-LM has no default)",
}
# flags the arithmetic divides by, which Megatron-LM's validate_args does not check
_DIVISORS = ("--patch-dim", "--img-h", "--img-w")
# config fields -> the Megatron-LM flag they come from, for errors
_FIELD_FLAGS = {
    "model.llm.num_layers": "--decoder-num-layers / --num-layers",
    "model.encoders.num_layers": "--encoder-num-layers / --num-layers",
    **{
        f"model.{part}.{field}": flag
        for part in ("llm", "encoders")
        for field, flag in (
            ("hidden_size", "--hidden-size"),
            ("num_attention_heads", "--num-attention-heads"),
            ("ffn_hidden_size", "--ffn-hidden-size"),
            ("kv_channels", "--kv-channels"),
            ("num_query_groups", "--num-query-groups"),
            ("hidden_dropout", "--hidden-dropout"),
            ("attention_dropout", "--attention-dropout"),
        )
    },
    "model.llm.seq_length": (
        "--seq-length / --dataloader-seq-length (text tokens) plus the image tokens"
    ),
    "model.llm.vocab_size": "--vocab-size",
    "model.encoders.seq_length": "--img-h / --img-w / --patch-dim (the patch tokens)",
    "parallel.llm.vp": (
        "--num-layers-per-virtual-pipeline-stage / --num-virtual-stages-per-pipeline-rank"
    ),
    "training.global_batch_size": "--global-batch-size",
    "training.micro_batch_size": "--micro-batch-size",
    "training.train_iters": "--train-iters",
    "training.seed": "--seed",
    **{f"training.{name}": "--" + name.replace("_", "-") for name in _OPTIMIZER_ARGS},
}


def _vocab_size(args: argparse.Namespace) -> int | None:
    """``--vocab-size``, else the vocabulary Megatron-LM took from the job's tokenizer.

    A tokenizer that holds its vocabulary (examples/multimodal's ``MultimodalTokenizer``, a
    ``HuggingFaceTokenizer``) needs no ``--vocab-size``: once ``initialize_megatron`` has built it,
    ``args.padded_vocab_size`` is the LLM's embedding size. A command line alone (``optimus-plan
    -- FLAGS``) has neither, and ``--vocab-size`` is required."""
    if args.vocab_size is not None:
        return args.vocab_size
    return getattr(args, "padded_vocab_size", None)


def _layer_shape(args: argparse.Namespace) -> dict[str, Any]:
    """The transformer layer fields the LLM and the ViT share (``ffn_hidden_size`` and
    ``kv_channels`` as validate_args derives them)."""
    hidden, swiglu = args.hidden_size, getattr(args, "swiglu", False)
    # validate_args fills in hidden / heads; the config's None is the same head width
    kv_channels, heads = args.kv_channels, args.num_attention_heads
    if hidden % heads == 0 and kv_channels == hidden // heads:
        kv_channels = None
    add_bias_linear = getattr(args, "add_bias_linear", True)
    if getattr(args, "add_qkv_bias", False) and not add_bias_linear:
        raise OptimusError(
            "--add-qkv-bias with --disable-bias-linear: the runtime's layers have biases on every "
            "linear layer or on none; drop one of the two flags"
        )
    return {
        "hidden_size": hidden,
        "num_attention_heads": args.num_attention_heads,
        "ffn_hidden_size": args.ffn_hidden_size,
        "kv_channels": kv_channels,
        "num_query_groups": args.num_query_groups
        if getattr(args, "group_query_attention", False)
        else None,
        "gated_linear_unit": swiglu,
        "activation": "silu" if swiglu else "gelu",
        "add_bias_linear": add_bias_linear,
        "normalization": getattr(args, "normalization", "LayerNorm"),
        "hidden_dropout": getattr(args, "hidden_dropout", 0.1),
        "attention_dropout": getattr(args, "attention_dropout", 0.1),
    }


def _shown(value: Any) -> str:
    return (
        {True: "(set)", False: "(not set)"}.get(value, str(value))
        if isinstance(value, bool)
        else str(value)
    )


def schedule_for_flag(value: str) -> Callable[[OptimusConfig], ScheduleArtifact | None]:
    """``--optimus-schedule value`` for a job whose config is read off its built model: config ->
    what ``flag_schedule`` runs for it (the project's trainer calls it once the model is read, as
    Megatron-LM's seams call ``flag_schedule``)."""
    return lambda config: flag_schedule(value, config, plan(config))[0]


def flag_schedule(
    value: str, config: OptimusConfig, planned: PlannerResult
) -> tuple[ScheduleArtifact | None, str]:
    """What ``--optimus-schedule value`` runs, and the line that says so: a saved artifact, checked
    against the job; with ``auto``, the fastest Optimus schedule made now, or None where
    Megatron-LM's own placement (the vision model in the first pipeline stage) is predicted
    faster. The same on every rank: it is computed from the arguments alone."""
    if value != "auto":
        artifact = load_job_artifact(value, planned, config, config.cluster.num_gpus)
        source = f"the schedule {value}"
    else:
        cost = CostModel.from_config(config)
        best = best_schedule(config, planned, cost).best
        megatron = runnable_megatron_lm_baseline(config, planned.llm_plan, cost)
        if best is None or (
            megatron is not None
            and not optimus_gains(best.iteration_us, megatron.iteration_us, cost.step_noise)
        ):
            optimus_s = "none" if best is None else f"{best.iteration_us / 1e6:.4f} s"
            megatron_s = "" if megatron is None else f", {megatron.iteration_us / 1e6:.4f} s"
            return None, (
                "optimus: --optimus-schedule auto: Megatron-LM's placement (the vision model in "
                f"the first pipeline stage{megatron_s} per iteration predicted) is no slower than "
                f"every Optimus schedule (best {optimus_s}) within the step noise of "
                f"{cost.step_noise:.1%}; training as Megatron-LM does"
            )
        artifact = schedule_to_artifact(best, config)
        source = "--optimus-schedule auto"
    return artifact, (
        f"optimus: {source}: encoder plan {artifact.encoder_plan}, warm-up "
        f"{list(artifact.warmup)}, {artifact.predicted.iteration_us / 1e6:.4f} s per iteration "
        "predicted"
    )
