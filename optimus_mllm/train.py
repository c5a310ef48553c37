"""``optimus-train``: train the ViT + projector + GPT model on every rank of a ``torchrun`` job.

    torchrun --nproc-per-node N -m optimus_mllm.train --config FILE.yaml [--override KEY=VALUE ...]
             [--schedule ARTIFACT.json] [--baseline [megatron-lm|balanced]] [--save DIR
             [--save-interval N] [--resume [--no-load-optim]]] [--override-opt_param-scheduler |
             --use-checkpoint-opt_param-scheduler] [--pretrained-checkpoint DIR]
             [--pretrained-llm DIR] [--pretrained-encoder NAME=DIR ...] [--tensorboard-dir DIR]

Every rank loads the config, plans and schedules (pure Python and deterministic, so every rank gets
the same result) or loads ``--schedule``, and only then talks to the others: a bad config, a world
size that is not ``cluster.num_gpus`` or an artifact made for another job is the same decision on
every rank, reported once by rank 0, and every rank exits with code 2 instead of hanging. On several
machines each node reads its own command line and files: there a rank that cannot read its job
still connects, and once connected the ranks check that every one read its job and the same job
(``runtime.same_job``), so that a problem of one node is said, once, instead of hanging the others.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from optimus_mllm.cli.common import ArgumentParser, add_config_arguments, quiet_library_warnings
from optimus_mllm.config import OptimusConfig, encoder_tp_problem, load_config, tp_mode_problem
from optimus_mllm.config.files import is_webdataset
from optimus_mllm.costing.cost_model import CostModel, profile_device_problem
from optimus_mllm.errors import AgreedError, ConfigError, OptimusError
from optimus_mllm.planner import PlannerResult, plan
from optimus_mllm.planner.plans import ParallelPlan
from optimus_mllm.runtime.checkpoint_meta import (
    CheckpointInfo,
    check_resumable,
    dist_checkpoint_folder,
    latest_checkpoint,
    optimizer_layout,
    optimizer_layout_change,
)
from optimus_mllm.runtime.data_sources import check_dataset
from optimus_mllm.runtime.mode import Mode
from optimus_mllm.runtime.tp_modes.trained import refuse_untrained_tp_modes
from optimus_mllm.scheduler.artifact import (
    artifact_text,
    load_job_artifact,
    schedule_to_artifact,
)
from optimus_mllm.scheduler.artifact_format import ScheduleArtifact
from optimus_mllm.scheduler.baselines import balanced_problem, no_placement_problem
from optimus_mllm.scheduler.fingerprint import config_settings
from optimus_mllm.scheduler.placements import OPTIMUS, job_placements

if TYPE_CHECKING:
    from optimus_mllm.runtime.trainer import StepResult

PROG = "optimus-train"
# the paper's two Megatron-LM baselines (Trainer modes baseline, balanced)
BASELINES = (
    "megatron-lm",
    "balanced",
)
_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _is_rank_zero() -> bool:
    return os.environ.get("RANK", "0") == "0"


class _RankZeroParser(ArgumentParser):
    """Usage errors and --help from rank 0 only: every rank parses the same argv."""

    def _print_message(self, message: str, file: Any = None) -> None:
        if _is_rank_zero():
            super()._print_message(message, file)


def build_parser() -> ArgumentParser:
    parser = _RankZeroParser(
        prog=PROG,
        description="Train on every rank of a torchrun job with the Optimus "
        "schedule (or the Megatron-style baseline).",
    )
    add_config_arguments(parser, "configs/tiny.yaml")
    parser.add_argument(
        "--schedule",
        metavar="ARTIFACT",
        help="schedule artifact from optimus-plan --artifact (default: schedule here)",
    )
    parser.add_argument(
        "--baseline",
        nargs="?",
        const="megatron-lm",
        choices=BASELINES,
        help="no bubble schedule: megatron-lm (the default), the encoders whole in the first "
        "pipeline stage; balanced, encoder and LLM layers split together over the virtual "
        "stages (the paper's Megatron-LM balanced)",
    )
    parser.add_argument(
        "--save",
        metavar="DIR",
        help="checkpoint folder: written at the end of training and every --save-interval steps",
    )
    parser.add_argument(
        "--save-interval",
        metavar="N",
        type=_positive_int,
        help="also checkpoint after every N steps",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue from the latest checkpoint in --save (weights, optimizer state, LR "
        "schedule, step, schedule)",
    )
    parser.add_argument(
        "--no-load-optim",
        action="store_true",
        help="with --resume: start the optimizer state afresh (needed when the optimizer "
        "settings differ from the checkpoint's)",
    )
    parser.add_argument(
        "--override-opt_param-scheduler",
        "--override-opt-param-scheduler",
        dest="override_opt_param_scheduler",
        action="store_true",
        help="with --resume: take this run's LR-schedule settings where the checkpoint's differ "
        "(Megatron-LM's flag; training.override_opt_param_scheduler)",
    )
    parser.add_argument(
        "--use-checkpoint-opt_param-scheduler",
        "--use-checkpoint-opt-param-scheduler",
        dest="use_checkpoint_opt_param_scheduler",
        action="store_true",
        help="with --resume: take the checkpoint's LR-schedule settings where this run's differ "
        "(Megatron-LM's flag; training.use_checkpoint_opt_param_scheduler)",
    )
    parser.add_argument(
        "--pretrained-checkpoint",
        metavar="DIR",
        help="start from this checkpoint's weights (LLM and encoders; not its optimizer state or "
        "step), Megatron-LM's flag",
    )
    parser.add_argument(
        "--pretrained-llm",
        metavar="DIR",
        help="start the LLM from this checkpoint's weights (ours, or a megatron-core GPT one)",
    )
    parser.add_argument(
        "--pretrained-encoder",
        metavar="NAME=DIR",
        action="append",
        default=[],
        help="start encoder NAME from this checkpoint's weights; repeat for several",
    )
    parser.add_argument(
        "--tensorboard-dir",
        metavar="DIR",
        help="write TensorBoard scalars there (rank 0; needs the tensorboard package)",
    )
    return parser


def _scheduler_flag_overrides(args: argparse.Namespace) -> list[str]:
    """The LR-schedule flags as the config fields they set (after the user's own overrides)."""
    return [
        f"training.{name}=true"
        for name in ("override_opt_param_scheduler", "use_checkpoint_opt_param_scheduler")
        if getattr(args, name)
    ]


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


@dataclass(frozen=True)
class Job:
    config: OptimusConfig
    llm_plan: ParallelPlan
    artifact: ScheduleArtifact | None  # None in baseline mode
    baseline: str | None = None  # which of BASELINES runs, None under Optimus
    resume: CheckpointInfo | None = None
    notes: tuple[str, ...] = ()  # what rank 0 says before the first step
    load_optimizer: bool = True  # with ``resume``: the checkpoint's optimizer state too
    pretrained: tuple[
        tuple[str, Path, str], ...
    ] = ()  # (model part, checkpoint folder, flag) to start from


def prepare(args: argparse.Namespace, world_size: int) -> Job:
    """Everything that can fail on the user's input, with no communication (same answer on every
    rank)."""
    if args.baseline and args.schedule:
        raise OptimusError("--baseline runs without a schedule; drop --schedule or --baseline")
    if args.no_load_optim and not args.resume:
        raise OptimusError("--no-load-optim applies to --resume; drop it or add --resume")
    pretrained = args.pretrained_checkpoint or args.pretrained_llm or args.pretrained_encoder
    if pretrained and args.resume:
        flag = next(
            f
            for f, given in (
                ("--pretrained-checkpoint", args.pretrained_checkpoint),
                ("--pretrained-llm", args.pretrained_llm),
                ("--pretrained-encoder", args.pretrained_encoder),
            )
            if given
        )
        raise OptimusError(
            f"{flag} starts a new run from pretrained weights, --resume continues one; drop one of "
            "them"
        )
    if (args.resume or args.save_interval) and not args.save:
        raise OptimusError(
            f"{'--resume' if args.resume else '--save-interval'} needs --save DIR, the checkpoint "
            "folder"
        )
    if args.tensorboard_dir and importlib.util.find_spec("tensorboard") is None:
        raise OptimusError(
            "--tensorboard-dir needs the tensorboard package; pip install tensorboard, or drop "
            "--tensorboard-dir"
        )
    config = load_config(args.config, [*args.override, *_scheduler_flag_overrides(args)])
    device_problem = profile_device_problem(
        config.cost_model.profile, "cuda" if torch.cuda.is_available() else "cpu"
    )
    if device_problem:
        raise OptimusError(device_problem)
    llm_mode = config.parallel.llm.tp_mode if config.parallel.llm is not None else "1d"
    refuse_untrained_tp_modes(
        llm_mode,
        config.parallel.encoder_tp_mode,
        config,
        _trainer_mode(args.baseline),
    )
    checkpointed = args.save or args.resume or args.pretrained_checkpoint or args.pretrained_encoder
    if config.parallel.encoder_tp_mode == "2d" and checkpointed:
        # layers_2d's blocks would be saved as replicas of one another
        raise ConfigError(
            "parallel.encoder.tp_mode",
            "2d encoders are not checkpointed yet; drop --save, --resume and the encoder's "
            "--pretrained-* flags, or use tp_mode 1d or metp",
        )
    if world_size != config.cluster.num_gpus:
        raise OptimusError(
            f"this job has {world_size} processes but cluster.num_gpus={config.cluster.num_gpus}; "
            f"launch {config.cluster.num_gpus} processes (torchrun --nproc-per-node) or set "
            f"cluster.num_gpus={world_size} and a parallel.llm for it"
        )
    parts = _pretrained_parts(args, config)
    check_dataset(config)
    webdataset = is_webdataset(config.data.path)
    if config.training.schedule_per_iteration and not webdataset:
        raise ConfigError(
            "training.schedule_per_iteration",
            "needs a webdataset's varying images (data.path with .nv-meta); set it false for "
            "fixed images",
        )
    planned = plan(config)
    if args.baseline:
        _check_baseline(args.baseline, config, planned.llm_plan)
    resume = _resume_point(args.save, config) if args.resume else None
    artifact, baseline, notes = _job_artifact(args, config, planned, world_size, resume)
    if resume is not None and resume.passed_over:
        notes = (resume.passed_over, *notes)
    if resume is not None and not args.no_load_optim:
        changed = optimizer_layout_change(resume, optimizer_layout(config))
        if changed:
            raise OptimusError(
                f"--resume: the checkpoint's {changed} differs from this job's, so its optimizer "
                "state does not fit; resume with the optimizer settings it was written with, or "
                "add --no-load-optim to start the optimizer state afresh"
            )
    return Job(
        config,
        planned.llm_plan,
        artifact,
        baseline,
        resume,
        notes,
        load_optimizer=not args.no_load_optim,
        pretrained=parts,
    )


def job_settings(job: Job, args: argparse.Namespace) -> dict[str, Any]:
    """What every rank must have read alike (``runtime.same_job``): the config's settings but the
    file it was read from, the schedule it runs (a digest of its JSON), and where the run starts
    and saves."""
    schedule = None
    if job.artifact is not None:
        schedule = hashlib.sha256(artifact_text(job.artifact).encode()).hexdigest()[:16]
    return {
        **config_settings(job.config, skip=frozenset({"source"})),
        "the schedule (sha256 of its JSON)": schedule,
        "--baseline": job.baseline,
        "--resume": None if job.resume is None else f"{job.resume.path} @ {job.resume.iteration}",
        "--no-load-optim": not job.load_optimizer,
        "--pretrained-*": [f"{flag} {part}={folder}" for part, folder, flag in job.pretrained],
        "--save": args.save,
        "--save-interval": args.save_interval,
    }


def _trainer_mode(baseline: str | None) -> Mode:
    """The ``Trainer``'s mode for ``--baseline``'s value (None: Optimus)."""
    return {None: "optimus", "megatron-lm": "baseline", "balanced": "balanced"}[baseline]


def _check_baseline(baseline: str, config: OptimusConfig, llm_plan: ParallelPlan) -> None:
    """Both baselines run the encoders at the LLM's TP; the balanced one as ``runtime.balanced``
    can."""
    tp = llm_plan.tp
    for i, enc in enumerate(config.encoders):
        problem = encoder_tp_problem(
            enc, config.llm.hidden_size, config.training.sequence_parallel, tp
        ) or tp_mode_problem(enc, config.parallel.encoder_tp_mode, tp)
        if problem:
            raise OptimusError(
                f"--baseline runs model.encoders[{i}] at the LLM's tp={tp}, but its {problem}; "
                "run it without --baseline or pick another parallel.llm.tp"
            )
    problem = _BASELINE_PROBLEMS[baseline](config, llm_plan)
    if problem:
        raise OptimusError(f"--baseline {baseline}: {problem}")


# what each --baseline refuses beyond the encoders' TP; Megatron-LM's placement nothing more
_BASELINE_PROBLEMS: dict[str, Callable[[OptimusConfig, ParallelPlan], str | None]] = {
    "megatron-lm": lambda config, llm_plan: None,
    "balanced": balanced_problem,
}


def _pretrained_parts(
    args: argparse.Namespace, config: OptimusConfig
) -> tuple[tuple[str, Path, str], ...]:
    """(model part, checkpoint folder, flag) for each ``--pretrained-*`` flag, checked before ranks
    connect."""
    parts: list[tuple[str, str, str]] = []
    if args.pretrained_checkpoint:
        flag = "--pretrained-checkpoint"
        parts += [
            (part, args.pretrained_checkpoint, flag)
            for part in ("llm", *(e.name for e in config.encoders))
        ]
    if args.pretrained_llm:
        parts.append(("llm", args.pretrained_llm, "--pretrained-llm"))
    names = [e.name for e in config.encoders]
    for given in args.pretrained_encoder:
        name, sep, folder = given.partition("=")
        if not sep or name not in names or not folder:
            raise OptimusError(
                f"--pretrained-encoder {given!r}: give NAME=DIR with NAME one of the config's "
                f"encoders ({', '.join(names)})"
            )
        parts.append((name, folder, "--pretrained-encoder"))
    seen = [part for part, _, _ in parts]
    twice = next((part for part in seen if seen.count(part) > 1), None)
    if twice is not None:
        raise OptimusError(
            f"the {twice} weights are given by two --pretrained-* flags; give each model part once"
        )
    return tuple((part, dist_checkpoint_folder(folder, flag), flag) for part, folder, flag in parts)


def _job_artifact(
    args: argparse.Namespace,
    config: OptimusConfig,
    planned: PlannerResult,
    world_size: int,
    resume: CheckpointInfo | None,
) -> tuple[ScheduleArtifact | None, str | None, tuple[str, ...]]:
    """The schedule the job runs (None for a baseline), the baseline it runs (None under Optimus),
    and what to say about where they came from: ``--baseline``, ``--schedule``, else the
    checkpoint's schedule when it fits this job, else scheduled now (a baseline placement where no
    Optimus schedule gains on it by more than the step noise, ``optimus_gains``)."""
    if args.baseline:
        return None, args.baseline, ()
    if args.schedule:
        return load_job_artifact(args.schedule, planned, config, world_size), None, ()
    if resume is None or not resume.schedule_path.is_file():
        return _schedule_now(config, planned, ())
    if resume.world_size != world_size:
        note = (
            f"the checkpoint was written by {resume.world_size} ranks, this job has {world_size}: "
            "re-planned the encoder schedule"
        )
        return _schedule_now(config, planned, (note,))
    try:
        return (
            load_job_artifact(str(resume.schedule_path), planned, config, world_size),
            None,
            ("schedule: the one saved with the checkpoint",),
        )
    except OptimusError as exc:  # e.g. the config now fixes another encoder plan
        note = (
            f"the checkpoint's schedule does not fit this job ({exc}): re-planned the encoder "
            "schedule"
        )
        return _schedule_now(config, planned, (note,))


def _schedule_now(
    config: OptimusConfig, planned: PlannerResult, notes: tuple[str, ...]
) -> tuple[ScheduleArtifact | None, str | None, tuple[str, ...]]:
    """Optimus's schedule, or the baseline placement that beats it: what ``optimus-plan`` prints
    as planned (``job_placements``)."""
    cost = CostModel.from_config(config)
    job = job_placements(config, planned, cost)
    b = job.baseline
    if b is None:
        if job.schedule is None:
            raise OptimusError(no_placement_problem(config, planned, cost))
        return schedule_to_artifact(job.schedule, config), None, notes
    optimus = job.predicted_s(OPTIMUS)
    optimus_s = "none" if optimus is None else f"{optimus:.4f} s"
    over = (
        "" if job.expected is None else f", the mean of {job.expected.iterations} drawn iterations"
    )
    note = (
        f"the {b.name} baseline ({job.predicted_s(b.runtime):.4f} s per iteration predicted{over}) "
        f"is no slower than every Optimus schedule within the step noise of {cost.step_noise:.1%} "
        f"(best {optimus_s}): running it, as --baseline {b.runtime} would"
    )
    return None, b.runtime, (*notes, note)


def _resume_point(save: str, config: OptimusConfig) -> CheckpointInfo:
    info = latest_checkpoint(save)
    check_resumable(info, config)
    if info.iteration >= config.training.train_iters:
        raise OptimusError(
            f"--resume: the checkpoint in {save} is at step {info.iteration} and "
            f"training.train_iters={config.training.train_iters}; raise training.train_iters to "
            "train further"
        )
    return info


# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _StepTotals:
    """One step over all ranks."""

    loss: float  # the mean over the DP replicas
    inside: int  # encoder ops that ran between the LLM's first and last op
    total: int  # all encoder ops
    moved: int  # encoder ops that ran away from their scheduled hook point: ...
    moved_by_repair: int  # ... before or after the LLM, as their hooks would wait in a cycle
    moved_to_op_end: int  # ... at their LLM op's end, as a TP collective planned there never ran

    def moved_text(self) -> str:
        """The step line's report of moved ops: a warning that says why when there are any."""
        text = f"ops moved from their hook {self.moved}"
        why = []
        if self.moved_by_repair:
            why.append(
                f"{self.moved_by_repair} to before/after the LLM, as the schedule's hooks would "
                "have waited in a cycle (predicted times wrong)"
            )
        if self.moved_to_op_end:
            why.append(
                f"{self.moved_to_op_end} to their LLM op's end, as a TP collective the schedule "
                "planned there did not run"
            )
        return f"{text} (warning: {'; '.join(why)})" if why else text


def _step_totals(
    loss: float | None, result: StepResult, is_loss_reporter: bool, dp: int
) -> _StepTotals:
    """Over all ranks. One all-reduce; it also waits for the slowest rank, so rank 0's clock covers
    the whole step."""
    local = [
        loss / dp if is_loss_reporter and loss is not None else 0.0,
        float(result.ops_inside_llm),
        float(len(result.encoder_record)),
        float(result.moved_ops),
        float(result.moved_by_repair),
        float(result.moved_to_op_end),
    ]
    totals = torch.tensor(local, dtype=torch.float64)
    dist.all_reduce(totals)
    return _StepTotals(float(totals[0]), *(int(t) for t in totals[1:]))


def _is_loss_reporter() -> bool:
    """One rank per DP replica: the last pipeline stage's first TP rank (the others hold the same
    loss)."""
    from megatron.core import parallel_state

    return (
        parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        and parallel_state.get_tensor_model_parallel_rank() == 0
    )


def train(
    job: Job,
    save: str | None = None,
    save_interval: int | None = None,
    tensorboard_dir: str | None = None,
) -> None:
    from optimus_mllm.runtime.checkpoint import load_checkpoint, load_pretrained, save_checkpoint
    from optimus_mllm.runtime.trainer import Trainer

    config, iters = job.config, job.config.training.train_iters
    mode = _trainer_mode(job.baseline)
    trainer = Trainer(config, job.llm_plan, mode, job.artifact)
    first = 0
    for part, folder, flag in job.pretrained:
        _say(load_pretrained(trainer, part, folder, flag))
    if job.resume is not None:
        load_checkpoint(trainer, job.resume, job.load_optimizer)
        first = job.resume.iteration
        _say(f"resumed from {job.resume.path} at step {first}")
    for note in job.notes:
        _say(note)
    board = _summary_writer(tensorboard_dir)
    reporter, times, loss = _is_loss_reporter(), [], 0.0
    tokens = config.training.global_batch_size * config.llm.seq_length
    try:
        for i in range(first, iters):
            started = time.perf_counter()
            result = trainer.train_step(i)
            totals = _step_totals(result.loss, result, reporter, job.llm_plan.dp)
            loss = totals.loss
            times.append(time.perf_counter() - started)
            share = None if job.artifact is None else totals.inside / max(totals.total, 1)
            norm = "skipped (inf/nan)" if result.grad_norm is None else f"{result.grad_norm:.4f}"
            scale = "" if result.loss_scale is None else f"loss scale {result.loss_scale:.1f} | "
            _say(
                f"step {i + 1}/{iters} | loss {loss:.4f} | grad norm {norm} | lr {result.lr:.3e} | "
                f"{scale}"
                f"{times[-1] * 1e3:.1f} ms | "
                f"{tokens / times[-1]:.0f} tokens/s | "
                + (
                    {"megatron-lm": "baseline", "balanced": "balanced baseline"}[job.baseline]
                    if share is None
                    else f"encoder ops inside LLM span {share:.1%} | {totals.moved_text()}"
                )
                + ("" if result.schedule is None else f" | schedule {result.schedule.text}")
            )
            if board is not None:
                _log_scalars(board, i + 1, loss, result, times[-1], tokens, share)
            if save and (i + 1 == iters or (save_interval and (i + 1) % save_interval == 0)):
                _say(f"saved checkpoint {save_checkpoint(trainer, save, i + 1)}")
    finally:
        trainer.close()
        if board is not None:
            board.close()
    _say(
        f"done: {len(times)} steps | mean step {sum(times) / len(times) * 1e3:.1f} ms | final loss "
        f"{loss:.4f}"
    )


def _summary_writer(log_dir: str | None) -> Any:
    """TensorBoard on rank 0 only: the step totals are already reduced there."""
    if log_dir is None or dist.get_rank() != 0:
        return None
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir)


