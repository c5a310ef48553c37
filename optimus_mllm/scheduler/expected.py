"""Planning for a workload distribution: encoder plans ranked by expected iteration time.

With ``data.images_per_sample`` in the config, ``optimus-plan`` draws ``EXPECTED_ITERATIONS``
iterations from it (seeded by ``training.seed``, the same every run) and runs each plan's bubble
scheduler on each, as the per-iteration scheduler would (``per_iteration``): an iteration whose own
schedule does not exist or is slower runs the plan's fallback, its schedule for the planned maximum
(``data.max_images_per_microbatch``). A plan's expected time is the mean over the drawn iterations;
the fastest plan's fallback is the schedule ``optimus-plan`` writes. The baselines the runtime can
run are priced over the same iterations, each microbatch with its own images (balanced split for
the maximum, as ``benchmarks/bench_dynamic.py`` prices them), and the never-slower rule
(``optimus_gains``) decides between them and that plan on those means: what ``optimus-plan`` prints
as planned and ``optimus-train`` runs. No torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from optimus_mllm.config import OptimusConfig
from optimus_mllm.costing.cost_model import CostModel
from optimus_mllm.costing.workload import (
    EncoderWorkload,
    IterationWorkload,
    WorkloadDistribution,
    draw_iterations,
    llm_order,
)
from optimus_mllm.planner.planner import EncoderPlanCandidate, PlannerResult
from optimus_mllm.planner.plans import ParallelPlan
from optimus_mllm.scheduler.baselines import (
    BaselineResult,
    megatron_lm_balanced_baseline,
    megatron_lm_baseline,
    runnable_baselines,
)
from optimus_mllm.scheduler.bubble_scheduler import (
    ChainMoves,
    Schedule,
    bubble_scheduler,
    optimus_gains,
)
from optimus_mllm.scheduler.dependencies import get_enc_llm_dep
from optimus_mllm.scheduler.fine import LLMBubbles
from optimus_mllm.scheduler.per_iteration import schedule_iteration

# enough for a stable ranking of plans within seconds (each iteration is one scheduler run a plan)
EXPECTED_ITERATIONS = 8


@dataclass(frozen=True)
class ExpectedTime:
    """One encoder plan over the drawn iterations."""

    candidate: EncoderPlanCandidate
    expected_us: float  # mean iteration time
    fallback: Schedule  # its schedule for the planned maximum
    fallback_iterations: int  # drawn iterations that ran the fallback


@dataclass(frozen=True)
class ExpectedBaseline:
    """One baseline placement over the drawn iterations."""

    baseline: BaselineResult  # at the config's own workload: its runtime, memory and name
    expected_us: float  # mean iteration time, each microbatch with its own images


@dataclass(frozen=True)
class ExpectedRanking:
    distribution: WorkloadDistribution
    iterations: int
    seed: int
    ranked: tuple[ExpectedTime, ...]  # fastest expected first; plans without a fallback left out
    baselines: tuple[ExpectedBaseline, ...] = ()  # the runnable ones
    # the baseline the job runs: the fastest one the best plan does not gain on (``optimus_gains``
    # with the cost model's step noise); None: the best plan, or nothing where none schedules
    baseline: ExpectedBaseline | None = None

    @property
    def best(self) -> ExpectedTime | None:
        return self.ranked[0] if self.ranked else None


def rank_by_expected_time(
    config: OptimusConfig,
    planned: PlannerResult,
    cost: CostModel,
    distribution: WorkloadDistribution,
    iterations: int = EXPECTED_ITERATIONS,
) -> ExpectedRanking:
    """Every encoder plan's mean iteration time over ``iterations`` iterations drawn from
    ``distribution``, each scheduled for its own workload."""
    seed = config.training.seed
    drawn = draw_iterations(config, distribution, iterations, planned.num_microbatches, seed)
    bubbles = LLMBubbles.of(get_enc_llm_dep(config, planned.llm_plan, cost))
    maximum = (distribution.maximum(config),) * planned.num_microbatches
    rows = []
    for candidate in planned.candidates:
        chains = ChainMoves(config, planned.llm_plan, candidate.plan, bubbles, cost)
        fallback, _ = bubble_scheduler(
            config, planned.llm_plan, candidate, bubbles, cost, workload=maximum, chains=chains
        )
        if fallback is None:
            continue
        times, fell_back = [], 0
        for workload in drawn:
            ordered = tuple(workload[i] for i in llm_order(workload))
            own = schedule_iteration(
                config, planned.llm_plan, candidate, bubbles, cost, ordered, chains=chains
            )
            if own is None or own.schedule.iteration_us > fallback.iteration_us:
                fell_back += 1
                times.append(fallback.iteration_us)
            else:
                times.append(own.schedule.iteration_us)
        rows.append(ExpectedTime(candidate, sum(times) / len(times), fallback, fell_back))
    rows.sort(key=lambda row: row.expected_us)
    baselines = tuple(
        expected_baseline(config, planned, cost, b, drawn, maximum[0])
        for b in runnable_baselines(config, planned.llm_plan, cost)
    )
    best = rows[0].expected_us if rows else None
    no_slower = [
        b
        for b in baselines
        if best is None or not optimus_gains(best, b.expected_us, cost.step_noise)
    ]
    baseline = min(no_slower, key=lambda b: b.expected_us, default=None)
    return ExpectedRanking(distribution, iterations, seed, tuple(rows), baselines, baseline)


def expected_baseline(
    config: OptimusConfig,
    planned: PlannerResult,
    cost: CostModel,
    baseline: BaselineResult,
    drawn: list[IterationWorkload],
    maximum: EncoderWorkload,
) -> ExpectedBaseline:
    """``baseline``'s mean iteration time over ``drawn`` (``baseline_iteration_us``)."""
    times = baseline_iteration_us(baseline.runtime, config, planned.llm_plan, cost, drawn, maximum)
    return ExpectedBaseline(baseline, sum(times) / len(times))


def baseline_iteration_us(
    runtime: str,
    config: OptimusConfig,
    llm_plan: ParallelPlan,
    cost: CostModel,
    drawn: list[IterationWorkload],
    maximum: EncoderWorkload,
) -> list[float]:
    """Each drawn iteration's time under the baseline ``runtime`` runs (``megatron-lm`` or
    ``balanced``), each microbatch with its own images in data order; balanced keeps one layer
    split, made for ``maximum``, as its runtime does."""
    at = _AT_WORKLOAD[runtime]
    return [at(config, llm_plan, cost, w, maximum).iteration_us for w in drawn]


# each baseline runtime's pricing of one drawn iteration: (config, LLM plan, cost, the iteration's
# workload, the planned maximum) -> its result
_AT_WORKLOAD: dict[str, Callable[..., BaselineResult]] = {
    "megatron-lm": lambda config, llm_plan, cost, w, _: megatron_lm_baseline(
        config, llm_plan, cost, w
    ),
    "balanced": lambda config, llm_plan, cost, w, maximum: megatron_lm_balanced_baseline(
        config, llm_plan, cost, workload=w, split_for=maximum
    ),
}
