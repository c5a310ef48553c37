"""Variable images per iteration: a static bubble schedule against one rebuilt for every iteration.

    python benchmarks/bench_dynamic.py [--iterations N] [--configs NAME ...] [--json OUT]

Draws ``--iterations`` iterations (100 by default, seed 0) from a skewed image distribution, 0-8
images per sample (``IMAGES_PER_SAMPLE``, mean 1.9), each image of 64, 144 or 256 patch tokens
(``TOKENS_PER_IMAGE``: 112, 168 and 224 px in 14 px patches; a microbatch's images run padded to its
largest), at the fig5_8gpu and strong_1536 shapes (configs/paper/; strong_1536 in its 256-token
reading, ViT-22B's own 224 px images without the 2x2 merge, so that memory holds the maximum of 8
images per sample: ``data.max_images_per_microbatch`` = 8 x micro_batch_size). The LLM's sequence
stays ``seq_length`` whatever the images (samples are packed), so only the encoder work varies.

Per iteration it simulates, with the cost model's kernel times:
- ``megatron``: Megatron-LM, every encoder in the first stage's pre-process, each microbatch with
  its own images;
- ``balanced``: Megatron-LM balanced, its layer split made for the maximum, each microbatch with its
  own images (``-`` where the runtime cannot run it under the LLM plan);
- ``static-max``: Optimus with one schedule, sized for the maximum: it holds for every iteration,
  which takes its planned time;
- ``static-mean``: Optimus with one schedule sized for the mean microbatch. A heavier microbatch's
  chains run longer than their slots; the model here: each encoder stage's overrun (the chains'
  excess over the planned ones, summed over the microbatches it runs) is exposed, the largest one
  lengthening the iteration. A lighter iteration takes the planned time (its slots are reserved);
- ``per-iteration``: Optimus re-scheduled for each iteration's images (``per_iteration``: its
  imageless microbatches first, its images as encoder microbatches of the heaviest microbatch's
  count, half or a quarter of it, whichever schedules fastest), the fallback (static-max) where its
  own schedule is not faster or is late: not built (in its thread's CPU time) within the
  simulated time of the iteration before, while which it is built.
All Optimus policies use the encoder plan ``optimus-plan`` chooses for the distribution
(``rank_by_expected_time``). ``scheduler_share``: the per-iteration scheduler's time per iteration
(its thread's CPU time, on one core; a reused schedule costs nothing) as a share of the mean
simulated step; 0 for the static policies (scheduled once) and the baselines. Under the table, for
a setup where no iteration can beat static-max because the schedule for the maximum already takes
only what the encoder adds whatever its images (its DP collectives), a line saying so with the
numbers (``why_no_faster_than_max``). The ``per-iteration`` row is what the training runtime runs
(``runtime/iteration_schedules``: the same reordering and splits, each schedule a schedule
artifact). The default 100 iterations take about 50 s of CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from optimus_mllm.config import OptimusConfig, load_config
from optimus_mllm.config.files import atomic_write_text
from optimus_mllm.costing.cost_model import CostModel
from optimus_mllm.costing.workload import (
    EncoderWorkload,
    IterationWorkload,
    WorkloadDistribution,
    draw_iterations,
)
from optimus_mllm.planner import PlannerResult, plan
from optimus_mllm.planner.planner import EncoderPlanCandidate
from optimus_mllm.scheduler.baselines import balanced_problem
from optimus_mllm.scheduler.bubble_scheduler import Schedule, bubble_scheduler
from optimus_mllm.scheduler.dependencies import EPS_US, get_enc_llm_dep
from optimus_mllm.scheduler.encoder_costs import build_encoder_work
from optimus_mllm.scheduler.expected import baseline_iteration_us, rank_by_expected_time
from optimus_mllm.scheduler.fine import LLMBubbles
from optimus_mllm.scheduler.per_iteration import IterationSchedule, IterationScheduler

PAPER_CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "paper"
CONFIGS = ("fig5_8gpu", "strong_1536")
POLICIES = ("megatron", "balanced", "static-mean", "static-max", "per-iteration")
IMAGES_PER_SAMPLE = {
    0: 0.30,
    1: 0.25,
    2: 0.15,
    3: 0.10,
    4: 0.08,
    5: 0.05,
    6: 0.03,
    7: 0.02,
    8: 0.02,
}
TOKENS_PER_IMAGE = {64: 0.3, 144: 0.3, 256: 0.4}
MAX_IMAGES_PER_SAMPLE = max(IMAGES_PER_SAMPLE)
# strong_1536 in ViT-22B's own 256-token reading (benchmarks/bench_scheduler.py's second reading)
READINGS = {
    "strong_1536": ("model.encoders.0.seq_length=256", "model.encoders.0.projector.spatial_merge=1")
}


@dataclass(frozen=True)
class Row:
    config: str
    policy: str
    mean_iteration_s: float | None  # None: the policy cannot run here
    scheduler_share: float
    note: str = ""


def job_config(name: str, root: Path = PAPER_CONFIGS) -> OptimusConfig:
    """The setup with the bench's distribution and planned maximum."""
    base = load_config(root / f"{name}.yaml", READINGS.get(name, ()))
    most = MAX_IMAGES_PER_SAMPLE * base.training.micro_batch_size
    histogram = lambda h: "{" + ", ".join(f"{k}: {v}" for k, v in h.items()) + "}"  # noqa: E731
    overrides = (
        *READINGS.get(name, ()),
        f"data.max_images_per_microbatch={most}",
        f"data.images_per_sample={histogram(IMAGES_PER_SAMPLE)}",
        f"data.tokens_per_image={histogram(TOKENS_PER_IMAGE)}",
    )
    return load_config(root / f"{name}.yaml", overrides)


