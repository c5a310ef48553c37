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
(``optimus_gains``; a tie goes to the baseline), else Optimus. For a job whose images vary
(``data.images_per_sample``) the same rule decides on each placement's mean over drawn iterations
(``expected.rank_by_expected_time``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from optimus_mllm.config import OptimusConfig
from optimus_mllm.costing.cost_model import CostModel
from optimus_mllm.costing.workload import WorkloadDistribution
from optimus_mllm.planner import PlannerResult
from optimus_mllm.scheduler.baselines import (
    BaselineResult,
    balanced_problem,
    megatron_lm_problem,
    runnable_baselines,
)
from optimus_mllm.scheduler.bubble_scheduler import OptimusResult, Schedule, best_schedule
from optimus_mllm.scheduler.expected import ExpectedRanking, rank_by_expected_time

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
    config: OptimusConfig,
    planned: PlannerResult,
    scheduled: OptimusResult,
    cost: CostModel,
    expected: ExpectedRanking | None = None,
) -> list[PlacementPrediction]:
    """Every placement of ``PLACEMENT_MODES``, in that order, priced by ``cost``.

    Args:
        config: the job.
        planned: ``plan(config)``.
        scheduled: ``best_schedule(config, planned, cost)``.
        cost: the cost model the schedule was made with (the profile's, where one is given).
        expected: for a job with ``data.images_per_sample``, ``rank_by_expected_time``: each
            placement's mean over its drawn iterations, and its choice, replace ``scheduled``'s.

    Returns:
        One prediction per mode; exactly one is planned when the job can run any placement.
    """
    if expected is not None:
        seconds = {b.baseline.runtime: b.expected_us / 1e6 for b in expected.baselines}
        if expected.best is not None:
            seconds[OPTIMUS] = expected.best.expected_us / 1e6
        chosen = expected.baseline.baseline.runtime if expected.baseline is not None else OPTIMUS
    else:
        seconds = {
            b.runtime: b.iteration_us / 1e6
            for b in runnable_baselines(config, planned.llm_plan, cost)
        }
        if scheduled.best is not None:
            seconds[OPTIMUS] = scheduled.best.iteration_us / 1e6
        # optimus-train's choice: the baseline best_schedule returned, else Optimus where it
        # scheduled
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


@dataclass(frozen=True)
class JobPlacements:
    """What a job trains under and why: ``optimus-plan`` prints it, ``optimus-train`` (no flag)
    runs it, ``benchmarks/bench_e2e.py`` measures it -- one decision for all three."""

    scheduled: OptimusResult  # ``best_schedule`` at the config's own workload
    # for a job with ``data.images_per_sample``: the plans and baselines over drawn iterations,
    # whose choice replaces ``scheduled``'s
    expected: ExpectedRanking | None
    # the schedule an Optimus run trains (the artifact): ``scheduled``'s best, or for varying
    # images the expected-fastest plan's schedule for the maximum (its per-iteration fallback)
    schedule: Schedule | None
    placements: list[PlacementPrediction]

    @property
    def baseline(self) -> BaselineResult | None:
        """The baseline the job runs instead of Optimus; None: Optimus (or nothing can run)."""
        if self.expected is not None:
            return self.expected.baseline.baseline if self.expected.baseline else None
        return self.scheduled.baseline

    def predicted_s(self, mode: PlacementMode) -> float | None:
        """``mode``'s predicted iteration time (mean over the drawn iterations for varying
        images), None where the job cannot run it."""
        return next(p.iteration_s for p in self.placements if p.mode == mode)


def job_placements(config: OptimusConfig, planned: PlannerResult, cost: CostModel) -> JobPlacements:
    """The job's placements priced by ``cost``, its schedule and the one it runs (see
    ``JobPlacements``)."""
    scheduled = best_schedule(config, planned, cost)
    distribution = WorkloadDistribution.of_config(config)
    expected = None
    schedule = scheduled.best
    if distribution is not None:
        expected = rank_by_expected_time(config, planned, cost, distribution)
        schedule = expected.best.fallback if expected.best is not None else None
    placements = predicted_placements(config, planned, scheduled, cost, expected)
    return JobPlacements(scheduled, expected, schedule, placements)


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
