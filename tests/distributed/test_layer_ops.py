"""A megatron-core TransformerLayer split into steps computes what the layer's own forward computes,
and
a whole encoder stage what megatron-core's CLIPViTModel and MultimodalProjector compute.

The reference is megatron-core itself: ``TransformerLayer.forward`` (its local attention, norms,
bias-dropout-add and, at TP 2, its own column/row-parallel linears and collectives) on the same
module, against ``layer_ops.layer_steps`` run as ops; ``CLIPViTModel`` (its ``internvit`` subtype
without a class token: conv1 with a bias, position embeddings, no norms around the layers) and
LLaVA's ``MultimodalProjector`` holding the stage's weights. Layers the steps cannot reproduce are
refused naming the submodule."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.distributed as dist
import yaml
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.vision.clip_vit_model import CLIPViTModel
from megatron.core.models.vision.multimodal_projector import MultimodalProjector
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from torch.utils.flop_counter import FlopCounterMode

from optimus_mllm.config import EncoderConfig, config_from_dict
from optimus_mllm.costing.params import encoder_params, projector_params
from optimus_mllm.errors import OptimusError
from optimus_mllm.runtime.data import patchify
from optimus_mllm.runtime.encoder_ops import Block, MicrobatchRun, build_stage_ops, run_steps
from optimus_mllm.runtime.layer_ops import (
    build_layer,
    layer_steps,
    vision_layer_spec,
    vision_transformer_config,
)
from optimus_mllm.runtime.llm import causal_mask
from optimus_mllm.runtime.vit import EncoderStage
from optimus_mllm.tools.profiler import profile_entries

from support.distributed_utils import run_distributed
from support.megatron_ranks import megatron_state
from support.paths import CONFIGS

SEQ, BATCH = 6, 2
TOL = 2e-5
GATED_GQA_RMS = {
    "gated_linear_unit": True,
    "activation": "silu",
    "num_query_groups": 2,
    "kv_channels": 12,
    "normalization": "RMSNorm",
    "add_bias_linear": False,
}
VARIANTS = {"vit": {}, "gated-gqa-rms-nobias": GATED_GQA_RMS}
SUBTYPES = ["internvit", "clip"]  # CLIPViTModel's: a biased patch conv; one without and ln_pre


def _encoder(**fields: Any) -> EncoderConfig:
    base = {
        "name": "vit",
        "num_layers": 2,
        "hidden_size": 16,
        "num_attention_heads": 4,
        "ffn_hidden_size": 24,
        "seq_length": SEQ,
        "patch_size": 2,
        "in_channels": 3,
    }
    return EncoderConfig(**{**base, **fields})


def _causal(spec: Any) -> Any:
    attention = spec.submodules.self_attention
    attention = replace(
        attention, params={**attention.params, "attn_mask_type": AttnMaskType.causal}
    )
    return replace(spec, submodules=replace(spec.submodules, self_attention=attention))


PIECES = ((0.0, 0.34), (0.34, 0.5), (0.5, 1.0))  # of SEQ = 6 tokens: 2, 1 and 3 rows


def _compare(
    variant: str, causal: bool, group: dist.ProcessGroup, pieces: bool = False
) -> dict[str, float]:
    """Largest differences of output, input gradient and parameter gradients, steps vs forward;
    ``pieces``: every op of the layer run as ``PIECES`` of its tokens."""
    encoder = _encoder(**VARIANTS[variant])
    spec = _causal(vision_layer_spec()) if causal else vision_layer_spec()
    # megatron-core's CPU init draws the whole matrix on every rank: shards agree
    torch.manual_seed(0)
    layer = build_layer(
        spec, vision_transformer_config(encoder, group.size(), torch.float32, 0.2), group, 1
    )
    with torch.no_grad():  # nonzero biases and norm weights, the same on every rank
        for p in layer.parameters():
            if p.dim() == 1:
                p.add_(
                    0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()))
                )
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(SEQ, BATCH, encoder.hidden_size, generator=gen)
    g = torch.randn(SEQ, BATCH, encoder.hidden_size, generator=gen)

    leaf = x.clone().requires_grad_(True)
    # megatron-core makes its default causal mask on the GPU: pass it (True: masked out)
    mask = causal_mask(SEQ) if causal else None
    out, _ = layer(leaf, attention_mask=mask)
    out.backward(g)
    expected = {"output": out.detach(), "input grad": leaf.grad}
    expected |= {name: p.grad.clone() for name, p in layer.named_parameters()}
    layer.zero_grad(set_to_none=True)

    ops = build_stage_ops([Block("vit", 1, layer_steps(layer, group, False, "vit:1"), True)])
    run = MicrobatchRun(ops, {"vit": x}, seed=0)
    for k, op in enumerate(ops.fwd):
        for piece in PIECES if pieces and op.splittable else ((0.0, 1.0),):
            run.run_forward(k, piece)
    run.set_output_grad({"vit": g})
    for k, op in enumerate(ops.bwd):
        for piece in PIECES if pieces and op.splittable else ((0.0, 1.0),):
            run.run_backward(k, piece)
    if pieces:
        assert {op.name for op in ops.fwd + ops.bwd if op.splittable} == {
            "ln_attn",
            "qkv",
            "attn_core",
            "attn_proj",
            "ln_mlp",
            "fc1",
            "act",
            "fc2",
        }
    got = {"output": run.output["vit"], "input grad": run.input_grad["vit"]}
    got |= {name: p.grad for name, p in layer.named_parameters()}
    return {key: (got[key] - value).abs().max().item() for key, value in expected.items()}


@pytest.fixture(scope="module")
def one_rank() -> Iterator[dist.ProcessGroup]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    with megatron_state():
        yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.mark.parametrize("pieces", [False, True], ids=["whole", "pieces"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_steps_compute_the_layers_own_forward(
    one_rank: dist.ProcessGroup, variant: str, causal: bool, pieces: bool
) -> None:
    """Also with every op run as pieces of its tokens (attention: some queries, under the causal
    mask too)."""
    errors = _compare(variant, causal, one_rank, pieces)
    assert max(errors.values()) <= TOL, errors


def _tp2_rank() -> dict[str, dict[str, float]]:
    with megatron_state(tensor_model_parallel_size=2):
        group = parallel_state.get_tensor_model_parallel_group()
        errors = {
            f"{variant}{' in pieces' * pieces}": _compare(variant, False, group, pieces)
            for variant in VARIANTS
            for pieces in (False, True)
        }
        return {
            **errors,
            **{
                f"{subtype} vision model + projector": _clip_comparison(group, subtype)
                for subtype in SUBTYPES
            },
        }


@pytest.mark.distributed
def test_tp2_steps_compute_megatron_cores_forward() -> None:
    for rank, errors in enumerate(run_distributed(_tp2_rank, 2, timeout=120.0)):
        for variant, errs in errors.items():
            assert max(errs.values()) <= TOL, (rank, variant, errs)


def test_megatron_gpt_local_layer_is_split_too(one_rank: dist.ProcessGroup) -> None:
    layer = build_layer(
        get_gpt_layer_local_spec(),
        vision_transformer_config(_encoder(), 1, torch.float32, 0.02),
        one_rank,
        0,
    )
    kernels = [
        step.fwd_kernel for step in layer_steps(layer, one_rank, False, "vit:0") if step.fwd_kernel
    ]
    assert kernels == ["ln_attn", "qkv", "attn_core", "attn_proj", "ln_mlp", "fc1", "act", "fc2"]


def _with_submodule(spec: Any, path: str, module: Any) -> Any:
    owner, name = path.split(".") if "." in path else (None, path)
    if owner is None:
        return replace(spec, submodules=replace(spec.submodules, **{name: module}))
    inner = getattr(spec.submodules, owner)
    inner = replace(inner, submodules=replace(inner.submodules, **{name: module}))
    return replace(spec, submodules=replace(spec.submodules, **{owner: inner}))


class _OwnLinear(torch.nn.Module):
    """A user's own column-parallel stand-in: a forward the steps know nothing of."""

    def __init__(self, input_size: int, output_size: int, **_: Any) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(output_size, input_size))
        self.bias = None


