"""Parameter counts from the model zoo against the paper's Appendix A (Params columns), within 5
%."""

from __future__ import annotations

import pytest

from optimus_mllm.config import load_config
from optimus_mllm.costing.params import (
    encoder_params,
    encoder_params_per_stage,
    layer_params,
    llm_params,
)

from support.paths import CONFIGS

# (config whose first encoder / LLM is the model, paper's Params)
ENCODERS = [
    ("model_a", "vit", 10e9),
    ("model_b", "vit", 22e9),
    ("appc_vit3b_gpt11b_8gpu", "vit", 3e9),
    ("dualenc_11b_5b", "vit_5b", 5.5e9),
    ("dualenc_22b_11b", "vit_11b", 10e9),
]
LLMS = [("appc_vit3b_gpt11b_8gpu", 11e9), ("model_a", 70e9), ("model_d", 175e9)]


@pytest.mark.parametrize("config_name, encoder, paper", ENCODERS)
def test_encoder_params_match_appendix_a(config_name, encoder, paper):
    config = load_config(CONFIGS / "paper" / f"{config_name}.yaml")
    (enc,) = [e for e in config.encoders if e.name == encoder]
    assert abs(encoder_params(enc) - paper) / paper < 0.05


@pytest.mark.parametrize("config_name, paper", LLMS)
def test_llm_params_match_appendix_a(config_name, paper):
    config = load_config(CONFIGS / "paper" / f"{config_name}.yaml")
    assert abs(llm_params(config.llm) - paper) / paper < 0.05


def test_gpt_layer_is_12h2_plus_biases_and_norms():
    config = load_config(CONFIGS / "paper" / "model_d.yaml")
    h = 12288
    # 4h^2 attn + 8h^2 MLP; 9h biases + 4h norms
    assert layer_params(config.llm) == 12 * h * h + 13 * h


def test_stage_split_keeps_every_parameter():
    config = load_config(CONFIGS / "paper" / "dualenc_22b_5b.yaml")
    from optimus_mllm.costing.params import projector_params

    total = sum(encoder_params(e) + projector_params(e, config.llm) for e in config.encoders)
    for pp in (1, 2, 4, 8):
        assert sum(encoder_params_per_stage(config.encoders, config.llm, pp)) == total
