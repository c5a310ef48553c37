"""The three placements a job can train under, each with its predicted iteration time, and the one
``optimus-train`` runs: what ``optimus-plan`` prints last and ``benchmarks/bench_e2e.py`` measures.

* ``megatron-lm``: Megatron-LM's placement, the encoders in the first pipeline stage
  (``optimus-train --baseline megatron-lm``).
* ``balanced``: encoder and LLM layers split together over the virtual stages
  (``--baseline balanced``).
* ``optimus``: the bubble scheduler's fastest schedule (``optimus-train`` with ``--schedule``, or
  with no flag when no baseline beats it).

The planned placement is ``best_schedule``'s choice, which ``optimus-train`` runs with no flag: the
fastest baseline where Optimus does not gain on it by more than the profile's step noise
(``optimus_gains``; a tie goes to the baseline), else Optimus.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from optimus_mllm.config import OptimusConfig
from optimus_mllm.costing.cost_model import CostModel
from optimus_mllm.planner import PlannerResult
from optimus_mllm.scheduler.baselines import (
    balanced_problem,
    megatron_lm_problem,
    runnable_baselines,
)
from optimus_mllm.scheduler.bubble_scheduler import OptimusResult

PlacementMode = Literal["megatron-lm", "balanced", "optimus"]
# bench_e2e's and optimus-train's order: the paper's baselines, then the method
PLACEMENT_MODES: tuple[PlacementMode, ...] = ("megatron-lm", "balanced", "optimus")


@dataclass(frozen=True)
class PlacementPrediction:
    """One placement of the job: its predicted iteration time, or why the job cannot run it."""

    mode: PlacementMode
    iteration_s: float | None  # None: the job cannot run it (``problem`` says why)
    planned: bool  # the placement optimus-train runs with no --baseline or --schedule
    problem: str | None = None


def predicted_placements(
    config: OptimusConfig, planned: PlannerResult, scheduled: OptimusResult, cost: CostModel
) -> list[PlacementPrediction]:
    """Every placement of ``PLACEMENT_MODES``, in that order, priced by ``cost``.

    Args:
        config: the job.
        planned: ``plan(config)``.
        scheduled: ``best_schedule(config, planned, cost)``.
        cost: the cost model the schedule was made with (the profile's, where one is given).

    Returns:
        One prediction per mode; exactly one is planned when the job can run any placement.
    """
    if scheduled.baseline is not None:
        chosen: PlacementMode | None = _mode(scheduled.baseline.runtime)
    else:
        chosen = "optimus" if scheduled.best is not None else None
    runnable = {b.runtime: b for b in runnable_baselines(config, planned.llm_plan, cost)}
    found = []
    for mode in PLACEMENT_MODES:
        if mode == "optimus":
            best = scheduled.best
            seconds = None if best is None else best.iteration_us / 1e6
            problem = None if best is not None else "no encoder plan could be scheduled"
        else:
            baseline = runnable.get(mode)
            seconds = None if baseline is None else baseline.iteration_us / 1e6
            problem = None if baseline else _baseline_problem(mode, config, planned)
        found.append(PlacementPrediction(mode, seconds, mode == chosen, problem))
    return found


def _mode(runtime: str) -> PlacementMode:
    """The placement mode of a baseline's ``optimus-train --baseline`` value."""
    modes: dict[str, PlacementMode] = {"megatron-lm": "megatron-lm", "balanced": "balanced"}
    return modes[runtime]


def _baseline_problem(mode: PlacementMode, config: OptimusConfig, planned: PlannerResult) -> str:
    """Why the job cannot run the baseline ``mode`` (not among ``runnable_baselines``)."""
    llm_plan = planned.llm_plan
    problem = (
        megatron_lm_problem(config, llm_plan)
        if mode == "megatron-lm"
        else balanced_problem(config, llm_plan)
    )
    # baseline_placements leaves a baseline out only for these problems, runnable_baselines also
    # for memory
    return problem or (
        f"does not fit in cluster.gpu_memory_gib={config.cluster.gpu_memory_gib:g} GiB"
    )
