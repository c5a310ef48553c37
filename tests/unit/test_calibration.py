"""Calibrations: roofline keeps a config's constants, a named one replaces them, bad names and
files are one-line errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from optimus_mllm.config import load_config
from optimus_mllm.config.calibration import CALIBRATIONS, load_calibration
from optimus_mllm.errors import ConfigError

from support.paths import CONFIGS, REPO, load_script

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


def test_the_shipped_paper_calibration_is_the_file_the_fit_writes_for_its_constants():
    """The header's fit and residuals are what the cost model and scheduler give the shipped
    constants today: a change that moves the paper calibration's figures (a dropped recompute, a
    constant read from elsewhere) shows here, and the file must be refitted."""
    fit = load_script("fit_calibration")
    shipped = load_calibration("paper")
    assert shipped is not None and shipped.recompute == fit.RECOMPUTE
    assert set(shipped.constants) == set(fit.START)
    constants = {k: shipped.constants[k] for k in fit.START}
    [residuals] = fit.residuals_of([constants])
    assert fit.calibration_text(constants, residuals) == (CALIBRATIONS / "paper.yaml").read_text()


def test_residuals_with_a_profile_are_not_the_cached_ones_without(monkeypatch):
    fit = load_script("fit_calibration")
    runs = []

    def residuals(job):
        runs.append(job)
        *_, profile = job
        return {"optimus_s": 1.0 if profile is None else 2.0}

    monkeypatch.setattr(fit, "_setup_residuals", residuals)
    monkeypatch.setattr(fit, "_RESIDUALS", {})
    trial = {"gemm_efficiency": 0.5}
    [plain] = fit.residuals_of([trial])
    [measured] = fit.residuals_of([trial], profile="measured.json")
    [again] = fit.residuals_of([trial])
    assert {row["optimus_s"] for row in plain.values()} == {1.0} and again == plain
    assert {row["optimus_s"] for row in measured.values()} == {2.0}
    assert len(runs) == 2 * len(fit.PAPER_TABLE7)  # each (constants, profile) run once


def test_the_fit_scores_the_figures_outside_their_bounds_then_the_worst_then_the_next():
    fit = load_script("fit_calibration")
    tight = {"s": {"balanced_s": 4.0, "optimus_s": -4.0, "eff_coarse": 4.0, "eff_fine": 4.0}}
    one_off = {"s": {"balanced_s": 0.0, "optimus_s": 0.0, "eff_coarse": 0.0, "eff_fine": -6.0}}
    assert fit.score(tight) == pytest.approx((0, 0.8, 0.8, 0.8, 0.8))
    assert fit.score(one_off) == pytest.approx((1, 1.2, 0.0, 0.0, 0.0))
    assert fit.score(tight) < fit.score(one_off)  # within every bound beats one figure outside
    # fewer figures outside their bounds first, then the worst, then the next worst
    drifted = {"s": {"balanced_s": -5.5, "optimus_s": 0.0, "eff_coarse": 0.0, "eff_fine": -6.0}}
    further = {"s": {"balanced_s": 0.0, "optimus_s": 0.0, "eff_coarse": 0.0, "eff_fine": -8.0}}
    nearer = {"s": {"balanced_s": 4.5, "optimus_s": 0.0, "eff_coarse": 0.0, "eff_fine": -8.0}}
    assert fit.score(one_off) < fit.score(further) < fit.score(nearer) < fit.score(drifted)
    assert fit.report({"gemm_efficiency": 0.5}, tight)[-1].endswith(": within the bounds")
    assert fit.report({"gemm_efficiency": 0.5}, one_off)[-1].endswith(": NOT within the bounds")


@pytest.mark.parametrize(
    "args",
    [
        ["--evaluate", "gemm=0.5"],
        ["--workers", "0"],
        ["--profile", "profiles/h100_strong.json"],  # the fit itself runs on the constants
        ["--profile", "no/such/profile.json", "--evaluate", "nvlink_efficiency=0.6"],
        ["--profile-scale", "0", "--evaluate", "nvlink_efficiency=0.6"],
        ["--profile-scale", "1.3", "--evaluate", "nvlink_efficiency=0.6"],
    ],
)
def test_the_fit_refuses_a_bad_flag_in_one_line(args):
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "fit_calibration.py"), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and args[0] in proc.stderr
