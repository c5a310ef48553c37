"""The Optimus encoder stage computes the vision path of Megatron-LM's ``pretrain_vlm.py``.

The reference is megatron-core's own modules built as ``pretrain_vlm.py`` (core_v0.16.1) builds
them: ``CLIPViTModel`` (``clip``, with its class token, ``ln_pre``) over a copy of the language
model's ``TransformerConfig``, LLaVA's drop of the class token under ``drop_vision_class_token``,
and ``MultimodalProjector`` of type ``mlp`` whose config is a copy of the language model's (its ffn
width, GELU or SwiGLU, biases) and whose submodules are the language layer spec's MLP. The
``EncoderStage`` takes the reference's weights through ``copy_sharded_state`` (LLaVA's checkpoint
keys), runs as kernel steps, and its output and every weight gradient (compared under the same
keys) must match, at TP 1 and TP 2 (with and without sequence parallelism)."""

from __future__ import annotations

from copy import deepcopy
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.multimodal.llava_model import LLaVAModel
from megatron.core.models.multimodal.llava_spec import decoder_model_with_local_default_spec
from megatron.core.models.vision.clip_vit_model import CLIPViTModel
from megatron.core.models.vision.multimodal_projector import MultimodalProjector
from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.torch_norm import WrappedTorchNorm

import megatron_patches
from optimus_mllm.config import ProjectorConfig, config_from_dict
from optimus_mllm.runtime.data import patchify
from optimus_mllm.runtime.encoder_ops import MicrobatchRun, build_stage_ops
from optimus_mllm.runtime.layer_ops import vision_transformer_config
from optimus_mllm.runtime.llm import unfused_settings
from optimus_mllm.runtime.sharded_state import (
    copy_sharded_state,
    encoder_sharded_state_dict,
    global_shapes,
    whole_tensors,
)
from optimus_mllm.runtime.user_model import (
    config_problem,
    describe_projector,
    projector_problem,
    user_vision_layer_spec,
)
from optimus_mllm.runtime.vit import EncoderStage

from support.distributed_utils import run_distributed
from support.paths import MEGATRON_TINY_FLAGS

pytestmark = pytest.mark.distributed

HIDDEN, HEADS, FFN, LAYERS = 32, 4, 48, 2
IMG, PATCH, BATCH = 6, 2, 2  # 9 patches, 10 tokens with the class token: TP 2 splits them
PATCHES = (IMG // PATCH) ** 2
TOL = 1e-5
CASES = {
    f"{projector}{'-drop' if drop else ''}": (projector == "swiglu", drop)
    for projector in ("gelu", "swiglu")
    for drop in (False, True)
}
# projectors a user builds other than pretrain_vlm.py's: megatron-core's MultimodalProjector
# (type, activation, bias), and the ProjectorConfig that describes it
PROJECTORS = {
    "relu": (("mlp", F.relu, True), {"ffn_hidden_size": FFN, "activation": "relu"}),
    "relu-nobias": (
        ("mlp", F.relu, False),
        {"ffn_hidden_size": FFN, "activation": "relu", "add_bias_linear": False},
    ),
    "gelu-nobias": (("mlp", F.gelu, False), {"ffn_hidden_size": FFN, "add_bias_linear": False}),
    "affine": (("affine", F.gelu, True), {"type": "affine"}),
    "affine-nobias": (("affine", F.gelu, False), {"type": "affine", "add_bias_linear": False}),
}


def _language_config(tp: int, swiglu: bool) -> TransformerConfig:
    """Megatron-LM's ``core_transformer_config_from_args`` for a tiny LLM on the CPU (``--swiglu``
    also drops the biases here, ``--disable-bias-linear``, to cover both)."""
    return TransformerConfig(
        num_layers=4,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        ffn_hidden_size=FFN,
        gated_linear_unit=swiglu,
        activation_func=F.silu if swiglu else F.gelu,
        add_bias_linear=not swiglu,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        layernorm_epsilon=1e-5,
        init_method_std=0.2,  # activations and gradients of order 1, so that errors show
        tensor_model_parallel_size=tp,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
        **unfused_settings(),
    )


def _pretrain_vlm_vision(
    tp: int, swiglu: bool, projector: tuple[str, Any, bool] = ("mlp", None, None)
) -> tuple[CLIPViTModel, MultimodalProjector]:
    """``pretrain_vlm.py``'s ``model_provider``, the vision half: the configs copied from the
    language model's, CLIP with one class token, the projector of the language spec's MLP;
    ``projector``: its type, and an activation and bias of its own (None: the language model's)."""
    kind, activation, bias = projector
    language = _language_config(tp, swiglu)
    vision = deepcopy(language)
    vision.num_layers = LAYERS
    vision.pipeline_model_parallel_size = 1
    projection = deepcopy(language)
    projection.pipeline_model_parallel_size = 1
    if activation is not None:
        projection.activation_func, projection.add_bias_linear = activation, bias
    clip = CLIPViTModel(
        vision,
        get_vit_layer_with_local_spec(),
        ln_pre_impl=WrappedTorchNorm,  # CLIPViTModel's default needs TE or a torch norm's args
        add_class_token=True,
        class_token_len=1,
        patch_dim=PATCH,
        img_h=IMG,
        img_w=IMG,
        model_subtype="clip",
    )
    projector = MultimodalProjector(
        projection,
        deepcopy(decoder_model_with_local_default_spec().submodules.mlp.submodules),
        kind,
        vision.hidden_size,
    )
    with torch.no_grad():  # nonzero biases and norm weights, the same on every rank
        for name, p in [*clip.named_parameters(), *projector.named_parameters()]:
            if p.dim() == 1:
                p.add_(
                    0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name)))
                )
    return clip, projector