def _log_scalars(
    board: Any,
    step: int,
    loss: float,
    result: StepResult,
    seconds: float,
    tokens: int,
    share: float | None,
) -> None:
    board.add_scalar("lm loss", loss, step)
    board.add_scalar("learning-rate", result.lr, step)
    if result.grad_norm is not None:
        board.add_scalar("grad-norm", result.grad_norm, step)
    if result.loss_scale is not None:
        board.add_scalar("loss-scale", result.loss_scale, step)
    board.add_scalar("step time (ms)", seconds * 1e3, step)
    board.add_scalar("tokens per second", tokens / seconds, step)
    if share is not None:
        board.add_scalar("encoder ops inside LLM span (%)", share * 100, step)


def _say(line: str) -> None:
    if dist.get_rank() == 0:
        print(line, flush=True)


def _torchrun_world_size() -> int:
    missing = [name for name in _TORCHRUN_ENV if name not in os.environ]
    if missing:
        raise OptimusError(
            f"{', '.join(missing)} not set; launch with torchrun --nproc-per-node N "
            "-m optimus_mllm.train ..."
        )
    return int(os.environ["WORLD_SIZE"])


def _on_one_node(world_size: int) -> bool:
    """Every rank on this machine (torchrun's ``LOCAL_WORLD_SIZE``): one command line and one copy
    of each file for all."""
    return os.environ.get("LOCAL_WORLD_SIZE") == str(world_size)


