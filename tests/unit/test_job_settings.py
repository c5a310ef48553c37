"""``optimus_mllm.train.job_settings``: what the ranks of a job compare once connected
(``runtime.same_job``). Everything a node reads that changes the run counts; where the config file
lies does not."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from optimus_mllm.errors import ConfigError
from optimus_mllm.scheduler.artifact import artifact_text
from optimus_mllm.train import build_parser, job_settings, prepare

from support.artifact_utils import artifact_for, shuffled_hooks
from support.train_utils import TINY


def _settings(*argv: str, config: str | Path = TINY) -> dict[str, Any]:
    args = build_parser().parse_args(["--config", str(config), *argv])
    return job_settings(prepare(args, 4), args)


def test_the_same_config_read_from_another_path_is_the_same_job(tmp_path):
    copy = tmp_path / "elsewhere.yaml"
    copy.write_text(Path(TINY).read_text())
    assert _settings(config=copy) == _settings()


@pytest.mark.parametrize(
    "argv",
    [
        ("--override", "training.lr=5e-4"),
        ("--override", "training.seed=7"),
        ("--baseline",),
        ("--save", "ckpt"),
        ("--save", "ckpt", "--save-interval", "2"),
    ],
)
def test_each_input_of_the_run_counts(argv):
    assert _settings(*argv) != _settings()


def test_another_schedule_for_the_same_config_counts(tmp_path):
    planned, moved = tmp_path / "planned.json", tmp_path / "moved.json"
    artifact = artifact_for(TINY)
    planned.write_text(artifact_text(artifact))
    moved.write_text(artifact_text(shuffled_hooks(artifact, seed=0)))
    assert _settings("--schedule", str(planned)) == _settings()
    planned_in_the_job = _settings()
    differ = [
        key
        for key, value in _settings("--schedule", str(moved)).items()
        if planned_in_the_job[key] != value
    ]
    assert differ == ["the schedule (sha256 of its JSON)"]


def test_megatron_lms_lr_schedule_flags_are_the_config_fields():
    """--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler set the training
    fields of the same names, as the YAML does (the resumed runs in test_checkpoint use the flags);
    both at once are refused in one line naming them."""

    def job(*argv: str):
        args = build_parser().parse_args(["--config", TINY, *argv])
        return prepare(args, 4).config.training

    flag = job("--override-opt_param-scheduler")
    assert flag.override_opt_param_scheduler and not flag.use_checkpoint_opt_param_scheduler
    assert job("--override", "training.override_opt_param_scheduler=true") == flag
    assert job("--use-checkpoint-opt-param-scheduler").use_checkpoint_opt_param_scheduler
    with pytest.raises(ConfigError) as refused:
        job("--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler")
    assert "training.override_opt_param_scheduler are both set" in str(refused.value)
    assert "\n" not in str(refused.value)
