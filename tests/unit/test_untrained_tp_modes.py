"""The runtime trains 1D TP, and METP for the encoder (issues 36, 37): optimus-train and the Trainer
given a plan in another TP mode, or an METP encoder where its layers cannot run, stop with one line
naming the field, before any rank connects, and never train the 1D twin instead."""

from __future__ import annotations

import pytest

from optimus_mllm.config import load_config
from optimus_mllm.errors import ConfigError
from optimus_mllm.planner import ParallelPlan
from optimus_mllm.runtime.tp_modes.trained import refuse_untrained_tp_modes
from optimus_mllm.runtime.trainer import Trainer
from optimus_mllm.train import main

from support.paths import CONFIGS

METP = CONFIGS / "metp_long_vision.yaml"
MODEL_ONLY = (
    "the runtime trains only {trained} yet (issue 36/37); the planner's figures for {mode} are "
    "model-only"
)
ENCODER = "parallel.encoder.tp_mode"


@pytest.mark.parametrize(
    "overrides, error",
    [
        (
            ["parallel.encoder.tp_mode=3d"],
            f"{ENCODER}: {MODEL_ONLY.format(trained='1d, metp and 2d', mode='3d')}",
        ),
        (
            ["parallel.llm={dp: 1, pp: 4, tp: 2, tp_mode: metp}", "parallel.encoder.tp_mode=1d"],
            f"parallel.llm.tp_mode: {MODEL_ONLY.format(trained='1d', mode='metp')}",
        ),
        (
            ["training.sequence_parallel=false"],
            f"{ENCODER}: metp keeps 1/tp of the tokens a rank; set "
            "training.sequence_parallel: true",
        ),
        (
            ["--baseline", "balanced"],
            f"{ENCODER}: metp encoders train under Optimus or --baseline, not the balanced "
            "baseline",
        ),
    ],
)
def test_optimus_train_refuses_a_tp_mode_it_cannot_train(overrides, error, monkeypatch, capsys):
    torchrun = {"RANK": "0", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"}
    for name, value in {**torchrun, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    flags = [o for o in overrides if "=" not in o]
    settings = [o for o in overrides if "=" in o]
    argv = ["--config", str(METP), *flags] + (["--override", *settings] if settings else [])
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert (out, err) == ("", f"optimus-train: error: {error}\n")


def test_the_trainer_refuses_a_plan_in_a_tp_mode_it_cannot_train():
    config = load_config(METP, ["parallel.encoder.tp_mode=1d"])
    with pytest.raises(ConfigError, match=r"^parallel\.llm\.tp_mode: the runtime trains only 1d"):
        Trainer(config, ParallelPlan(1, 4, 2, 1, "metp"), "baseline")
    with pytest.raises(ConfigError, match=r"^parallel\.encoder\.tp_mode: the runtime trains only"):
        Trainer(
            load_config(METP, ["parallel.encoder.tp_mode=3d"]), ParallelPlan(1, 4, 2), "baseline"
        )
    with pytest.raises(ConfigError, match=r"^parallel\.encoder\.tp_mode: metp builds this"):
        Trainer(load_config(METP), ParallelPlan(1, 4, 2), "baseline", encoder_layer_specs={})


def test_1d_metp_and_2d_encoders_pass():
    metp = load_config(CONFIGS / "metp_tiny.yaml")
    summa = load_config(CONFIGS / "summa_tiny.yaml")
    for runtime in ("optimus", "baseline"):
        refuse_untrained_tp_modes("1d", "metp", metp, runtime)
        refuse_untrained_tp_modes("1d", "2d", summa, runtime)
    refuse_untrained_tp_modes("1d", "1d", summa, "balanced", own_layers=True)


def test_a_2d_encoder_is_not_checkpointed_yet(monkeypatch, capsys, tmp_path):
    torchrun = {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}
    for name, value in {**torchrun, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    assert main(["--config", str(CONFIGS / "summa_tiny.yaml"), "--save", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        "optimus-train: error: parallel.encoder.tp_mode: 2d encoders are not checkpointed yet; "
        "drop --save, --resume and the encoder's --pretrained-* flags, or use tp_mode 1d or metp\n"
    )


def test_the_baseline_refuses_an_metp_encoder_at_an_llm_tp_it_cannot_ring(monkeypatch, capsys):
    torchrun = {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}
    for name, value in {**torchrun, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    llm_tp1 = "parallel.llm={dp: 2, pp: 2, tp: 1, vp: 2}"
    argv = ["--config", str(CONFIGS / "metp_tiny.yaml"), "--baseline", "--override", llm_tp1]
    assert main(argv) == 2
    _, err = capsys.readouterr()
    assert err == (
        "optimus-train: error: --baseline runs model.encoders[0] at the LLM's tp=1, but its "
        "tp_mode=metp needs a TP degree of at least 2 (its ring), got tp=1; run it without "
        "--baseline or pick another parallel.llm.tp\n"
    )


# summa_tiny's model on 8 GPUs, the LLM at PP2: where the balanced baseline would fit and run
SUMMA_PP2 = ["cluster.num_gpus=8", "cluster.gpus_per_node=8", "parallel.llm={dp: 1, pp: 2, tp: 4}"]


def test_the_planner_offers_no_baseline_the_runtime_refuses_for_a_2d_encoder():
    """The balanced baseline splits 1d layers only: the planner must not name it as the faster run
    (optimus-train would then run it, and refuse the encoder's mode)."""
    from optimus_mllm.costing.cost_model import CostModel
    from optimus_mllm.planner import plan
    from optimus_mllm.scheduler.baselines import runnable_baselines

    for overrides, mode in (
        (SUMMA_PP2, "2d"),
        ([*SUMMA_PP2, "parallel.encoder={tp_mode: 1d}"], "1d"),
    ):
        config = load_config(CONFIGS / "summa_tiny.yaml", overrides)
        cost = CostModel.from_config(config)
        names = [b.name for b in runnable_baselines(config, plan(config).llm_plan, cost)]
        # the same job with a 1d encoder has it: the mode is what rules it out
        assert ("Megatron-LM balanced" in names) == (mode == "1d"), (mode, names)


def test_the_planner_keeps_no_2d_encoder_plan_over_several_stages():
    """A plan the planner keeps is one the runtime trains: a 2d encoder in one pipeline stage."""
    from optimus_mllm.planner import plan

    planned = plan(load_config(CONFIGS / "summa_tiny.yaml", SUMMA_PP2))
    assert planned.candidates and all(c.plan.pp == 1 for c in planned.candidates)
    assert any(
        p.plan.pp > 1 and "2d encoder trains in one pipeline stage" in p.reason
        for p in planned.pruned
    )
