"""The host work of megatron-core's pipeline schedule around each LLM op, fitted to a real step.

optimus-profile measures the kernels, each layer's host work around them, the job's communication
and the optimizer step one by one. What a real step spends beyond those -- megatron-core's schedule
around every chunk's forward and backward: its P2P calls, the microbatch's data, the loss, the
gradient hooks -- only a real step shows. So the profile also times a few training steps of
Megatron-LM's placement (the runtime's baseline) on the job's ranks, at half the job's microbatches
where its pipeline allows (``fit_config``), and ``fit_microbatch_host_us`` finds the host time per
LLM op that makes that run's predicted step its measured one. Every prediction from the profile --
the job's own microbatches, every placement -- then adds it after each LLM op
(``CostModel.microbatch_host_us``), so none of the job's own step times is fitted.
"""

from __future__ import annotations

from dataclasses import replace

from optimus_mllm.config import DataConfig, OptimusConfig
from optimus_mllm.costing.cost_model import CostModel
from optimus_mllm.planner.plans import ParallelPlan
from optimus_mllm.scheduler.baselines import megatron_lm_baseline

FIT_TOLERANCE_US = 1.0  # the bisection stops within this of the host time per op


def fit_config(config: OptimusConfig, llm_plan: ParallelPlan) -> OptimusConfig:
    """The run the fit measures: the job on synthetic data (one image a sample: the host work per
    op is the schedule's, not the data's) at half its microbatches per replica where that count
    still fills the pipeline (at least ``pp``, a multiple of it under interleaving, as megatron-core
    requires), else at its own."""
    t = config.training
    per_replica = config.num_microbatches_total // llm_plan.dp
    half = per_replica // 2
    fills = per_replica % 2 == 0 and half >= llm_plan.pp
    if llm_plan.vp > 1:
        fills = fills and half % llm_plan.pp == 0
    microbatches = half if fills else per_replica
    training = replace(t, global_batch_size=microbatches * t.micro_batch_size * llm_plan.dp)
    return replace(config, training=training, data=DataConfig())


def fit_microbatch_host_us(
    config: OptimusConfig, llm_plan: ParallelPlan, cost: CostModel, measured_us: float
) -> float:
    """The host time per LLM op at which ``cost`` predicts Megatron-LM's placement of ``config``
    to take ``measured_us`` a step (0 where it predicts that much without any).

    The predicted step grows with the host time per op, by at least the ops a stage runs in
    sequence: the answer lies between 0 and the measured step over them, found by bisection."""

    def predicted_us(host_us: float) -> float:
        with_host = cost.with_microbatch_host(host_us)
        return megatron_lm_baseline(config, llm_plan, with_host).iteration_us

    if predicted_us(0.0) >= measured_us:
        return 0.0
    ops_per_stage = 2 * llm_plan.vp * (config.num_microbatches_total // llm_plan.dp)
    low, high = 0.0, measured_us / ops_per_stage
    while high - low > FIT_TOLERANCE_US:
        middle = (low + high) / 2
        if predicted_us(middle) < measured_us:
            low = middle
        else:
            high = middle
    return (low + high) / 2
