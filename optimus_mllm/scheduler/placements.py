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
OPTIMUS: PlacementMode = "optimus"


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
    seconds: dict[str, float] = {
        b.runtime: b.iteration_us / 1e6 for b in runnable_baselines(config, planned.llm_plan, cost)
    }
    if scheduled.best is not None:
        seconds[OPTIMUS] = scheduled.best.iteration_us / 1e6
    # optimus-train's choice: the baseline best_schedule returned, else Optimus where it scheduled
    chosen = scheduled.baseline.runtime if scheduled.baseline is not None else OPTIMUS
    return [
        PlacementPrediction(
            mode,
            seconds.get(mode),
            mode == chosen and mode in seconds,
            None if mode in seconds else _problem(mode, config, planned),
        )
        for mode in PLACEMENT_MODES
    ]


# why a baseline placement cannot run, by mode (runnable_baselines also rules out what does not fit)
_BASELINE_PROBLEMS = {"megatron-lm": megatron_lm_problem, "balanced": balanced_problem}


def _problem(mode: PlacementMode, config: OptimusConfig, planned: PlannerResult) -> str:
    """Why the job cannot run the placement ``mode``."""
    if mode not in _BASELINE_PROBLEMS:
        return "no encoder plan could be scheduled"
    problem = _BASELINE_PROBLEMS[mode](config, planned.llm_plan)
    return problem or (
        f"does not fit in cluster.gpu_memory_gib={config.cluster.gpu_memory_gib:g} GiB"
    )
