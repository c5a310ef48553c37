"""``optimus-train``: train the ViT + projector + GPT model on every rank of a ``torchrun`` job.

    torchrun --nproc-per-node N -m optimus_mllm.train --config FILE.yaml [--override KEY=VALUE ...]
             [--schedule ARTIFACT.json] [--baseline]

Every rank loads the config, plans and schedules (pure Python and deterministic, so every rank gets
the same result) or loads ``--schedule``, and only then talks to the others: a bad config, a world
size that is not ``cluster.num_gpus`` or an artifact made for another job is the same decision on
every rank, reported once by rank 0, and every rank exits with code 2 instead of hanging.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from optimus_mllm.cli.common import ArgumentParser, add_config_arguments
from optimus_mllm.config import OptimusConfig, load_config
from optimus_mllm.errors import OptimusError
from optimus_mllm.planner import PlannerResult, plan
from optimus_mllm.planner.plans import ParallelPlan
from optimus_mllm.runtime.hook_plan import POST, PRE

PROG = "optimus-train"
_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _is_rank_zero() -> bool:
    return os.environ.get("RANK", "0") == "0"


class _RankZeroParser(ArgumentParser):
    """Usage errors and --help from rank 0 only: every rank parses the same argv."""

    def _print_message(self, message: str, file: Any = None) -> None:
        if _is_rank_zero():
            super()._print_message(message, file)


def build_parser() -> ArgumentParser:
    parser = _RankZeroParser(prog=PROG, description="Train on every rank of a torchrun job with the Optimus "
                                                    "schedule (or the Megatron-style baseline).")
    add_config_arguments(parser, "configs/tiny.yaml")
    parser.add_argument("--schedule", metavar="ARTIFACT",
                        help="schedule artifact from optimus-plan --artifact (default: schedule here)")
    parser.add_argument("--baseline", action="store_true",
                        help="Megatron-style: encoders whole in the first pipeline stage, no bubble schedule")
    return parser


@dataclass(frozen=True)
class Job:
    config: OptimusConfig
    llm_plan: ParallelPlan
    artifact: dict[str, Any] | None  # None in baseline mode


def prepare(args: argparse.Namespace, world_size: int) -> Job:
    """Everything that can fail on the user's input, with no communication (same answer on every rank)."""
    if args.baseline and args.schedule:
        raise OptimusError("--baseline runs without a schedule; drop --schedule or --baseline")
    config = load_config(args.config, args.override)
    if world_size != config.cluster.num_gpus:
        raise OptimusError(f"this job has {world_size} processes but cluster.num_gpus={config.cluster.num_gpus}; "
                           f"launch {config.cluster.num_gpus} processes (torchrun --nproc-per-node) or set "
                           f"cluster.num_gpus={world_size} and a parallel.llm for it")
    planned = plan(config)
    if args.baseline:
        return Job(config, planned.llm_plan, None)
    if args.schedule:
        return Job(config, planned.llm_plan, _loaded_artifact(args.schedule, planned, config, world_size))
    return Job(config, planned.llm_plan, _scheduled_artifact(config, planned))


def _loaded_artifact(path: str, planned: PlannerResult, config: OptimusConfig, world_size: int) -> dict[str, Any]:
    from optimus_mllm.scheduler.artifact import load_artifact

    artifact = load_artifact(path)
    allowed = [c.plan for c in planned.candidates]
    # a fixed parallel.encoder is the job's encoder plan; otherwise any plan the planner keeps will do
    expected = allowed[0] if config.parallel.encoder is not None and allowed else artifact.encoder_plan
    artifact.check_matches(planned.llm_plan, expected, world_size)
    if expected not in allowed:
        raise OptimusError(f"schedule artifact has encoder plan {expected}, which the planner rejects for this "
                           "config (see optimus-plan); re-run optimus-plan for this config")
    return artifact.data


def _scheduled_artifact(config: OptimusConfig, planned: PlannerResult) -> dict[str, Any]:
    from optimus_mllm.cost_model import CostModel
    from optimus_mllm.scheduler.artifact import schedule_to_artifact
    from optimus_mllm.scheduler.bubble_scheduler import optimus

    best = optimus(config, planned, CostModel.from_config(config)).best
    if best is None:
        raise OptimusError("no encoder plan could be scheduled (see optimus-plan); try --baseline")
    return schedule_to_artifact(best, config.name, config.cluster.num_gpus)


# ----------------------------------------------------------------------------------------------


def _step_totals(loss: float | None, encoder_log: list, is_loss_reporter: bool, dp: int) -> tuple[float, int, int]:
    """(mean loss over the DP replicas, encoder ops run between the LLM's first and last op, all encoder ops), over all ranks.

    One all-reduce; it also waits for the slowest rank, so rank 0's clock covers the whole step."""
    inside = sum(1 for event, *_ in encoder_log if event not in (PRE, POST))
    local = [loss / dp if is_loss_reporter and loss is not None else 0.0, float(inside), float(len(encoder_log))]
    totals = torch.tensor(local, dtype=torch.float64)
    dist.all_reduce(totals)
    return float(totals[0]), int(totals[1]), int(totals[2])


def _is_loss_reporter() -> bool:
    """One rank per DP replica: the last pipeline stage's first TP rank (the others hold the same loss)."""
    from megatron.core import parallel_state

    return (parallel_state.is_pipeline_last_stage(ignore_virtual=True)
            and parallel_state.get_tensor_model_parallel_rank() == 0)


def train(job: Job) -> None:
    from optimus_mllm.runtime.trainer import Trainer

    config, iters = job.config, job.config.training.train_iters
    trainer = Trainer(config, job.llm_plan, "baseline" if job.artifact is None else "optimus", job.artifact)
    reporter, times, loss = _is_loss_reporter(), [], 0.0
    tokens = config.training.global_batch_size * config.llm.seq_length
    try:
        for i in range(iters):
            started = time.perf_counter()
            result = trainer.train_step(i)
            loss, inside, total = _step_totals(result.loss, result.encoder_log, reporter, job.llm_plan.dp)
            times.append(time.perf_counter() - started)
            share = "baseline" if job.artifact is None else f"encoder ops inside LLM span {inside / max(total, 1):.1%}"
            _say(f"step {i + 1}/{iters} | loss {loss:.4f} | {times[-1] * 1e3:.1f} ms | "
                 f"{tokens / times[-1]:.0f} tokens/s | {share}")
    finally:
        trainer.close()
    _say(f"done: {iters} steps | mean step {sum(times) / len(times) * 1e3:.1f} ms | final loss {loss:.4f}")


def _say(line: str) -> None:
    if dist.get_rank() == 0:
        print(line, flush=True)


def _init_process_group() -> None:
    missing = [name for name in _TORCHRUN_ENV if name not in os.environ]
    if missing:
        raise OptimusError(f"{', '.join(missing)} not set; launch with torchrun --nproc-per-node N "
                           "-m optimus_mllm.train ...")
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        _init_process_group()
        train(prepare(args, dist.get_world_size()))
    except OptimusError as exc:  # raised before the first step, the same on every rank: none is left waiting
        if _is_rank_zero():
            print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
