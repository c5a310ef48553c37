"""The encoder's shape read from the vision model a user's provider built (``described_encoder``),
as ``--optimus-schedule`` reads it instead of the Megatron-LM flags, and the start-up line that
says so."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest
import torch.nn.functional as F
import yaml
from megatron.core.activations import quick_gelu
from megatron.core.transformer import TransformerConfig

from optimus_mllm.config import config_from_dict
from optimus_mllm.errors import OptimusError
from optimus_mllm.megatron.seams import vision_line
from optimus_mllm.runtime.user_model import described_encoder

from support.paths import CONFIGS


def _flags_encoder() -> Any:
    return config_from_dict(yaml.safe_load((CONFIGS / "tiny.yaml").read_text())).encoders[0]


def _vision(**config: Any) -> SimpleNamespace:
    """The attributes megatron-core's CLIPViTModel keeps of examples/multimodal's CLIP ViT-L/14 at
    336 pixels (its config.py: 24 layers of 1024, 16 heads, FFN 4096, quick GELU, LayerNorm), a
    stand-in: building the model takes a TP group."""
    layers = {
        "num_layers": 24,
        "hidden_size": 1024,
        "num_attention_heads": 16,
        "ffn_hidden_size": 4096,
        "activation_func": quick_gelu,
        "add_bias_linear": True,
        "normalization": "LayerNorm",
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        **config,
    }
    return SimpleNamespace(
        config=TransformerConfig(**layers),
        num_patches=(336 // 14) ** 2,
        patch_dim=14,
        add_class_token=True,
        class_token_len=1,
        ln_pre=object(),
        ln_post=None,
    )


def test_the_built_vision_models_shape_replaces_the_flags() -> None:
    flags = _flags_encoder()
    built = described_encoder(flags, _vision())
    assert (built.num_layers, built.hidden_size, built.num_attention_heads) == (24, 1024, 16)
    assert (built.ffn_hidden_size, built.activation, built.normalization) == (
        4096,
        "quick_gelu",
        "LayerNorm",
    )
    assert (built.kv_channels, built.num_query_groups) == (None, None)  # megatron-core's defaults
    assert (built.seq_length, built.patch_size, built.model_subtype) == (576, 14, "clip")
    assert built.class_token and built.layer_tokens == 577
    assert (built.name, built.projector, built.frozen) == (
        flags.name,
        flags.projector,
        flags.frozen,
    )


def test_grouped_query_and_other_head_widths_are_read() -> None:
    built = described_encoder(
        _flags_encoder(),
        _vision(num_query_groups=4, kv_channels=32, activation_func=F.silu, gated_linear_unit=True),
    )
    assert (built.num_query_groups, built.kv_channels) == (4, 32)
    assert (built.activation, built.gated_linear_unit) == ("silu", True)


@pytest.mark.parametrize(
    "change, named",
    [
        (
            {
                "config": TransformerConfig(
                    num_layers=2, hidden_size=64, num_attention_heads=4, activation_func=abs
                )
            },
            "TransformerConfig.activation_func",
        ),
        ({"ln_pre": None, "ln_post": object()}, "model_subtype siglip"),
        ({"class_token_len": 2}, "class_token_len"),
    ],
    ids=["activation", "siglip", "class-tokens"],
)
def test_what_the_encoder_cannot_run_is_refused_naming_it(
    change: dict[str, Any], named: str
) -> None:
    vision = _vision()
    for name, value in change.items():
        setattr(vision, name, value)
    with pytest.raises(OptimusError, match=named):
        described_encoder(_flags_encoder(), vision)


def test_the_start_up_line_names_what_differs_from_the_flags() -> None:
    flags = _flags_encoder()
    assert vision_line(flags, flags) == ""
    deeper = dataclasses.replace(flags, num_layers=flags.num_layers + 1)
    assert vision_line(flags, deeper) == (
        "optimus: the encoder is read from the vision model the provider built, not from the "
        "Megatron-LM flags (read as pretrain_vlm.py builds it): "
        f"num_layers {flags.num_layers + 1} (flags: {flags.num_layers})"
    )
