"""Time real training steps of Megatron-LM's placement on the job's ranks: what optimus-profile
fits the schedule's host work per LLM op to (``scheduler/step_host.py``)."""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

from optimus_mllm.config import OptimusConfig
from optimus_mllm.planner.plans import ParallelPlan

STEP_WARMUP = 1  # the first step also builds what the runtime caches
STEP_REPEATS = 3


def measure_baseline_step_us(config: OptimusConfig, llm_plan: ParallelPlan) -> float:
    """The median of ``STEP_REPEATS`` steps of the runtime's Megatron-LM placement after
    ``STEP_WARMUP``, each ended by a barrier so that every rank's clock covers the whole step.
    Needs the job's process group, every rank calling."""
    import torch.distributed as dist

    from optimus_mllm.runtime.trainer import Trainer

    steps = STEP_WARMUP + STEP_REPEATS
    config = replace(config, training=replace(config.training, train_iters=steps))
    trainer = Trainer(config, llm_plan, "baseline", None)
    times = []
    try:
        for i in range(steps):
            started = time.perf_counter()
            trainer.train_step(i)
            dist.barrier()
            times.append(time.perf_counter() - started)
    finally:
        trainer.close()
    return statistics.median(times[STEP_WARMUP:]) * 1e6