def _optimus_config(
    swiglu: bool, drop: bool, sequence_parallel: bool, projector: dict[str, Any] | None = None
) -> Any:
    """The job's config as ``optimus_mllm.megatron`` makes it from pretrain_vlm.py's flags;
    ``projector``: the projector's fields in place of pretrain_vlm.py's."""
    layer = {
        "hidden_size": HIDDEN,
        "num_attention_heads": HEADS,
        "ffn_hidden_size": FFN,
        "gated_linear_unit": swiglu,
        "activation": "silu" if swiglu else "gelu",
        "add_bias_linear": not swiglu,
    }
    return config_from_dict(
        {
            "name": "pretrain-vlm-vision",
            "cluster": {"num_gpus": 2, "gpus_per_node": 2},
            "model": {
                "encoders": [
                    {
                        "name": "vit",
                        **layer,
                        "num_layers": LAYERS,
                        "seq_length": PATCHES,
                        "patch_size": PATCH,
                        "model_subtype": "clip",
                        "class_token": True,
                        "drop_class_token": drop,
                        "projector": projector
                        or {
                            "ffn_hidden_size": FFN,
                            "activation": layer["activation"],
                            "gated_linear_unit": swiglu,
                            "add_bias_linear": not swiglu,
                        },
                    }
                ],
                "llm": {**layer, "num_layers": 4, "seq_length": 64, "vocab_size": 64},
            },
            "training": {
                "global_batch_size": 4,
                "micro_batch_size": BATCH,
                "precision": "fp32",
                "sequence_parallel": sequence_parallel,
            },
        }
    )


def _gradients_as_weights(modules: list[torch.nn.Module]) -> None:
    """Each parameter takes its gradient's values, so that the modules' own sharded state dicts
    give the gradients under their checkpoint keys (megatron-core's SwiGLU factory chunks the
    parameter itself)."""
    with torch.no_grad():
        for module in modules:
            for p in module.parameters():
                p.copy_(p.grad if p.grad is not None else torch.zeros_like(p))


def _whole(state: dict) -> dict[str, torch.Tensor]:
    return whole_tensors(state, global_shapes(state), "test")


