"""``optimus-plan``: plan the job, schedule encoder work into the LLM's bubbles, print or save the
result.

The job is a YAML config (``--config``) or a Megatron-LM command line after ``--``::

    optimus-plan --world-size 4 --artifact plan.json -- --encoder-num-layers 2 ...

read as Megatron-LM reads it (``optimus_mllm.megatron.arguments``: its flags, defaults and
``validate_args``) and made into the config by ``config_from_megatron_args``, so that the artifact
is the one ``--optimus-schedule`` checks that job's flags against. The job's whole command line can
be given: its flags that do not shape the plan (data, tokenizer, checkpoints, logging, ...:
``optimus_mllm.megatron.unread_flags``) are accepted, and the output's first line names those it
did not read; any other flag is refused. Megatron-LM takes the world size from the launcher, so the
command needs it: ``--world-size`` (torchrun's ``--nnodes`` x ``--nproc-per-node``) and
``--gpus-per-node``.

With a workload distribution in the config (``data.images_per_sample``), the output adds encoder
plans ranked by expected iteration time over iterations drawn from it (``scheduler/expected.py``),
and the artifact, trace and plot are the expected-fastest plan's schedule for the planned maximum:
the fallback a per-iteration schedule falls back to.

The output ends with one line per placement (Megatron-LM's, balanced, Optimus: what
``optimus-train`` can run) and its predicted iteration time, the one ``optimus-train`` runs with no
flag marked (``scheduler/placements.py``); ``--profile`` prices them from a measured kernel profile.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from typing import Any

from optimus_mllm.cli.common import ArgumentParser, add_config_arguments, run
from optimus_mllm.config import OptimusConfig, load_config
from optimus_mllm.config.files import atomic_write_text
from optimus_mllm.costing.cost_model import CostModel
from optimus_mllm.costing.memory_model import GIB, MemoryBreakdown
from optimus_mllm.errors import OptimusError
from optimus_mllm.megatron.arguments import add_optimus_args
from optimus_mllm.megatron.arguments import build_parser as megatron_parser
from optimus_mllm.megatron.flags import config_from_megatron_args
from optimus_mllm.megatron.unread_flags import UNREAD_DEST, add_unread_flags
from optimus_mllm.planner import EncoderPlanCandidate, PlannerResult, plan
from optimus_mllm.scheduler.baselines import no_placement_problem
from optimus_mllm.scheduler.bubble_scheduler import OptimusResult, PlanOutcome
from optimus_mllm.scheduler.expected import ExpectedRanking
from optimus_mllm.scheduler.metrics import mfu, scheduling_efficiency
from optimus_mllm.scheduler.placements import PlacementPrediction, job_placements

PROG = "optimus-plan"
# what separates optimus-plan's own flags from a Megatron-LM command line
MEGATRON_SEPARATOR = "--"
RANKING = "simulated iteration time (bubble scheduler)"


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog=PROG,
        usage=f"{PROG} [--json OUT] [--artifact OUT] [--trace OUT] [--png OUT] [--profile P] "
        "(--config YAML [--override KEY=VALUE ...] | "
        "--world-size N [--gpus-per-node G] -- MEGATRON_FLAGS ...)",
        description="Choose the LLM plan, enumerate colocated encoder plans and "
        "schedule encoder work into the LLM's bubbles (Optimus).",
        epilog="The job is a YAML config, or a Megatron-LM pretrain_vlm.py command line after "
        "--, read with Megatron-LM's defaults and layer-count conventions "
        "(optimus_mllm/megatron/flags.py says what each flag becomes). It has no built model: "
        "the vision model is planned as pretrain_vlm.py builds it from the flags, where "
        "--optimus-schedule auto plans the one the job's provider built.",
    )
    add_config_arguments(parser, "configs/paper/strong_3072.yaml", required=False)
    parser.add_argument(
        "--world-size",
        type=int,
        metavar="N",
        help="with Megatron-LM flags: the job's ranks (torchrun's --nnodes x --nproc-per-node); "
        "required there",
    )
    parser.add_argument(
        "--gpus-per-node",
        type=int,
        metavar="G",
        help="with Megatron-LM flags: ranks per node (default 8, at most --world-size)",
    )
    parser.add_argument(
        "--profile",
        metavar="P",
        help="kernel profile (optimus-profile --out) to price the job with; the same as "
        "--override cost_model.profile=P",
    )
    parser.add_argument(
        "--json", metavar="OUT", help="also write the plans and their schedules as JSON"
    )
    parser.add_argument(
        "--artifact", metavar="OUT", help="write the chosen schedule for the runtime (JSON)"
    )
    parser.add_argument(
        "--trace", metavar="OUT", help="write the chosen schedule as a Chrome/Perfetto trace"
    )
    parser.add_argument(
        "--png", metavar="OUT", help="draw the chosen schedule's timeline (needs matplotlib)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    megatron_argv = None
    if MEGATRON_SEPARATOR in argv:
        at = argv.index(MEGATRON_SEPARATOR)
        argv, megatron_argv = argv[:at], argv[at + 1 :]
    parser = build_parser()
    args = parser.parse_args(argv)
    problem = usage_problem(args, megatron_argv)
    if problem is not None:
        parser.error(problem)

    def body() -> int:
        config, not_read = job_config(args, megatron_argv)
        planned = plan(config)
        cost = CostModel.from_config(config)
        job = job_placements(config, planned, cost)
        scheduled, expected, schedule = job.scheduled, job.expected, job.schedule
        if schedule is None and job.baseline is None:
            raise OptimusError(no_placement_problem(config, planned, cost))
        if (args.artifact or args.trace or args.png) and schedule is None:
            raise OptimusError(
                "no encoder plan could be scheduled, so there is no schedule to write; "
                "see the pruned plans"
            )
        if args.json:
            result = result_to_dict(planned, scheduled)
            result["placements"] = [asdict(p) for p in job.placements]
            if expected is not None:
                result["expected"] = expected_to_dict(expected)
            atomic_write_text(args.json, json.dumps(result, indent=2) + "\n")
        if args.artifact:
            from optimus_mllm.scheduler.artifact import write_artifact

            write_artifact(schedule, config, args.artifact)
        if args.trace:
            from optimus_mllm.scheduler.trace import write_trace

            write_trace(schedule, args.trace)
        if args.png:
            from optimus_mllm.scheduler.plot import draw_schedule

            draw_schedule(schedule, args.png)
        if not_read:
            print(f"Megatron-LM flags not read (they do not shape the plan): {' '.join(not_read)}")
        sys.stdout.write(format_result(config, planned, scheduled))
        if expected is not None:
            sys.stdout.write(format_expected(expected))
        sys.stdout.write(format_placements(job.placements, expected is not None))
        return 0

    return run(PROG, body)


def usage_problem(args: argparse.Namespace, megatron_argv: list[str] | None) -> str | None:
    """What is wrong with how optimus-plan's own flags give the job, or None.

    Args:
        args: optimus-plan's own flags.
        megatron_argv: the flags after ``--``, or None without ``--``.
    """
    given = (("--world-size", args.world_size), ("--gpus-per-node", args.gpus_per_node))
    if megatron_argv is None:
        if args.config is None:
            return "give the job: --config YAML, or --world-size and Megatron-LM flags after --"
        megatron_only = [flag for flag, value in given if value is not None]
        if megatron_only:
            return (
                f"{megatron_only[0]}: goes with Megatron-LM flags after --; with --config, set "
                "cluster.num_gpus / cluster.gpus_per_node"
            )
        return None
    if args.config is not None:
        return "--config with Megatron-LM flags after --: give the job one way"
    if args.override:
        return "--override: applies to --config; with Megatron-LM flags, change the flag"
    if args.world_size is None:
        return (
            "--world-size is missing: the ranks the Megatron-LM job launches (torchrun's "
            "--nnodes x --nproc-per-node)"
        )
    for flag, value in given:
        if value is not None and value < 1:
            return f"{flag} {value}: must be a positive integer"
    return None


def job_config(
    args: argparse.Namespace, megatron_argv: list[str] | None
) -> tuple[OptimusConfig, list[str]]:
    """The job's config: ``--config`` (with ``--override``), or the Megatron-LM flags after ``--``
    (``args`` free of ``usage_problem``).

    Args:
        args: optimus-plan's own flags.
        megatron_argv: the flags after ``--``, or None without ``--``.

    Returns:
        The validated config, and the Megatron-LM flags given that it was not made from: those of
        ``optimus_mllm.megatron.unread_flags`` in the order given, then ``--optimus-schedule`` (none
        with ``--config``).
    """
    profile = [f"cost_model.profile={args.profile}"] if args.profile else []
    if megatron_argv is None:
        return load_config(args.config, [*args.override, *profile]), []
    # the job's own command line, pasted whole: --optimus-schedule and the flags that do not shape
    # the plan are taken too
    parser = megatron_parser(_taken_not_read, parser_class=_MegatronFlagsParser, prog=PROG)
    flags = parser.parse_args(megatron_argv)
    gpus_per_node = 8 if args.gpus_per_node is None else args.gpus_per_node
    config = config_from_megatron_args(flags, args.world_size, gpus_per_node)
    if args.profile:
        config = replace(config, cost_model=replace(config.cost_model, profile=args.profile))
    not_read = getattr(flags, UNREAD_DEST)
    if flags.optimus_schedule is not None:
        not_read = [*not_read, "--optimus-schedule"]
    return config, not_read


def _taken_not_read(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    return add_unread_flags(add_optimus_args(parser))


class _MegatronFlagsParser(ArgumentParser):
    """The Megatron-LM flags' parser, which says why a flag it does not know is refused."""

    def error(self, message: str) -> None:  # type: ignore[override]
        if message.startswith("unrecognized arguments:"):
            message += (
                "; optimus-plan refuses a flag it does not know, since it may change the model "
                "(those it takes unread: optimus_mllm/megatron/unread_flags.py)"
            )
        super().error(message)