@pytest.mark.parametrize(
    "path, module, message",
    [
        ("self_attention.q_layernorm", WrappedTorchNorm, "self_attention.q_layernorm is LayerNorm"),
        (
            "mlp.linear_fc1",
            _OwnLinear,
            "mlp.linear_fc1 is _OwnLinear; Optimus splits only ColumnParallelLinear",
        ),
    ],
)
def test_a_layer_the_steps_cannot_reproduce_is_refused_naming_the_submodule(
    one_rank: dist.ProcessGroup, path: str, module: Any, message: str
) -> None:
    spec = _with_submodule(vision_layer_spec(), path, module)
    layer = build_layer(
        spec, vision_transformer_config(_encoder(), 1, torch.float32, 0.02), one_rank, 0
    )
    with pytest.raises(OptimusError, match=f"^vit:0: {message}"):
        layer_steps(layer, one_rank, False, "vit:0")


def test_a_padding_mask_is_refused(one_rank: dist.ProcessGroup) -> None:
    spec = vision_layer_spec()
    attention = spec.submodules.self_attention
    attention = replace(
        attention, params={**attention.params, "attn_mask_type": AttnMaskType.padding}
    )
    spec = replace(spec, submodules=replace(spec.submodules, self_attention=attention))
    layer = build_layer(
        spec, vision_transformer_config(_encoder(), 1, torch.float32, 0.02), one_rank, 0
    )
    with pytest.raises(OptimusError, match="attn_mask_type padding"):
        layer_steps(layer, one_rank, False, "vit:0")