def bench(
    name: str, iterations: int, seed: int = 0, root: Path = PAPER_CONFIGS
) -> tuple[list[Row], dict[str, list[float]], str]:
    """Every policy's rows, each policy's iteration times in seconds (per iteration), and why
    per-iteration scheduling cannot beat static-max here (``why_no_faster_than_max``; "" where it
    can)."""
    config = job_config(name, root)
    planned = plan(config)
    cost = CostModel.from_config(config)
    distribution = WorkloadDistribution.of_config(config)
    drawn = draw_iterations(config, distribution, iterations, planned.num_microbatches, seed)
    chosen = rank_by_expected_time(config, planned, cost, distribution).best
    if chosen is None:
        raise SystemExit(f"{name}: no encoder plan schedules the planned maximum")
    maximum = distribution.maximum(config)
    # each baseline as optimus-plan prices it over its own draws (``expected``)
    baselines = {"megatron": "megatron-lm"}
    if balanced_problem(config, planned.llm_plan) is None:
        baselines["balanced"] = "balanced"
    times: dict[str, list[float]] = {
        policy: [
            us / 1e6
            for us in baseline_iteration_us(runtime, config, planned.llm_plan, cost, drawn, maximum)
        ]
        for policy, runtime in baselines.items()
    }
    fallback = chosen.fallback
    times["static-max"] = [fallback.iteration_us / 1e6] * len(drawn)
    times["static-mean"] = _static_mean(
        config, planned, chosen.candidate, cost, distribution, drawn
    )
    times["per-iteration"], cpu_s, late, own = _per_iteration(
        config, planned, chosen.candidate, cost, fallback, drawn
    )
    why = why_no_faster_than_max(
        name, config, planned, chosen.candidate, cost, fallback, maximum, own
    )
    rows = []
    for policy in POLICIES:
        if policy not in times:
            rows.append(Row(name, policy, None, 0.0, "not runnable under this LLM plan"))
            continue
        mean = sum(times[policy]) / len(times[policy])
        if policy == "per-iteration":
            share = sum(cpu_s) / len(cpu_s) / mean
            note = f"{late} of {len(drawn)} iterations late (ran the fallback)"
            rows.append(Row(name, policy, mean, share, note))
        else:
            rows.append(Row(name, policy, mean, 0.0))
    return rows, times, why


def why_no_faster_than_max(
    name: str,
    config: OptimusConfig,
    planned: PlannerResult,
    candidate: EncoderPlanCandidate,
    cost: CostModel,
    fallback: Schedule,
    maximum: EncoderWorkload,
    own_schedules: int,
) -> str:
    """Where the schedule for the maximum takes only what the encoder adds whatever its images
    (the LLM alone, then the encoder's parameter all-gather before the LLM's first computation and
    its gradient reduce-scatter after the last: every encoder kernel runs in the LLM's bubbles), a
    lighter iteration has nothing left to gain; the line saying so, or "" where that is not so, or
    where some iteration ran a schedule of its own (``own_schedules``)."""
    work = build_encoder_work(config, planned.llm_plan, candidate.plan, cost, maximum)
    llm_us = fallback.timeline.iteration_us
    floor_us = llm_us + work.dp_all_gather_us + work.dp_reduce_scatter_us
    if own_schedules or fallback.iteration_us > floor_us + EPS_US:
        return ""
    return (
        f"{name}: per-iteration = static-max: the schedule for the maximum takes "
        f"{fallback.iteration_us / 1e6:.4f} s, the LLM alone ({llm_us / 1e6:.4f} s) plus the "
        f"encoder's parameter all-gather ({work.dp_all_gather_us / 1e3:.1f} ms) and gradient "
        f"reduce-scatter ({work.dp_reduce_scatter_us / 1e3:.1f} ms): its work on the images runs "
        "wholly in the LLM's bubbles, and those collectives scale with its parameters, not its "
        "images; no iteration's own schedule was faster"
    )


