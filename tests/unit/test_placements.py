"""The placements a job can train under (``scheduler/placements.py``) and optimus-plan's lines and
JSON of them: one line per placement, exactly one planned, and the planned one what
``best_schedule`` picks, the fastest prediction (a tie goes to the baseline)."""

from __future__ import annotations

import json

import pytest

from optimus_mllm.cli.plan import main
from optimus_mllm.config import load_config
from optimus_mllm.costing.cost_model import CostModel
from optimus_mllm.megatron.flags import flag_schedule
from optimus_mllm.planner import plan
from optimus_mllm.scheduler.bubble_scheduler import best_schedule
from optimus_mllm.scheduler.placements import PLACEMENT_MODES, predicted_placements

from support.paths import CONFIGS, MEGATRON_TINY_FLAGS, REPO, balanced_wins

CPU_CONFIGS = sorted((CONFIGS / "cpu").glob("*.yaml"))
# those priced at one workload; a config whose images vary is priced over drawn iterations (below)
CONSTANT_CONFIGS = [p for p in CPU_CONFIGS if load_config(p).data.images_per_sample is None]
# the scheduler's float tolerance (intervals.EPS_US) as seconds, with room to spare
TIE_S = 1e-9


@pytest.mark.parametrize("path", [CONFIGS / "tiny.yaml", *CONSTANT_CONFIGS], ids=lambda p: p.stem)
def test_the_planned_placement_is_best_schedules_choice_and_the_fastest(path):
    config = load_config(path)
    planned, cost = plan(config), CostModel.from_config(config)
    scheduled = best_schedule(config, planned, cost)
    found = predicted_placements(config, planned, scheduled, cost)
    assert tuple(p.mode for p in found) == PLACEMENT_MODES
    chosen = [p for p in found if p.planned]
    assert len(chosen) == 1
    expected = scheduled.baseline.runtime if scheduled.baseline else "optimus"
    assert chosen[0].mode == expected
    assert chosen[0].iteration_s * 1e6 == pytest.approx(scheduled.iteration_us)
    fastest = min(p.iteration_s for p in found if p.iteration_s is not None)
    assert chosen[0].iteration_s <= fastest + TIE_S


def test_a_faster_baseline_is_the_planned_placement(tmp_path):
    config = load_config(balanced_wins(tmp_path))
    planned, cost = plan(config), CostModel.from_config(config)
    found = predicted_placements(config, planned, best_schedule(config, planned, cost), cost)
    assert [p.mode for p in found if p.planned] == ["balanced"]


def test_a_webdataset_job_is_never_planned_onto_the_balanced_baseline(tmp_path):
    """The balanced baseline's buffers carry one image per sample, so optimus-train refuses it on a
    webdataset: where it would win, the prediction says why it cannot run and plans another."""
    (tmp_path / "data" / ".nv-meta").mkdir(parents=True)
    config = load_config(balanced_wins(tmp_path), [f"data.path={tmp_path / 'data'}"])
    planned, cost = plan(config), CostModel.from_config(config)
    scheduled = best_schedule(config, planned, cost)
    found = {p.mode: p for p in predicted_placements(config, planned, scheduled, cost)}
    assert found["balanced"].iteration_s is None and not found["balanced"].planned
    assert "a webdataset's microbatches (data.path) vary in images" in found["balanced"].problem
    assert scheduled.baseline is None or scheduled.baseline.runtime != "balanced"
    assert sum(p.planned for p in found.values()) == 1


def test_a_job_whose_images_vary_is_priced_and_chosen_over_its_drawn_iterations():
    """With ``data.images_per_sample`` every placement is its mean over the iterations
    optimus-plan draws (the baselines each microbatch with its own images, computed here again
    from the draws), one rule picks among those means, and optimus-train runs that pick: the
    expected-fastest encoder plan's schedule, the one optimus-plan writes."""
    from optimus_mllm.costing.workload import WorkloadDistribution, draw_iterations
    from optimus_mllm.scheduler.baselines import megatron_lm_baseline
    from optimus_mllm.scheduler.bubble_scheduler import optimus_gains
    from optimus_mllm.scheduler.expected import EXPECTED_ITERATIONS
    from optimus_mllm.scheduler.placements import job_placements
    from optimus_mllm.train import _schedule_now

    config = load_config(CONFIGS / "cpu" / "pp2_v2_varying_images.yaml")
    planned, cost = plan(config), CostModel.from_config(config)
    job = job_placements(config, planned, cost)
    drawn = draw_iterations(
        config,
        WorkloadDistribution.of_config(config),
        EXPECTED_ITERATIONS,
        planned.num_microbatches,
        config.training.seed,
    )
    megatron = [megatron_lm_baseline(config, planned.llm_plan, cost, w).iteration_us for w in drawn]
    assert len(set(megatron)) > 1, "the draws differ, so the constant workload's price would not do"
    found = {p.mode: p for p in job.placements}
    assert found["megatron-lm"].iteration_s * 1e6 == pytest.approx(sum(megatron) / len(drawn))
    assert found["optimus"].iteration_s * 1e6 == pytest.approx(job.expected.best.expected_us)
    assert job.schedule is job.expected.best.fallback
    runnable = {m: p.iteration_s for m, p in found.items() if p.iteration_s is not None}
    slower = [
        m
        for m, s in runnable.items()
        if m != "optimus" and not optimus_gains(runnable["optimus"], s, cost.step_noise)
    ]
    planned_mode = min(slower, key=runnable.get) if slower else "optimus"
    assert [m for m, p in found.items() if p.planned] == [planned_mode]
    artifact, baseline, _ = _schedule_now(config, planned, ())
    if planned_mode == "optimus":
        assert baseline is None
        assert artifact.encoder_plan == job.expected.best.candidate.plan
    else:
        assert artifact is None and baseline == planned_mode