def test_an_encoder_stage_is_built_from_the_jobs_layer_spec(one_rank: dist.ProcessGroup) -> None:
    config = _tiny()
    own = EncoderStage(config, 0, 1, one_rank, layer_specs={"vit": _causal(vision_layer_spec())})
    default = EncoderStage(config, 0, 1, one_rank)
    masks = {
        stage: {
            layer.self_attention.core_attention.attn_mask_type
            for layer in stage.encoders["vit"].layers
        }
        for stage in (own, default)
    }
    assert masks == {own: {AttnMaskType.causal}, default: {AttnMaskType.no_mask}}


# ---------------------------------------------------------------------------------------------
# A whole encoder stage against megatron-core's CLIPViTModel and MultimodalProjector


def _megatron_reference(
    stage: EncoderStage, config: Any, group: dist.ProcessGroup
) -> tuple[Any, Any]:
    """megatron-core's vision model and projector for the stage's encoder, holding the stage's
    weights."""
    vision = stage.encoders["vit"]
    enc = config.encoders[0]
    layer = vision.layers[0]
    side = int(enc.seq_length**0.5) * enc.patch_size
    clip = CLIPViTModel(
        layer.config,
        vision_layer_spec(),
        ln_pre_impl=WrappedTorchNorm,
        add_class_token=False,
        class_token_len=0,
        patch_dim=enc.patch_size,
        img_h=side,
        img_w=side,
        model_subtype=enc.model_subtype,
        pg_collection=ProcessGroupCollection(tp=group, cp=None, pp=None),
    )
    projector = MultimodalProjector(
        vision.projector.projection.config,
        MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
        "mlp",
        enc.hidden_size * enc.projector.spatial_merge**2,
        tp_group=group,
    )
    ours = dict(vision.named_parameters())
    order = _merge_order(int(enc.seq_length**0.5), enc.projector.spatial_merge)
    with torch.no_grad():
        for name, p in clip.named_parameters():
            p.copy_(
                ours[
                    name.replace("decoder.layers.", "layers.")
                    if name.startswith("decoder.")
                    else f"patch_embed.{name}"
                ]
            )
        clip.position_embeddings.weight[order] = ours["patch_embed.position_embeddings.weight"]
        for name, p in projector.named_parameters():
            p.copy_(ours[f"projector.projection.{name}"])
    return clip, projector


