"""Memory model against hand-computed values: Korthikanti et al.'s activations and the paper's
§4.5."""

from __future__ import annotations

import dataclasses

import pytest

from optimus_mllm.cli.plan import main
from optimus_mllm.config import TransformerSpec, load_config
from optimus_mllm.costing.memory_model import (
    bytes_per_param_k,
    colocation_overhead,
    interleaving_factor,
    layer_activation_bytes,
    mode_layer_activation_bytes,
    model_state_memory,
    optimizer_bytes_per_param,
)
from optimus_mllm.costing.params import encoder_params, encoder_params_per_stage
from optimus_mllm.costing.tp_memory import layer_bytes
from optimus_mllm.planner import plan
from optimus_mllm.planner.planner import ParallelPlan

from support.paths import CONFIGS

# GPT-175B shape, s=2048, b=1: s*b*h = 2048 * 12288 = 25,165,824 and 5*a*s/h = 5*96*2048/12288 = 80.
GPT3 = TransformerSpec(
    num_layers=96, hidden_size=12288, num_attention_heads=96, ffn_hidden_size=49152, seq_length=2048
)


@pytest.mark.parametrize(
    "tp, sp, recompute, expected",
    [
        (1, False, "none", 2_868_903_936),  # sbh (34 + 80)
        (8, False, "none", 578_813_952),  # sbh (10 + 24/8 + 80/8)
        (8, True, "none", 358_612_992),  # sbh (34 + 80) / 8
        (8, True, "selective", 106_954_752),  # sbh 34 / 8
        (8, False, "selective", 327_155_712),  # sbh (10 + 24/8)
        (8, True, "full", 6_291_456),  # 2 sbh / 8
        (8, False, "full", 50_331_648),  # 2 sbh
    ],
)
def test_korthikanti_layer_activations(tp, sp, recompute, expected):
    assert layer_activation_bytes(GPT3, 1, tp, sp, recompute) == pytest.approx(expected)


def test_tp_modes_layer_activations():
    """1d stays Korthikanti's; metp keeps the rank's tokens only: with s b / p = 256 tokens,
    2 bytes x (4 tokens h + 4 tokens + tokens h + a tokens) = 31,508,480 (no s^2 scores term)."""
    for sp in (False, True):
        assert mode_layer_activation_bytes(GPT3, 1, 8, "1d", sp, "none") == pytest.approx(
            layer_activation_bytes(GPT3, 1, 8, sp, "none")
        )
    metp = mode_layer_activation_bytes(GPT3, 1, 8, "metp", True, "none")
    assert metp == 2 * (5 * 256 * 12288 + 4 * 256 + 96 * 256) == 31_508_480
    # full recomputation keeps the rank's share of the layer input, in every mode: 2 sbh / 8
    for mode in ("3d", "metp"):
        assert mode_layer_activation_bytes(GPT3, 1, 8, mode, True, "full") == 6_291_456
    # the papers' saving against 1D at the same degree, on the runtime's own layers (tp_memory);
    # 3D keeps its all-gathered weights (the matrices / p^2), so it saves only where the tokens
    # outweigh the hidden size: at 1024 tokens of width 1024 it holds more than 1D
    vit = TransformerSpec(
        num_layers=1,
        hidden_size=1024,
        num_attention_heads=16,
        ffn_hidden_size=4096,
        seq_length=4096,
    )
    one_d = {t: layer_bytes(vit, "1d", t, 1, 2).activations for t in (4, 8)}
    assert layer_bytes(vit, "2d", 4, 1, 2).activations < one_d[4]
    assert layer_bytes(vit, "metp", 4, 1, 2).activations < one_d[4]
    assert layer_bytes(vit, "3d", 8, 1, 2).activations < one_d[8]


def test_interleaving_factor():
    assert interleaving_factor(8, 1) == 1
    assert interleaving_factor(8, 12) == pytest.approx(1 + 7 / 96)


def test_k_follows_precision():
    config = load_config(CONFIGS / "paper" / "model_d.yaml")
    assert bytes_per_param_k(config) == 6  # bf16 params + fp32 main grads, paper §4.5
    fp32 = dataclasses.replace(
        config, training=dataclasses.replace(config.training, precision="fp32")
    )
    assert bytes_per_param_k(fp32) == 8