def _compare(
    group: dist.ProcessGroup, dp_group: dist.ProcessGroup, case: str, sequence_parallel: bool
) -> dict[str, float]:
    """Largest relative differences, Optimus stage vs pretrain_vlm.py's modules (with one of
    ``PROJECTORS`` where ``case`` names it, the class token dropped), of the projected image tokens
    and of every weight gradient (by LLaVA's key)."""
    built, described = PROJECTORS.get(case, (("mlp", None, None), None))
    swiglu, drop = CASES.get(case, (False, True))
    config = _optimus_config(swiglu, drop, sequence_parallel, described)
    torch.manual_seed(0)  # megatron-core's CPU init draws whole matrices: every rank agrees
    clip, projector = _pretrain_vlm_vision(group.size(), swiglu, built)
    expected_layers = vision_transformer_config(config.encoders[0], 1, torch.float32, 0.02)
    assert config_problem("vision model", "encoder", expected_layers, clip.config) is None
    assert projector_problem(config.encoders[0], projector, HIDDEN) is None

    stage = EncoderStage(config, 0, 1, group, layer_specs={"vit": user_vision_layer_spec(clip)})
    copy_sharded_state(
        {
            **clip.sharded_state_dict("vision_model."),
            **projector.sharded_state_dict("vision_projection."),
        },
        encoder_sharded_state_dict(config, stage, dp_group),
        "pretrain_vlm.py's vision model -> the Optimus encoder",
    )

    gen = torch.Generator().manual_seed(2)
    images = torch.randn(BATCH, 3, IMG, IMG, generator=gen)
    tokens = config.encoders[0].image_tokens
    assert tokens == PATCHES + (0 if drop else 1)
    grad = torch.randn(tokens, BATCH, HIDDEN, generator=gen)

    embeddings = clip(images)  # [b, class token + patches, h]
    if drop:  # LLaVAModel.forward under drop_vision_class_token
        embeddings = embeddings[:, clip.class_token_len :, :]
    out = projector(embeddings.permute(1, 0, 2).contiguous())
    out.backward(grad)

    ops = build_stage_ops(stage.blocks())
    run = MicrobatchRun(ops, {"vit": patchify(images, PATCH)}, seed=0)
    for k in range(len(ops.fwd)):
        run.run_forward(k)
    run.set_output_grad({"vit": grad})
    for k in range(len(ops.bwd)):
        run.run_backward(k)
    stage.reduce_sequence_parallel_grads()

    errors = {"output": _relative(run.output["vit"], out.detach())}
    _gradients_as_weights([clip, projector])
    _gradients_as_weights([stage])
    theirs = _whole(
        {
            **clip.sharded_state_dict("vision_model."),
            **projector.sharded_state_dict("vision_projection."),
        }
    )
    ours = _whole(encoder_sharded_state_dict(config, stage, dp_group))
    assert theirs.keys() == ours.keys(), sorted(theirs.keys() ^ ours.keys())
    assert "vision_model.class_token" in ours
    errors |= {f"grad {key}": _relative(ours[key], value) for key, value in theirs.items()}
    return errors


def _relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    scale = expected.abs().max().item()
    assert scale > 0, "a reference tensor is all zeros"
    return (got - expected).abs().max().item() / scale


def _rank(sequence_parallel: bool, cases: Any = CASES) -> dict[str, dict[str, float]]:
    with megatron_patches.patched():
        tp = dist.get_world_size()
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        group = parallel_state.get_tensor_model_parallel_group()
        # the encoder's data-parallel group: each rank alone
        singles = [dist.new_group([r]) for r in range(tp)]
        try:
            return {
                case: _compare(group, singles[dist.get_rank()], case, sequence_parallel)
                for case in cases
            }
        finally:
            parallel_state.destroy_model_parallel()


@pytest.mark.parametrize(
    "tp, sequence_parallel", [(1, False), (2, False), (2, True)], ids=["tp1", "tp2", "tp2-sp"]
)
def test_the_encoder_stage_is_pretrain_vlms_clip_drop_and_projector(
    tp: int, sequence_parallel: bool
) -> None:
    """GELU and SwiGLU projectors, the class token kept and dropped: the same projected tokens and
    gradients as megatron-core's modules, every weight (the class token's included) compared."""
    for rank, errors in enumerate(run_distributed(_rank, tp, sequence_parallel, timeout=300.0)):
        assert set(errors) == set(CASES)
        for case, errs in errors.items():
            assert len(errs) > 10 and max(errs.values()) <= TOL, (rank, case, errs)