def test_a_placement_the_job_cannot_run_says_why():
    """With one ViT head, the baselines cannot run the ViT at the LLM's TP, 2; Optimus runs it at
    TP1."""
    config = load_config(CONFIGS / "tiny.yaml", ["model.encoders.0.num_attention_heads=1"])
    planned, cost = plan(config), CostModel.from_config(config)
    found = {
        p.mode: p
        for p in predicted_placements(config, planned, best_schedule(config, planned, cost), cost)
    }
    for mode in ("megatron-lm", "balanced"):
        assert found[mode].iteration_s is None and not found[mode].planned
        assert "tp=2" in found[mode].problem
    assert found["optimus"].planned and found["optimus"].problem is None


@pytest.mark.parametrize("path", [CONFIGS / "tiny.yaml", *CPU_CONFIGS], ids=lambda p: p.stem)
def test_optimus_plan_prints_and_writes_one_row_per_placement(path, tmp_path, capsys):
    out_json = tmp_path / "plan.json"
    assert main(["--config", str(path), "--json", str(out_json)]) == 0
    lines = capsys.readouterr().out.splitlines()
    varies = load_config(path).data.images_per_sample is not None
    over = "mean over the drawn iterations" if varies else "predicted iteration"
    at = lines.index(f"placements ({over}; * the one optimus-train runs with no flag):")
    rows = lines[at + 1 :]
    assert [row.split()[0] for row in rows] == list(PLACEMENT_MODES)
    assert sum(row.endswith(" *") for row in rows) == 1
    placements = json.loads(out_json.read_text())["placements"]
    assert [p["mode"] for p in placements] == list(PLACEMENT_MODES)
    assert [p["planned"] for p in placements] == [row.endswith(" *") for row in rows]
    assert all(set(p) == {"mode", "iteration_s", "planned", "problem"} for p in placements)


def test_optimus_plan_profile_is_the_cost_model_profile_override(tmp_path, capsys):
    """--profile P prices the job as --override cost_model.profile=P does."""
    config, profile = str(CONFIGS / "gpu_single.yaml"), str(REPO / "profiles/h100_gpu_single.json")
    outputs = []
    for flags in (["--profile", profile], ["--override", f"cost_model.profile={profile}"], []):
        out_json = tmp_path / "plan.json"
        assert main(["--config", config, "--json", str(out_json), *flags]) == 0
        capsys.readouterr()
        outputs.append(json.loads(out_json.read_text())["placements"])
    assert outputs[0] == outputs[1] != outputs[2]


@pytest.mark.parametrize("job", ["config", "megatron flags"])
def test_optimus_plan_refuses_a_missing_profile_in_one_line(job, tmp_path, capsys):
    """--profile prices a job given as a config or as Megatron-LM flags alike."""
    given = (
        ["--config", str(CONFIGS / "tiny.yaml")]
        if job == "config"
        else ["--world-size", "4", "--", *MEGATRON_TINY_FLAGS]
    )
    assert main(["--profile", str(tmp_path / "none.json"), *given]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cost_model.profile" in err


def test_optimus_schedule_auto_trains_as_megatron_lm_does_where_optimus_gains_nothing():
    # one GPU, no pipeline: no bubbles, so Optimus's best ties Megatron-LM's placement
    config = load_config(CONFIGS / "gpu_single.yaml")
    artifact, line = flag_schedule("auto", config, plan(config))
    assert artifact is None
    assert line.startswith(
        "optimus: --optimus-schedule auto: Megatron-LM's placement (the vision model in the first "
        "pipeline stage, "
    )
    assert line.endswith("within the step noise of 0.0%; training as Megatron-LM does")
    # where the pipeline has bubbles Optimus gains, and the flag runs its schedule
    config = load_config(CONFIGS / "cpu" / "pp2_v1_heavy_vit.yaml")
    artifact, line = flag_schedule("auto", config, plan(config))
    assert artifact is not None and line.startswith(
        "optimus: --optimus-schedule auto: encoder plan"
    )