def _gib(value: float) -> str:
    return f"{value / GIB:.2f}"


def _seconds(us: float) -> str:
    return f"{us / 1e6:.4f}"


def format_result(config: OptimusConfig, result: PlannerResult, scheduled: OptimusResult) -> str:
    best = scheduled.best
    lines = [
        f"config {result.config_name}: {result.num_gpus} GPUs of {result.gpu_memory_bytes / GIB:g} "
        "GiB",
        f"LLM plan ({result.llm_plan_origin}): {result.llm_plan}, {result.num_microbatches} "
        "microbatches per "
        f"LLM pipeline",
    ]
    for rejected in result.llm_rejected:
        lines.append(f"  tried first, rejected: {rejected.plan}: {rejected.reason}")
    lines.append(f"LLM alone: iteration {_seconds(scheduled.llm_alone_us)} s")
    candidates = {c.plan: c for c in result.candidates}
    lines += ["", f"encoder plans ({len(result.candidates)} fit in memory, ranked by {RANKING}):"]
    header = (
        f"{'rank':>4}  {'encoder plan':<16}{'m':>4}  {'iteration s':>13}  {'params':>7}{'grads':>7}"
        f"{'optim':>7}{'activ':>7}{'total':>8}  {'overhead':>8}  {'max mb':>6}  partitions"
    )
    lines += [header, "  " + "-" * (len(header) - 2)]
    for i, outcome in enumerate(scheduled.ranked, 1):
        c = candidates[outcome.plan]
        lines.append(
            f"{i:>4}  {str(c.plan):<16}{c.m:>4}  {_outcome_text(outcome):>13}  {_memory_columns(c)}"
        )
    lines += [
        "",
        "  iteration: best schedule found; '>= x' means the plan's lower bound x cannot beat rank "
        "1, so it",
        "  was not searched; memory: GiB on the fullest GPU (LLM + encoder); overhead: paper §4.5,",
        "  k(DP_enc - DP_llm)Φ_enc/n_gpu in GiB; max mb: most microbatches one encoder pipeline "
        "can hold",
        "  activations for; partitions: kept (symmetry-reduced, capped) of all compositions",
    ]
    if result.pruned:
        lines += ["", f"pruned encoder plans ({len(result.pruned)}):"]
        # the space keeps a plan as long as the column (one with its TP mode) off its reason
        lines += [f"  {str(p.plan) + ' ':<16}{p.reason}" for p in result.pruned]
    lines.append("")
    if best is None:
        lines.append(
            "chosen: none: no encoder plan could be scheduled"
            + ("" if scheduled.baseline else "; see the reasons above")
        )
    else:
        lines += [
            f"chosen: LLM {result.llm_plan} | encoder {best.encoder_plan} | partition "
            f"{list(best.partition)}",
            f"  iteration {_seconds(best.iteration_us)} s (coarse-only "
            f"{_seconds(best.coarse_iteration_us)} s, "
            f"LLM alone {_seconds(scheduled.llm_alone_us)} s); encoder compute inside LLM bubbles "
            f"{scheduling_efficiency(best):.1%}; MFU {mfu(config, best.iteration_us):.1%}",
            f"  warm-up per stage {list(best.dep.warmup)} (megatron-core default "
            f"{list(best.dep.default_warmup)}); "
            f"scheduler runtime {scheduled.runtime_s:.2f} s",
        ]
    if scheduled.baseline is not None:
        b = scheduled.baseline
        lines += [
            f"but the {b.name} baseline is faster: iteration {_seconds(b.iteration_us)} s; "
            "optimus-train runs "
            f"it (--baseline {b.runtime}) unless given this schedule (--schedule)"
        ]
    return "\n".join(lines) + "\n"