def _merge_order(grid: int, merge: int) -> torch.Tensor:
    """Row-major patch index of each of our tokens: blocks of merge x merge patches, row-major, and
    row-major inside each block (Qwen2-VL's order; plain row-major for merge 1)."""
    return torch.tensor(
        [
            (block_row * merge + row) * grid + block_col * merge + col
            for block_row in range(grid // merge)
            for block_col in range(grid // merge)
            for row in range(merge)
            for col in range(merge)
        ]
    )


def _pixel_shuffle(x: torch.Tensor, grid: int, merge: int) -> torch.Tensor:
    """[b, grid*grid, h] row-major -> [b, tokens / merge**2, merge**2 * h]: each merge x merge block
    of neighbours concatenated, row-major inside it (Qwen2-VL's PatchMerger input)."""
    b, _, h = x.shape
    blocks = x.view(b, grid // merge, merge, grid // merge, merge, h).permute(0, 1, 3, 2, 4, 5)
    return blocks.reshape(b, (grid // merge) ** 2, merge * merge * h)


def _tiny(**encoder: Any) -> Any:
    raw = yaml.safe_load((CONFIGS / "tiny.yaml").read_text())
    raw["model"]["encoders"][0].update(encoder)
    return config_from_dict(raw)


def _clip_comparison(group: dist.ProcessGroup, subtype: str, merge: int = 1) -> dict[str, float]:
    """Largest differences of the projected features and every gradient, stage ops vs megatron-core
    (with ``merge``: its CLIP output pixel-shuffled into the projector)."""
    config = _tiny(model_subtype=subtype, projector={"spatial_merge": merge})
    enc = config.encoders[0]
    torch.manual_seed(0)
    stage = EncoderStage(config, 0, 1, group, init_std=0.2)
    with torch.no_grad():  # nonzero biases and norm weights, the same on every rank
        for name, p in stage.named_parameters():
            if p.dim() == 1:
                p.add_(
                    0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name)))
                )
    clip, projector = _megatron_reference(stage, config, group)
    grid, p = int(enc.seq_length**0.5), enc.patch_size
    gen = torch.Generator().manual_seed(2)
    images = torch.randn(BATCH, enc.in_channels, grid * p, grid * p, generator=gen)
    grad = torch.randn(enc.seq_length // merge**2, BATCH, config.llm.hidden_size, generator=gen)

    features = _pixel_shuffle(clip(images), grid, merge)
    out = projector(features.permute(1, 0, 2))  # LLaVA: [b, s, h] -> [s, b, h] into the projector
    out.backward(grad)
    expected = {"output": out.detach()}
    expected |= {f"clip.{n}": q.grad for n, q in clip.named_parameters()}
    expected |= {f"projector.{n}": q.grad for n, q in projector.named_parameters()}

    # the data's layout (runtime.data.patchify): each patch flattened channel-last, in the merge
    # order
    patches = images.view(BATCH, enc.in_channels, grid, p, grid, p).permute(0, 2, 4, 3, 5, 1)
    patches = patches.reshape(BATCH, grid * grid, -1)[:, _merge_order(grid, merge)]
    assert torch.equal(patchify(images, p, merge), patches)
    ops = build_stage_ops(stage.blocks())
    run = MicrobatchRun(ops, {"vit": patches}, seed=0)
    for k in range(len(ops.fwd)):
        run.run_forward(k)
    run.set_output_grad({"vit": grad})
    for k in range(len(ops.bwd)):
        run.run_backward(k)
    ours = dict(stage.encoders["vit"].named_parameters())
    got = {"output": run.output["vit"]}
    got |= {
        f"clip.{n}": ours[
            n.replace("decoder.layers.", "layers.")
            if n.startswith("decoder.")
            else f"patch_embed.{n}"
        ].grad
        for n, _ in clip.named_parameters()
    }
    got |= {
        f"projector.{n}": ours[f"projector.projection.{n}"].grad
        for n, _ in projector.named_parameters()
    }
    position = got["clip.position_embeddings.weight"]
    # our token order -> CLIP's row-major one
    got["clip.position_embeddings.weight"] = torch.empty_like(position).index_copy_(
        0, _merge_order(grid, merge), position
    )
    return {
        key: (got[key] - value).abs().max().item() / max(1.0, value.abs().max().item())
        for key, value in expected.items()
    }


@pytest.mark.parametrize("subtype", SUBTYPES)
def test_an_encoder_stage_computes_megatron_cores_clip_vit_and_projector(
    one_rank: dist.ProcessGroup, subtype: str
) -> None:
    errors = _clip_comparison(one_rank, subtype)
    assert len(errors) > 10 and max(errors.values()) <= TOL, errors


def test_the_spatial_merge_is_a_pixel_shuffle_of_megatron_cores_clip_output(
    one_rank: dist.ProcessGroup,
) -> None:
    """projector.spatial_merge=2: the patches in Qwen2-VL's order, merged 2x2 before the projector,
    give
    megatron-core's CLIP (row-major patches) with its output pixel-shuffled into a 4x wider
    projector."""
    errors = _clip_comparison(one_rank, "clip", merge=2)
    assert len(errors) > 10 and max(errors.values()) <= TOL, errors


SWIGLU_PROJECTOR = {
    "ffn_hidden_size": 48,
    "gated_linear_unit": True,
    "activation": "silu",
    "add_bias_linear": False,
}


@pytest.mark.parametrize(
    "encoder",
    [
        {"projector": {"spatial_merge": 2}},
        {"projector": {"type": "linear", "spatial_merge": 2}},
        {},
        {"class_token": True, "projector": SWIGLU_PROJECTOR},
        {"class_token": True, "drop_class_token": True, "projector": {"spatial_merge": 2}},
    ],
    ids=["mlp-merge2", "linear-merge2", "mlp", "class-token-swiglu", "class-token-dropped-merge2"],
)
def test_the_projectors_flops_are_the_cost_models(
    one_rank: dist.ProcessGroup, encoder: dict[str, Any]
) -> None:
    """torch's FLOP counter over the runtime's projector steps (drop, merge, GEMMs, bias), forward
    and backward, against the FLOPs the cost model gives its kernels."""
    config = _tiny(**encoder)
    enc = config.encoders[0]
    stage = EncoderStage(config, 0, 1, one_rank)
    steps = stage.encoders["vit"].projector.steps(one_rank, False)
    x = torch.randn(enc.layer_tokens, BATCH, enc.hidden_size, requires_grad=True)
    with FlopCounterMode(display=False) as forward:
        out = run_steps(steps, x, seed=0)
    with FlopCounterMode(display=False) as backward:
        out.backward(torch.randn_like(out))
    costed = {
        e.key[1:3]: e.work.flops
        for e in profile_entries(config)
        if e.key[0] == "vit" and e.key[3] == 1
    }
    assert out.shape == (enc.image_tokens, BATCH, config.llm.hidden_size)
    for phase, counter in (("fwd", forward), ("bwd", backward)):
        assert counter.get_total_flops() == sum(
            f for (name, p), f in costed.items() if p == phase and name.startswith("projector_")
        ), phase


@pytest.mark.parametrize(
    "encoder",
    [
        {},
        {"model_subtype": "clip"},
        GATED_GQA_RMS,
        {"projector": {"spatial_merge": 2}},
        {"model_subtype": "clip", "class_token": True, "projector": SWIGLU_PROJECTOR},
        {"projector": {"type": "linear", "add_bias_linear": False}},
    ],
    ids=["internvit", "clip", "gated", "merge", "class-token-swiglu", "linear-nobias"],
)
def test_the_parameter_count_is_the_planners(
    one_rank: dist.ProcessGroup, encoder: dict[str, Any]
) -> None:
    config = _tiny(**encoder)
    stage = EncoderStage(config, 0, 1, one_rank)
    enc = config.encoders[0]
    assert sum(p.numel() for p in stage.parameters()) == encoder_params(enc) + projector_params(
        enc, config.llm
    )


def test_an_encoder_stage_refuses_a_spec_it_cannot_split_when_built(
    one_rank: dist.ProcessGroup,
) -> None:
    config = _tiny()
    spec = _with_submodule(vision_layer_spec(), "self_attention.q_layernorm", WrappedTorchNorm)
    with pytest.raises(OptimusError, match=r"^vit:0: self_attention.q_layernorm is LayerNorm"):
        EncoderStage(config, 0, 1, one_rank, layer_specs={"vit": spec})