def _init_process_group() -> None:
    if torch.cuda.is_available():  # before NCCL binds this process to a device
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    quiet_library_warnings(torch.cuda.is_available())
    watchdog = None
    try:
        # on one node the job is checked before any rank connects: a rank that gave up during the
        # others' connection handshake would break it for them; on several, a node's problem is
        # carried into the connection and said there (runtime.same_job)
        world_size = _torchrun_world_size()
        job, problem = None, None
        try:
            job = prepare(args, world_size)
        except OptimusError as exc:
            if _on_one_node(world_size):  # the same decision on every rank: said by rank 0
                raise
            problem = str(exc)  # the other nodes read their own files: tell them once connected
        _init_process_group()
        from optimus_mllm.runtime.same_job import check_same_job
        from optimus_mllm.runtime.watchdog import Watchdog

        watchdog = Watchdog(PROG)
        check_same_job(None if job is None else job_settings(job, args), problem)
        assert job is not None  # else check_same_job raised this rank's problem
        train(job, args.save, args.save_interval, args.tensorboard_dir)
    except OptimusError as exc:
        # after the ranks connected: this rank's own, or one all ranks agreed on
        if watchdog is not None:
            watchdog.fail(str(exc), agreed=isinstance(exc, AgreedError))
        elif _is_rank_zero():  # before: the same decision on every rank
            print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except Exception:
        if watchdog is not None:
            # exits 2 when another rank failed or stopped: it, or one line, said so
            watchdog.peer_failed()
        raise  # a bug of ours: its traceback
    finally:
        if watchdog is not None:
            watchdog.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