def format_expected(expected: ExpectedRanking) -> str:
    """The plans ranked by expected iteration time over the drawn iterations."""
    d = expected.distribution
    histogram = ", ".join(f"{n}: {w:g}" for n, w in d.images_per_sample)
    tokens = (
        ", ".join(f"{n}: {w:g}" for n, w in d.tokens_per_image)
        if d.tokens_per_image
        else "the encoder's seq_length"
    )
    lines = [
        "",
        f"workload distribution: images per sample {{{histogram}}}, tokens per image {tokens}, "
        f"at most {d.max_images_per_microbatch} images per microbatch",
        f"encoder plans ranked by expected iteration time over {expected.iterations} iterations "
        f"drawn from it (seed {expected.seed}), each scheduled for its own images:",
        f"{'rank':>4}  {'encoder plan':<16}{'expected s':>12}{'at the maximum s':>18}"
        f"{'fallbacks':>11}",
    ]
    for i, row in enumerate(expected.ranked, 1):
        lines.append(
            f"{i:>4}  {str(row.candidate.plan):<16}{_seconds(row.expected_us):>12}"
            f"{_seconds(row.fallback.iteration_us):>18}"
            f"{f'{row.fallback_iterations}/{expected.iterations}':>11}"
        )
    best = expected.best
    if best is None:
        lines.append("chosen for the distribution: none: no plan schedules the planned maximum")
    else:
        lines.append(
            f"chosen for the distribution: encoder {best.candidate.plan}; its schedule for the "
            f"maximum (iteration {_seconds(best.fallback.iteration_us)} s) is the fallback the "
            "artifact holds"
        )
    return "\n".join(lines) + "\n"