def _static_mean(
    config: OptimusConfig,
    planned: PlannerResult,
    candidate: EncoderPlanCandidate,
    cost: CostModel,
    distribution: WorkloadDistribution,
    drawn: list[IterationWorkload],
) -> list[float]:
    """The schedule for the mean microbatch, each iteration lengthened by its largest exposed
    stage overrun (the module's model)."""
    mean = distribution.mean(config)
    bubbles = LLMBubbles.of(get_enc_llm_dep(config, planned.llm_plan, cost))
    schedule, _ = bubble_scheduler(
        config,
        planned.llm_plan,
        candidate,
        bubbles,
        cost,
        workload=(mean,) * planned.num_microbatches,
    )
    chain_us: dict[EncoderWorkload, list[float]] = {}

    def stage_us(workload: EncoderWorkload) -> list[float]:
        if workload not in chain_us:
            work = build_encoder_work(config, planned.llm_plan, candidate.plan, cost, workload)
            chain_us[workload] = [f.duration_us + b.duration_us for f, b in zip(work.fwd, work.bwd)]
        return chain_us[workload]

    planned_us = stage_us(mean)
    times = []
    for workload in drawn:
        overrun: dict[tuple[int, int], float] = {}
        # data microbatch i runs in LLM slot i, its encoder work on the slot's pipeline
        for w, (pipeline, _) in zip(workload, schedule.assignment):
            for e, (actual, slot) in enumerate(zip(stage_us(w), planned_us)):
                overrun[(pipeline, e)] = overrun.get((pipeline, e), 0.0) + max(0.0, actual - slot)
        times.append((schedule.iteration_us + max(overrun.values(), default=0.0)) / 1e6)
    return times


def _per_iteration(
    config: OptimusConfig,
    planned: PlannerResult,
    candidate: EncoderPlanCandidate,
    cost: CostModel,
    fallback: Schedule,
    drawn: list[IterationWorkload],
) -> tuple[list[float], list[float], int, int]:
    """Each iteration's time under its own schedule (or the fallback), the scheduler's time for
    it, how many iterations were late, and how many had a schedule of their own faster than the
    fallback (late or not)."""
    inner = IterationScheduler.for_plan(config, planned.llm_plan, candidate, cost, fallback)
    cpu: list[float] = []

    def timed(workload: IterationWorkload) -> IterationSchedule | None:
        # the scheduler thread's own CPU time: what scheduling costs, whatever else shares the
        # machine's cores
        started = time.thread_time()
        schedule = inner.build(workload)
        cpu.append(time.thread_time() - started)
        return schedule

    scheduler = IterationScheduler(timed, fallback)
    times, cpu_per_iteration = [], []
    previous_s = float("inf")  # the first iteration's schedule is built before training starts
    late_iterations = own_schedules = 0
    for k, workload in enumerate(drawn):
        built = len(cpu)
        scheduler.submit(k, workload)
        # the bench waits for every build to time it, then applies the deadline it simulates:
        # iteration k's schedule is built while iteration k - 1 runs
        taken = scheduler.take(k, wait_s=3600.0)
        cpu_per_iteration.append(sum(cpu[built:]))
        late = cpu_per_iteration[-1] > previous_s
        late_iterations += late
        own_schedules += taken.source == "per-iteration"
        times.append((fallback if late else taken.schedule).iteration_us / 1e6)
        previous_s = times[-1]
    scheduler.close()
    inner.close()
    return times, cpu_per_iteration, late_iterations, own_schedules


def print_table(rows: list[Row]) -> None:
    print(
        f"{'config':<14}{'policy':<15}{'mean iteration s':>17}{'vs megatron':>13}"
        f"{'scheduler share':>17}"
    )
    megatron = {r.config: r.mean_iteration_s for r in rows if r.policy == "megatron"}
    for r in rows:
        if r.mean_iteration_s is None:
            print(f"{r.config:<14}{r.policy:<15}{'-':>17}{'':>13}{'':>17}  {r.note}")
            continue
        speedup = megatron[r.config] / r.mean_iteration_s
        print(
            f"{r.config:<14}{r.policy:<15}{r.mean_iteration_s:>17.4f}{speedup:>12.3f}x"
            f"{r.scheduler_share:>16.2%}" + (f"  {r.note}" if r.note else "")
        )


def write_json(rows: list[Row], path: str) -> None:
    """The rows as a JSON list of {"config", "policy", "mean_iteration_s", "scheduler_share"}."""
    keys = ("config", "policy", "mean_iteration_s", "scheduler_share")
    table = [{key: getattr(r, key) for key in keys} for r in rows]
    atomic_write_text(path, json.dumps(table, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=100)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), metavar="NAME")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="OUT")
    args = parser.parse_args(argv)
    if args.iterations < 1:
        parser.error("--iterations: give at least 1")
    histogram = ", ".join(f"{k}: {v:g}" for k, v in IMAGES_PER_SAMPLE.items())
    print(
        f"{args.iterations} iterations (seed {args.seed}); images per sample {{{histogram}}}; "
        f"tokens per image {TOKENS_PER_IMAGE}"
    )
    rows: list[Row] = []
    notes = []
    for name in args.configs:
        found, _, why = bench(name, args.iterations, args.seed)
        rows += found
        notes += [why] if why else []
    print_table(rows)
    for note in notes:
        print(note)
    if args.json:
        write_json(rows, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