@pytest.mark.parametrize(
    "tp, sequence_parallel", [(1, False), (2, False), (2, True)], ids=["tp1", "tp2", "tp2-sp"]
)
def test_the_encoder_stage_runs_megatron_cores_projectors_as_built(
    tp: int, sequence_parallel: bool
) -> None:
    """ReLU and GELU MLPs and the affine projector, with and without biases: the same projected
    tokens and gradients as megatron-core's MultimodalProjector. At TP 2 megatron-core's affine
    projector with a bias fails in its own forward (its bias is sharded, its output gathered):
    ``describe_projector`` refuses it (test below)."""
    cases = [c for c in PROJECTORS if tp == 1 or c != "affine"]
    for rank, errors in enumerate(
        run_distributed(_rank, tp, sequence_parallel, cases, timeout=300.0)
    ):
        assert set(errors) == set(cases)
        for case, errs in errors.items():
            assert len(errs) > 10 and max(errs.values()) <= TOL, (rank, case, errs)


# ---------------------------------------------------------------------------------------------
# megatron-core's LLaVAModel as pretrain_vlm.py builds it, against the config its flags give


def _llava_verdicts(argv: list[str]) -> dict[str, str | None]:
    """Build ``LLaVAModel`` as pretrain_vlm.py's ``model_provider`` does from ``argv`` (one rank),
    and ask whether the config ``optimus_mllm.megatron`` makes of the same flags describes it; and
    of that config with the drop flipped (what the forward drops is the start-up probe's to see),
    and with a GELU projector."""
    from megatron.core.models.vision import clip_vit_model

    from optimus_mllm.megatron.arguments import add_optimus_args, parse_args, validate_args
    from optimus_mllm.megatron.core_training import core_transformer_config_from_args
    from optimus_mllm.megatron.flags import config_from_megatron_args
    from optimus_mllm.runtime.user_model import user_vision_problem

    args = validate_args(parse_args(add_optimus_args, argv), 1)
    config = config_from_megatron_args(args, 1, 1)
    with megatron_patches.patched():
        clip_init = clip_vit_model.CLIPViTModel.__init__  # as megatron_patches keep it on the CPU

        def clip_with_torch_norm(self: Any, *a: Any, **kw: Any) -> None:
            # LLaVAModel passes no ln_pre_impl; without TE the default cannot be built
            # (Megatron-LM jobs on the CPU get this from megatron_patches.cpu.training)
            clip_init(self, *a, **{"ln_pre_impl": WrappedTorchNorm, **kw})

        parallel_state.initialize_model_parallel()
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        clip_vit_model.CLIPViTModel.__init__ = clip_with_torch_norm
        try:
            language = core_transformer_config_from_args(args)
            vision = deepcopy(language)
            vision.num_layers = args.encoder_num_layers
            vision.vision_model_type = "clip"
            projection = deepcopy(language)
            spec = decoder_model_with_local_default_spec()
            llava = LLaVAModel(
                language_transformer_config=language,
                language_transformer_layer_spec=spec,
                language_vocab_size=args.vocab_size,
                language_max_sequence_length=config.llm.seq_length,
                vision_transformer_config=vision,
                vision_transformer_layer_spec=get_vit_layer_with_local_spec(),
                drop_vision_class_token=args.disable_vision_class_token,
                vision_projection_config=projection,
                vision_projection_layer_spec=deepcopy(spec.submodules.mlp.submodules),
                vision_projection_type="mlp",
                img_h=args.img_h,
                img_w=args.img_w,
                patch_dim=args.patch_dim,
            )
        finally:
            clip_vit_model.CLIPViTModel.__init__ = clip_init
            parallel_state.destroy_model_parallel()
    encoder = config.encoders[0]
    layers = vision_transformer_config(encoder, 1, torch.float32, 0.02)
    hidden = config.llm.hidden_size
    flipped = replace(encoder, drop_class_token=not encoder.drop_class_token)
    gelu = replace(encoder, projector=replace(encoder.projector, gated_linear_unit=False))
    return {
        "as built": user_vision_problem(encoder, layers, llava, hidden),
        "drop flipped": user_vision_problem(flipped, layers, llava, hidden),
        "not gated": user_vision_problem(gelu, layers, llava, hidden),
    }


def _one_rank_tiny_flags() -> list[str]:
    flags, skip = [], 0
    for flag in MEGATRON_TINY_FLAGS:
        if skip:
            skip -= 1
            continue
        if flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size"):
            flags += [flag, "1"]
            skip = 1
        elif flag == "--num-layers-per-virtual-pipeline-stage":
            skip = 1
        elif flag != "--disable-vision-class-token":
            flags.append(flag)
    return flags