def format_placements(placements: list[PlacementPrediction], over_drawn: bool = False) -> str:
    """One line per placement: its predicted iteration time (``over_drawn``: the mean over the
    drawn iterations), or why the job cannot run it; the planned one marked."""
    what = "mean over the drawn iterations" if over_drawn else "predicted iteration"
    lines = ["", f"placements ({what}; * the one optimus-train runs with no flag):"]
    for p in placements:
        if p.iteration_s is None:
            lines.append(f"  {p.mode:<12} cannot run: {p.problem}")
        else:
            lines.append(f"  {p.mode:<12} {p.iteration_s:.4f} s" + (" *" if p.planned else ""))
    return "\n".join(lines) + "\n"


def expected_to_dict(expected: ExpectedRanking) -> dict[str, Any]:
    return {
        "iterations": expected.iterations,
        "seed": expected.seed,
        "images_per_sample": dict(expected.distribution.images_per_sample),
        "max_images_per_microbatch": expected.distribution.max_images_per_microbatch,
        "ranked": [
            {
                "encoder_plan": row.candidate.plan.as_dict(),
                "expected_iteration_us": row.expected_us,
                "fallback_iteration_us": row.fallback.iteration_us,
                "fallback_iterations": row.fallback_iterations,
            }
            for row in expected.ranked
        ],
    }


