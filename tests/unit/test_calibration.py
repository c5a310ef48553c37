"""Calibrations: roofline keeps a config's constants, a named one replaces them, bad names and
files are one-line errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from optimus_mllm.calibration import CALIBRATIONS, load_calibration
from optimus_mllm.config import load_config
from optimus_mllm.errors import ConfigError

from support.paths import CONFIGS

STRONG = CONFIGS / "paper" / "strong_3072.yaml"


def test_roofline_keeps_the_configs_own_constants():
    config = load_config(STRONG)
    assert config.cost_model.calibration == "roofline" and load_calibration("roofline") is None
    assert config.cost_model.gemm_efficiency == 0.7 and config.training.recompute == "selective"


def test_the_paper_calibration_replaces_the_constants_and_the_recompute_mode():
    paper = load_calibration("paper")
    assert paper is not None and paper.recompute == "full"
    assert set(paper.constants) >= {"gemm_efficiency", "attention_efficiency"}
    config = load_config(STRONG, ["cost_model.calibration=paper"])
    assert config.training.recompute == "full"
    for key, value in paper.constants.items():
        assert getattr(config.cost_model, key) == value
    # the rest of the config is untouched
    assert config.cluster == load_config(STRONG).cluster


def test_a_calibration_file_given_by_path(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("cost_model:\n  gemm_efficiency: 0.5\n  nvlink_efficiency: 0.6\n")
    config = load_config(STRONG, [f"cost_model.calibration={path}"])
    assert config.cost_model.gemm_efficiency == 0.5 and config.cost_model.nvlink_efficiency == 0.6
    assert config.training.recompute == "selective"  # not set: the config's


@pytest.mark.parametrize(
    "text, message",
    [
        ("cost_model:\n  gemm: 0.5\n", "cost_model.gemm must be one of"),
        ("recompute: some\n", "recompute must be one of"),
        ("- 1\n", "needs a cost_model mapping"),
        ("cost_model:\n  gemm_efficiency: 1.5\n", "cost_model.gemm_efficiency"),
    ],
)
def test_a_bad_calibration_file_names_the_field(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(STRONG, [f"cost_model.calibration={path}"])


def test_an_unknown_calibration_is_one_line_and_exit_2():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "optimus_mllm.cli.plan",
            "--config",
            str(STRONG),
            "--override",
            "cost_model.calibration=papr",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0
    assert "cost_model.calibration" in proc.stderr and "paper" in proc.stderr
    assert {p.stem for p in CALIBRATIONS.glob("*.yaml")} == {"paper"}
