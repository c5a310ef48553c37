"""The runtime trains 1D TP only yet (issues 36, 37): optimus-train and the Trainer given a plan in
another TP mode stop with one line naming the field, before any rank connects, and never train the
1D twin instead."""

from __future__ import annotations

import pytest

from optimus_mllm.config import load_config
from optimus_mllm.errors import ConfigError
from optimus_mllm.planner import ParallelPlan
from optimus_mllm.runtime.trainer import Trainer
from optimus_mllm.train import main

from support.paths import CONFIGS

METP = CONFIGS / "metp_long_vision.yaml"
MODEL_ONLY = (
    "the runtime trains only 1d yet (issue 36/37); the planner's figures for {mode} are model-only"
)


@pytest.mark.parametrize(
    "overrides, field, mode",
    [
        ([], "parallel.encoder.tp_mode", "metp"),
        (
            ["parallel.llm={dp: 1, pp: 4, tp: 2, tp_mode: metp}", "parallel.encoder.tp_mode=1d"],
            "parallel.llm.tp_mode",
            "metp",
        ),
    ],
)
def test_optimus_train_refuses_a_tp_mode_it_cannot_train(
    overrides, field, mode, monkeypatch, capsys
):
    torchrun = {"RANK": "0", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"}
    for name, value in {**torchrun, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    argv = ["--config", str(METP)] + (["--override", *overrides] if overrides else [])
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert (out, err) == ("", f"optimus-train: error: {field}: {MODEL_ONLY.format(mode=mode)}\n")


def test_the_trainer_refuses_a_plan_in_a_tp_mode_it_cannot_train():
    config = load_config(METP, ["parallel.encoder.tp_mode=1d"])
    with pytest.raises(ConfigError, match=r"^parallel\.llm\.tp_mode: the runtime trains only 1d"):
        Trainer(config, ParallelPlan(1, 4, 2, 1, "metp"), "baseline")
    with pytest.raises(ConfigError, match=r"^parallel\.encoder\.tp_mode: the runtime trains only"):
        Trainer(load_config(METP), ParallelPlan(1, 4, 2), "baseline")