def _outcome_text(outcome: PlanOutcome) -> str:
    if outcome.status == "scheduled":
        return _seconds(outcome.iteration_us)
    if outcome.status == "bounded":
        return ">= " + _seconds(outcome.lower_bound_us)
    return "infeasible"


def _memory_columns(c: EncoderPlanCandidate) -> str:
    mem: MemoryBreakdown = c.memory
    parts = c.partitions
    partitions = f"{len(parts.partitions)} of {parts.num_compositions}" + (
        " (capped)" if parts.truncated else ""
    )
    return (
        f"{_gib(mem.params):>7}{_gib(mem.grads):>7}"
        f"{_gib(mem.optimizer):>7}{_gib(mem.activations):>7}"
        f"{_gib(mem.total):>8}  {_gib(c.overhead_bytes):>8}  {c.max_microbatches_per_pipeline:>6}  "
        f"{partitions}"
    )


def result_to_dict(result: PlannerResult, scheduled: OptimusResult) -> dict[str, Any]:
    def memory(mem: MemoryBreakdown) -> dict[str, float]:
        return {**asdict(mem), "total": mem.total}

    outcomes = {o.plan: o for o in scheduled.outcomes}
    best = scheduled.best
    return {
        "config": result.config_name,
        "num_gpus": result.num_gpus,
        "gpu_memory_bytes": result.gpu_memory_bytes,
        "llm_plan": result.llm_plan.as_dict(),
        "llm_plan_origin": result.llm_plan_origin,
        "llm_rejected": [
            {"plan": p.plan.as_dict(), "reason": p.reason} for p in result.llm_rejected
        ],
        "num_microbatches": result.num_microbatches,
        "ranking": RANKING,
        "llm_alone_iteration_us": scheduled.llm_alone_us,
        "encoder_plans": [
            {
                "plan": c.plan.as_dict(),
                "m": c.m,
                "status": outcomes[c.plan].status,
                "iteration_us": outcomes[c.plan].iteration_us,
                "lower_bound_us": outcomes[c.plan].lower_bound_us,
                "memory_bytes": memory(c.memory),
                "llm_memory_bytes": memory(c.llm_memory),
                "encoder_memory_bytes": memory(c.encoder_memory),
                "overhead_bytes": c.overhead_bytes,
                "max_microbatches_per_pipeline": c.max_microbatches_per_pipeline,
                "num_compositions": c.partitions.num_compositions,
                "partitions_truncated": c.partitions.truncated,
                "partitions": [list(p) for p in c.partitions.partitions],
            }
            for c in sorted(
                result.candidates, key=lambda c: scheduled.ranked.index(outcomes[c.plan])
            )
        ],
        "pruned": [{"plan": p.plan.as_dict(), "reason": p.reason} for p in result.pruned],
        "chosen": None
        if best is None
        else {
            "encoder_plan": best.encoder_plan.as_dict(),
            "partition": list(best.partition),
            "iteration_us": best.iteration_us,
            "coarse_iteration_us": best.coarse_iteration_us,
            "warmup": list(best.dep.warmup),
            "scheduler_runtime_s": scheduled.runtime_s,
        },
        # a baseline placement faster than every Optimus schedule, which optimus-train then runs
        "faster_baseline": None
        if scheduled.baseline is None
        else {
            "name": scheduled.baseline.name,
            "runtime": scheduled.baseline.runtime,
            "iteration_us": scheduled.baseline.iteration_us,
        },
    }


if __name__ == "__main__":
    sys.exit(main())