@pytest.mark.parametrize(
    "flags",
    [["--disable-vision-class-token"], ["--swiglu"]],
    ids=["class-token-dropped", "swiglu-class-token-kept"],
)
def test_the_flags_config_describes_llava_model_as_pretrain_vlm_builds_it(
    flags: list[str],
) -> None:
    # the tiny job's sizes on one rank, CLIP's class token kept unless flags drop it
    tiny = _one_rank_tiny_flags()
    (verdicts,) = run_distributed(_llava_verdicts, 1, [*tiny, *flags], timeout=120.0)
    assert verdicts["as built"] is None, verdicts
    assert verdicts["drop flipped"] is None
    if "--swiglu" in flags:
        assert verdicts["not gated"] == (
            "model_provider: the projector's TransformerConfig.gated_linear_unit is True, but "
            "model.encoders[0].projector.gated_linear_unit describes False; make the two agree"
        )
    else:
        assert verdicts["not gated"] is None


def _projector_verdicts() -> dict[str, Any]:
    """At TP 2: ``projector_problem`` for projectors the config (GELU, pretrain_vlm.py's width)
    does not describe or the encoder does not run, and one it describes; ``describe_projector`` of
    two it runs."""
    config = _optimus_config(swiglu=False, drop=False, sequence_parallel=False)
    encoder = config.encoders[0]

    def built(kind: str, **fields: Any) -> MultimodalProjector:
        projection = _language_config(2, swiglu=False)
        for name, value in fields.items():
            setattr(projection, name, value)
        submodules = deepcopy(decoder_model_with_local_default_spec().submodules.mlp.submodules)
        return MultimodalProjector(projection, submodules, kind, HIDDEN)

    with megatron_patches.patched():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        try:
            projectors = {
                "relu": built("mlp", activation_func=F.relu),
                "affine with a bias": built("affine"),
                "Linear": torch.nn.Linear(HIDDEN, HIDDEN),
                "tanh": built("mlp", activation_func=torch.tanh),
                "fused gelu": built("mlp", bias_activation_fusion=True),
                "affine": built("affine", add_bias_linear=False),
                "as described": built("mlp"),
            }
            described = {
                name: describe_projector(projectors[name], HIDDEN, HIDDEN)
                for name in ("relu", "affine")
            }
            return {
                "problems": {
                    name: projector_problem(encoder, p, HIDDEN) for name, p in projectors.items()
                },
                "described": described,
            }
        finally:
            parallel_state.destroy_model_parallel()


def test_a_projector_the_encoder_does_not_run_or_the_config_does_not_describe_is_refused() -> None:
    """Each refusal one line naming what differs or what the encoder cannot run; a ReLU MLP and an
    affine projector are described as built (with the flag, the description replaces the
    config's)."""
    verdicts = run_distributed(_projector_verdicts, 2, timeout=120.0)
    assert verdicts[0] == verdicts[1]
    assert verdicts[0]["problems"] == {
        "relu": "model_provider: the projector's TransformerConfig.activation_func is relu, but "
        "model.encoders[0].projector.activation describes gelu; make the two agree",
        "affine with a bias": "model_provider: vision_projection is megatron-core's affine "
        "MultimodalProjector with a bias at TP 2, whose forward adds this rank's slice of the "
        "bias to the gathered output and fails; build it with add_bias_linear=False, or at TP 1",
        "Linear": "model_provider: vision_projection is a Linear; the Optimus encoder runs "
        "megatron-core's MultimodalProjector (type mlp or affine)",
        "tanh": "model_provider: the projector's TransformerConfig.activation_func is tanh, which "
        "the Optimus encoder does not run (it runs gelu, silu, relu, squared_relu, quick_gelu); "
        "build the projector with one of them",
        "fused gelu": "model_provider: the projector's TransformerConfig.bias_activation_fusion "
        "is True; the Optimus encoder runs the MLP as megatron-core computes it with False; build "
        "the projector with that",
        "affine": "model.encoders[0].projector.type is mlp, but the model's vision_projection is "
        "a MultimodalProjector of type 'affine'; set type: affine",
        "as described": None,
    }
    assert verdicts[0]["described"] == {
        "relu": ProjectorConfig(ffn_hidden_size=FFN, activation="relu"),
        "affine": ProjectorConfig(type="affine", add_bias_linear=False),
    }
