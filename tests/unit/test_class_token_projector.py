"""CLIP's class token and the projector's MLP shape in the config and the models built on it: the
tokens each part runs, the parameter count, the kernels the cost model and the profiler price, the
activation memory."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import yaml

from optimus_mllm.config import ProjectorConfig, config_from_dict
from optimus_mllm.costing.cost_model import LayerShape, layer_kernels
from optimus_mllm.costing.memory_model import encoder_activation_memory_per_microbatch
from optimus_mllm.costing.params import encoder_params, projector_params
from optimus_mllm.tools.profiler import check_flops, kernel_op, profile_entries

from support.paths import CONFIGS

PATCHES = 16  # configs/tiny.yaml's encoder: 16 patch tokens, hidden 32; its LLM hidden 64


def _tiny(llm: dict[str, Any] | None = None, **encoder: Any) -> Any:
    raw = yaml.safe_load((CONFIGS / "tiny.yaml").read_text())
    raw["model"]["encoders"][0].update(encoder)
    raw["model"]["llm"].update(llm or {})
    return config_from_dict(raw)


def _projector_flops(config: Any) -> dict[tuple[str, str], float]:
    return {
        (e.work.name, e.work.phase): e.work.flops
        for e in profile_entries(config)
        if e.module == "vit" and e.tp == 1 and e.work.name.startswith("projector_")
    }


@pytest.mark.parametrize(
    "fields, layers, projected, image",
    [
        ({}, PATCHES, PATCHES, PATCHES),
        ({"class_token": True}, PATCHES + 1, PATCHES + 1, PATCHES + 1),
        ({"class_token": True, "drop_class_token": True}, PATCHES + 1, PATCHES, PATCHES),
    ],
    ids=["none", "kept", "dropped"],
)
def test_the_class_token_runs_through_the_layers_and_reaches_the_llm_unless_dropped(
    fields: dict[str, Any], layers: int, projected: int, image: int
) -> None:
    config = _tiny(**fields)
    enc = config.encoders[0]
    assert (enc.seq_length, enc.layer_tokens, enc.projected_tokens) == (PATCHES, layers, projected)
    assert enc.image_tokens == config.image_tokens == image
    assert config.llm.layer_tokens == config.llm.seq_length  # the LLM has no class token


def test_the_layers_are_priced_and_sized_over_the_patches_and_the_class_token() -> None:
    """The encoder's layers with a class token cost what the same layers cost over one more patch
    token: attention, GEMMs, pipeline messages and activation memory."""
    with_token = _tiny(class_token=True, drop_class_token=True)
    one_more_patch = _tiny(seq_length=PATCHES + 1)
    enc, wider = with_token.encoders[0], one_more_patch.encoders[0]
    for phase in ("fwd", "bwd"):
        assert layer_kernels(LayerShape(enc, 1, 2, False, 2), phase) == layer_kernels(
            LayerShape(wider, 1, 2, False, 2), phase
        )
    assert encoder_activation_memory_per_microbatch(
        with_token, 1, 1
    ) == encoder_activation_memory_per_microbatch(one_more_patch, 1, 1)
    assert encoder_activation_memory_per_microbatch(
        with_token, 1, 1
    ) > encoder_activation_memory_per_microbatch(_tiny(), 1, 1)


def test_the_projector_runs_on_the_llms_image_tokens() -> None:
    """Kept, the class token is one more row of every projector GEMM; dropped, none."""
    micro_batch, h_enc, h_llm = 2, 32, 64
    for fields, tokens in (
        ({"class_token": True}, PATCHES + 1),
        ({"class_token": True, "drop_class_token": True}, PATCHES),
    ):
        flops = _projector_flops(_tiny(**fields))
        rows = tokens * micro_batch
        assert flops[("projector_fc1", "fwd")] == 2.0 * rows * h_enc * h_llm
        assert flops[("projector_fc2", "fwd")] == 2.0 * rows * h_llm * h_llm
        assert flops[("projector_fc1", "bwd")] == 2 * flops[("projector_fc1", "fwd")]


def test_the_projectors_mlp_takes_its_width_and_gating() -> None:
    """pretrain_vlm.py's projector under --swiglu: fc1 to twice the ffn width, fc2 from it."""
    projector = {"ffn_hidden_size": 96, "gated_linear_unit": True, "activation": "silu"}
    flops = _projector_flops(_tiny(projector=projector))
    rows, h_enc, h_llm = PATCHES * 2, 32, 64
    assert flops[("projector_fc1", "fwd")] == 2.0 * rows * h_enc * 2 * 96
    assert flops[("projector_fc2", "fwd")] == 2.0 * rows * 96 * h_llm


@pytest.mark.parametrize(
    "projector, expected",
    [
        ({}, 32 * 64 + 64 + 64 * 64 + 64),  # LLaVA's mlp2x_gelu: today's default
        ({"ffn_hidden_size": 96}, 32 * 96 + 96 + 96 * 64 + 64),
        (
            {"ffn_hidden_size": 96, "gated_linear_unit": True, "add_bias_linear": False},
            32 * 2 * 96 + 96 * 64,
        ),
        ({"type": "linear"}, 32 * 64 + 64),
        ({"type": "linear", "add_bias_linear": False}, 32 * 64),
        ({"type": "affine"}, 32 * 64 + 64),
        ({"type": "affine", "add_bias_linear": False}, 32 * 64),
    ],
    ids=["default", "wide", "swiglu-nobias", "linear", "linear-nobias", "affine", "affine-nobias"],
)
def test_projector_params_follow_its_shape(projector: dict[str, Any], expected: int) -> None:
    config = _tiny(projector=projector)
    assert projector_params(config.encoders[0], config.llm) == expected


def test_the_class_token_and_its_position_embedding_are_parameters() -> None:
    base = _tiny().encoders[0]
    assert encoder_params(dataclasses.replace(base, class_token=True)) == encoder_params(
        base
    ) + 2 * (base.hidden_size)


def test_the_default_projector_is_llavas() -> None:
    projector = ProjectorConfig()
    assert projector.mlp_ffn_hidden_size(64) == 64
    assert (projector.activation, projector.gated_linear_unit, projector.add_bias_linear) == (
        "gelu",
        False,
        True,
    )


@pytest.mark.parametrize(
    "sequence_parallel, fields",
    [
        (False, {"class_token": True, "projector": {"gated_linear_unit": True}}),
        (True, {"seq_length": 9, "class_token": True, "drop_class_token": True}),
        (True, {"projector": {"type": "affine"}}),
    ],
    ids=["kept-gated", "sp-dropped", "sp-affine"],
)
def test_the_profiler_measures_the_shapes_the_cost_model_prices(
    sequence_parallel: bool, fields: dict[str, Any]
) -> None:
    config = _tiny(**fields)
    config = dataclasses.replace(
        config, training=dataclasses.replace(config.training, sequence_parallel=sequence_parallel)
    )
    entries = [e for e in profile_entries(config) if e.module == "vit"]
    assert {e.tp for e in entries} >= {1, 2}
    for entry in entries:
        check_flops(entry, kernel_op(config, entry))  # raises where the two disagree
