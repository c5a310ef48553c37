"""The schedule's host work per LLM op: where the timeline adds it, the run the profile fits it
to, the fit against the timeline's own arithmetic, and how a profile carries it."""

from __future__ import annotations

import json

import pytest

from optimus_mllm.config import load_config
from optimus_mllm.costing.cost_model import (
    KERNEL_SET,
    PROFILE_FORMAT,
    PROFILE_VERSION,
    CostModel,
    read_machine_profile,
)
from optimus_mllm.errors import OptimusError
from optimus_mllm.planner import plan
from optimus_mllm.scheduler.baselines import megatron_lm_baseline
from optimus_mllm.scheduler.llm_costs import build_llm_timeline
from optimus_mllm.scheduler.step_host import FIT_TOLERANCE_US, fit_config, fit_microbatch_host_us

from support.paths import CONFIGS

TP2 = CONFIGS / "cpu" / "tp2.yaml"  # no pipeline: a step is its ops back to back
PP2_V2 = CONFIGS / "cpu" / "pp2_v2_heavy_vit.yaml"


def test_each_llm_op_ends_its_host_work_after_its_kernels():
    config = load_config(PP2_V2)
    llm_plan = plan(config).llm_plan
    cost = CostModel.from_config(config)
    plain = build_llm_timeline(config, llm_plan, cost)
    hosted = build_llm_timeline(config, llm_plan, cost.with_microbatch_host(500.0))
    assert cost.microbatch_host_us == 0.0  # a copy took the host time
    for before, after in zip(plain.stages, hosted.stages):
        for a, b in zip(before.ops, after.ops):
            assert b.end_us - b.start_us == pytest.approx(a.end_us - a.start_us + 500.0)
    assert hosted.work == plain.work  # the kernels keep their offsets in their ops
    # the host work is busy time, no bubble for the encoder: the CPU thread runs it
    for stage in range(llm_plan.pp):
        compute = hosted.kernel_intervals(stage)[0]
        assert all((op.end_us - 500.0, op.end_us) in compute for op in hosted.stages[stage].ops)
        assert len(compute) == len(plain.kernel_intervals(stage)[0]) + len(hosted.stages[stage].ops)
    ops = 2 * llm_plan.vp * config.num_microbatches_total
    # at least a stage's ops in sequence, at most every op of the pipeline
    assert ops * 500 <= hosted.iteration_us - plain.iteration_us <= llm_plan.pp * ops * 500


def test_the_fit_runs_half_the_microbatches_on_synthetic_data_where_the_pipeline_allows():
    config = load_config(CONFIGS / "cpu" / "pp2_v2_varying_images.yaml")
    llm_plan = plan(config).llm_plan
    assert (llm_plan.pp, llm_plan.vp, config.num_microbatches_total) == (2, 2, 8)
    fit = fit_config(config, llm_plan)
    assert fit.num_microbatches_total == 4 and fit.data.path is None
    assert fit.data.images_per_sample is None and fit.model == config.model

    def microbatches(gbs: int) -> int:
        job = load_config(PP2_V2, [f"training.global_batch_size={gbs}"])
        return fit_config(job, llm_plan).num_microbatches_total

    # interleaving needs a multiple of pp microbatches, and every count at least pp
    assert [microbatches(gbs) for gbs in (2, 4, 6, 12)] == [2, 2, 6, 6]
    dp2 = load_config(CONFIGS / "cpu" / "dp2.yaml")
    dp2_plan = plan(dp2).llm_plan
    assert dp2_plan.dp == 2
    fit = fit_config(dp2, dp2_plan)
    assert fit.num_microbatches_total == dp2.num_microbatches_total // 2


def test_without_a_pipeline_the_fit_is_the_missing_time_over_the_ops():
    """TP2, no pipeline: every op runs back to back on each rank, so the host work per op is the
    step's missing time over its 2 x microbatches ops, whatever the timeline's bisection does."""
    config = load_config(TP2)
    llm_plan = plan(config).llm_plan
    assert (llm_plan.pp, llm_plan.dp) == (1, 1)
    cost = CostModel.from_config(config)
    predicted = megatron_lm_baseline(config, llm_plan, cost).iteration_us
    ops = 2 * config.num_microbatches_total
    for missing in (1_000.0, 250_000.0):
        fitted = fit_microbatch_host_us(config, llm_plan, cost, predicted + missing)
        assert fitted == pytest.approx(missing / ops, abs=FIT_TOLERANCE_US)
    # a step measured faster than its kernels adds nothing: never a negative host time
    assert fit_microbatch_host_us(config, llm_plan, cost, predicted * 0.9) == 0.0


def test_with_a_pipeline_the_fitted_host_work_predicts_the_measured_step():
    config = load_config(PP2_V2)
    llm_plan = plan(config).llm_plan
    cost = CostModel.from_config(config)
    measured = megatron_lm_baseline(config, llm_plan, cost).iteration_us * 1.3
    fitted = fit_microbatch_host_us(config, llm_plan, cost, measured)
    ops = 2 * llm_plan.vp * config.num_microbatches_total
    hosted = megatron_lm_baseline(config, llm_plan, cost.with_microbatch_host(fitted))
    assert hosted.iteration_us == pytest.approx(measured, abs=llm_plan.pp * ops * FIT_TOLERANCE_US)


def _profile(tmp_path, **header):
    path = tmp_path / "profile.json"
    data = {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, "kernel_set": KERNEL_SET}
    path.write_text(json.dumps({**data, "kernels": [], **header}))
    return path


def test_a_profile_carries_its_host_work_per_op_into_the_cost_model(tmp_path):
    assert read_machine_profile(_profile(tmp_path)).microbatch_host_us == 0.0
    fitted = {"microbatches": 4, "measured_step_us": 9e5, "predicted_step_us": 8e5}
    path = _profile(tmp_path, step_host={**fitted, "microbatch_host_us": 9210.5})
    assert read_machine_profile(path).microbatch_host_us == 9210.5
    config = load_config(TP2, [f"cost_model.profile={path}"])
    assert CostModel.from_config(config).microbatch_host_us == 9210.5
    for bad in (-1.0, float("nan"), "x"):
        path = _profile(tmp_path, step_host={**fitted, "microbatch_host_us": bad})
        with pytest.raises(
            OptimusError, match=r"step_host.microbatch_host_us .* re-run optimus-pr"
        ):
            read_machine_profile(path)