@pytest.mark.parametrize(
    "optimizer, momentum, precision, expected",
    [
        ("adam", 0.9, "bf16", 12),
        ("adam", 0.9, "fp32", 8),
        ("sgd", 0.9, "bf16", 8),
        ("sgd", 0.0, "bf16", 4),
        ("sgd", 0.0, "fp32", 0),
    ],
)
def test_optimizer_state_bytes_follow_the_optimizer(optimizer, momentum, precision, expected):
    config = load_config(
        CONFIGS / "tiny.yaml",
        [
            f"training.optimizer={optimizer}",
            f"training.sgd_momentum={momentum}",
            f"training.precision={precision}",
        ],
    )
    assert optimizer_bytes_per_param(config) == expected


def test_distributed_optimizer_shards_adam_states():
    config = load_config(CONFIGS / "paper" / "model_d.yaml")
    mem = model_state_memory(config, 1e9, dp=8)
    assert (mem.params, mem.grads, mem.optimizer) == (2e9, 4e9, 12e9 / 8)
    plain = dataclasses.replace(
        config, training=dataclasses.replace(config.training, distributed_optimizer=False)
    )
    assert model_state_memory(plain, 1e9, dp=8).optimizer == 12e9


@pytest.mark.parametrize("config_name", ["fig5_8gpu", "model_d", "dualenc_22b_11b"])
def test_section_4_5_overhead_comes_out_of_per_gpu_model(config_name):
    """Sum the k-bytes of encoder states over every GPU for each plan: the average minus that of
    DP_enc = DP_llm must equal k (DP_enc - DP_llm) Φ_enc / n_gpu."""
    config = load_config(CONFIGS / "paper" / f"{config_name}.yaml")
    result = plan(config)
    n, k, llm = config.cluster.num_gpus, bytes_per_param_k(config), result.llm_plan
    phi_enc = sum(encoder_params(e) for e in config.encoders)

    def encoder_state_bytes_averaged(enc: ParallelPlan) -> float:
        stages = encoder_params_per_stage(config.encoders, config.llm, enc.pp)
        total = 0.0
        for stage_params in stages:  # every GPU of every stage, every replica
            mem = model_state_memory(config, stage_params / enc.tp, enc.dp)
            total += (mem.params + mem.grads) * enc.tp * enc.dp
        return total / n

    baseline = encoder_state_bytes_averaged(ParallelPlan(llm.dp, llm.pp, llm.tp))
    projectors = sum(encoder_params_per_stage(config.encoders, config.llm, 1)) - phi_enc
    assert len(result.candidates) >= 2
    for candidate in result.candidates:
        derived = encoder_state_bytes_averaged(candidate.plan) - baseline
        formula = colocation_overhead(k, candidate.plan.dp, llm.dp, phi_enc + projectors, n)
        assert derived == pytest.approx(formula, rel=1e-9)
        assert candidate.overhead_bytes == pytest.approx(
            colocation_overhead(k, candidate.plan.dp, llm.dp, phi_enc, n)
        )


def test_plan_exceeding_memory_is_pruned_with_reason(capsys):
    assert main(["--config", str(CONFIGS / "paper" / "strong_1536.yaml")]) == 0
    out = capsys.readouterr().out
    pruned = out.split("pruned encoder plans")[1]
    assert "DP768 PP1 TP2" in pruned and "out of memory: needs" in pruned and "> 80 GiB" in pruned
    kept = out.split("pruned encoder plans")[0]
    assert "DP768 PP1 TP2" not in kept


def test_smaller_gpu_prunes_more(capsys):
    path = str(CONFIGS / "paper" / "strong_3072.yaml")
    full = plan(load_config(path))
    small = plan(load_config(path, ["cluster.gpu_memory_gib=48"]))
    assert len(small.candidates) < len(full.candidates)
    for candidate in small.candidates:
        assert candidate.memory.total <= 48 * 1024**3
    assert any("out of memory" in p.reason for p in small.pruned)
