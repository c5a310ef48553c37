"""The schedule artifact: the versioned JSON contract between the scheduler and the runtime.

Its fields are ``artifact_format``'s dataclasses, written with ``to_json`` and read back by the
config's loader (``typed_load``). It holds the settings of the config it was made for that shape its
schedule (``fingerprint``), the plans, the microbatch partition, the global ordering (the encoder
microbatches, each an encoder pipeline's local microbatch, in order), the LLM warm-up counts to run
with and the op order each LLM stage runs under them, the data microbatch each LLM microbatch runs
and the LLM microbatch each encoder microbatch feeds, and for every encoder stage (the GPUs of one
LLM pipeline that hold it) its encoder kernels in the order they run, each with the LLM hook point
it is launched at and its predicted start and end.

A hook point (``Hook``) names a moment of the LLM's own execution on that GPU, never a time: before
the LLM's first forward on the GPU (``before_first_compute``), at a kernel of one of its LLM ops
(``llm_kernel``: the op, the kernel's index among the op's ``llm_kernels``, and whether the encoder
kernel follows it or runs under it), or after its last backward (``after_last_compute``). An op's
``piece`` [lo, hi) is the share of its kernel's tokens it runs, as fractions ((0, 1): the whole
kernel). GPUs are numbered within one LLM pipeline: ``llm_stage * TP_llm + tp_rank``.

A job runs an artifact only if its fingerprint and plans are the job's and its contents are whole
and consistent (``artifact_checks``), all decided before any rank connects: the runtime then runs
each stage's ops in the order listed, at their hooks, and the LLM's ops in ``llm_op_order``.
"""

from __future__ import annotations

import json
from bisect import bisect_right
from pathlib import Path

from optimus_mllm.config import OptimusConfig
from optimus_mllm.config.files import atomic_write_text, read_versioned_json
from optimus_mllm.costing.cost_model import CostModel
from optimus_mllm.errors import ConfigError, OptimusError
from optimus_mllm.planner import PlannerResult
from optimus_mllm.scheduler.artifact_checks import REMEDY, validate_artifact, validate_for_job
from optimus_mllm.scheduler.artifact_format import (
    ARTIFACT_FORMAT,
    ARTIFACT_VERSION,
    EncoderMicrobatch,
    EncoderOp,
    EncoderStageSchedule,
    Hook,
    LLMKernelHook,
    LLMOp,
    Prediction,
    ScheduleArtifact,
    artifact_from_json,
    artifact_to_json,
)
from optimus_mllm.scheduler.bubble_scheduler import Schedule, best_schedule
from optimus_mllm.scheduler.fingerprint import fingerprint_difference, schedule_fingerprint


def schedule_to_artifact(
    schedule: Schedule,
    config: OptimusConfig,
    llm_order: tuple[int, ...] | None = None,
    images_per_chain: int | None = None,
) -> ScheduleArtifact:
    """``schedule`` as the runtime runs it. A per-iteration schedule's (``per_iteration``):
    ``llm_order``, the data microbatch each LLM microbatch runs (default: data order), and
    ``images_per_chain``, the most images of one encoder microbatch (default: all of its LLM
    microbatch's)."""
    w, tl, t0 = schedule.work, schedule.timeline, schedule.llm_origin_us
    feeds = schedule.feeds or tuple(range(len(schedule.assignment)))
    llm_mb = {a: feeds[s] for s, a in enumerate(schedule.assignment)}
    hooks = [_HookIndex(tl, s, t0) for s in range(tl.pp)]
    stages = []
    for j, stage_list in enumerate(w.stage_gpus):
        for e, gpus in enumerate(stage_list):
            s = w.llm_stage(j, e)
            ops = []
            for c in (c for c in schedule.chains if c.pipeline == j and c.stage == e):
                for run in schedule.runs(c):
                    k = run.kernel
                    op = EncoderOp(
                        phase=c.phase,
                        microbatch=llm_mb[(j, c.local_microbatch)],
                        local_microbatch=c.local_microbatch,
                        encoder=k.encoder,
                        layer=k.layer,
                        kernel=k.name,
                        kernel_index=run.index,
                        piece=(float(run.piece[0]), float(run.piece[1])),
                        is_comm=k.is_comm,
                        window=c.window,
                        start_us=round(run.start_us, 3),
                        end_us=round(run.end_us, 3),
                        hook=hooks[s].hook(c.window, run.start_us),
                    )
                    ops.append((run.start_us, c.phase == "bwd", op))
            # the order they run in: by start (a chain's kernels start one after the other; the
            # sort is stable), a backward after a forward that starts at the same time
            ops.sort(key=lambda item: item[:2])
            stages.append(
                EncoderStageSchedule(
                    encoder_pipeline=j,
                    encoder_stage=e,
                    llm_stage=s,
                    gpus=tuple(gpus),
                    ops=tuple(op for *_, op in ops),
                )
            )
    return ScheduleArtifact(
        format=ARTIFACT_FORMAT,
        version=ARTIFACT_VERSION,
        config=config.name,
        fingerprint=schedule_fingerprint(config),
        num_gpus=config.cluster.num_gpus,
        llm_plan=schedule.llm_plan,
        encoder_plan=schedule.encoder_plan,
        num_microbatches=tl.num_microbatches,
        llm_order=tuple(range(tl.num_microbatches)) if llm_order is None else tuple(llm_order),
        partition=tuple(schedule.partition),
        assignment=tuple(EncoderMicrobatch(j, k) for j, k in schedule.assignment),
        feeds=feeds,
        images_per_chain=images_per_chain,
        warmup=tuple(schedule.dep.warmup),
        default_warmup=tuple(schedule.dep.default_warmup),
        llm_op_order=tuple(
            tuple(LLMOp(op.microbatch, op.chunk, op.phase) for op in stage.ops)
            for stage in tl.stages
        ),
        predicted=Prediction(
            iteration_us=schedule.iteration_us,
            coarse_iteration_us=schedule.coarse_iteration_us,
            llm_origin_us=t0,
            forward_dependency_us=tuple(schedule.forward_dependency_us),
            backward_dependency_us=tuple(schedule.backward_dependency_us),
            encoder_forward_end_us=tuple(schedule.encoder_forward_end_us),
            encoder_backward_start_us=tuple(schedule.encoder_backward_start_us),
        ),
        llm_kernels={
            f"{s}/{c}/{phase}": tuple(k.name for k in work.kernels)
            for (s, c, phase), work in sorted(tl.work.items())
        },
        encoder_stages=tuple(stages),
    )


class _HookIndex:
    """The LLM kernels of one stage in launch order, to name the one an encoder kernel follows."""

    def __init__(self, tl, stage: int, t0: float):
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.kernels: list[tuple[LLMOp, int, str, int]] = []
        for op in tl.stages[stage].ops:
            for index, k in enumerate(tl.work[(stage, op.chunk, op.phase)].kernels):
                self.starts.append(t0 + op.start_us + k.offset_us)
                self.ends.append(t0 + op.start_us + k.offset_us + k.duration_us)
                self.kernels.append(
                    (LLMOp(op.microbatch, op.chunk, op.phase), index, k.name, k.layer)
                )

    def hook(self, window: str, start: float) -> Hook:
        if window == "pre":
            return Hook("before_first_compute")
        if window == "post":
            return Hook("after_last_compute")
        i = max(bisect_right(self.starts, start + 1e-6) - 1, 0)
        op, index, name, layer = self.kernels[i]
        return Hook(
            "llm_kernel", LLMKernelHook(op, index, name, layer, start >= self.ends[i] - 1e-6)
        )


def write_artifact(schedule: Schedule, config: OptimusConfig, path: str | Path) -> None:
    atomic_write_text(path, artifact_text(schedule_to_artifact(schedule, config)))


def artifact_text(artifact: ScheduleArtifact) -> str:
    """The file's text: one line of JSON."""
    return json.dumps(artifact_to_json(artifact)) + "\n"


def load_artifact(path: str | Path) -> ScheduleArtifact:
    """Read a schedule artifact and refuse it unless it is whole and consistent
    (``artifact_checks``)."""
    where = f"schedule artifact {path}"
    data = read_versioned_json(path, "schedule artifact", ARTIFACT_FORMAT, ARTIFACT_VERSION, REMEDY)
    try:
        artifact = artifact_from_json(data)
    except ConfigError as exc:
        raise OptimusError(f"{where}: {exc}; {REMEDY}") from None
    validate_artifact(artifact, where)
    return artifact


# -- the schedule a training job runs ----------------------------------------------------------


def load_job_artifact(
    path: str | Path, planned: PlannerResult, config: OptimusConfig, num_gpus: int
) -> ScheduleArtifact:
    """An artifact from ``optimus-plan --artifact``, refused unless it was made for this job.

    Everything here is decided from the files alone, so every rank refuses the same artifact before
    any of them connects."""
    artifact = load_artifact(path)
    difference = fingerprint_difference(artifact.fingerprint, schedule_fingerprint(config))
    if difference is not None:
        raise OptimusError(
            f"schedule artifact {path} was made with {difference}; re-run optimus-plan "
            "--artifact for this config"
        )
    allowed = [c.plan for c in planned.candidates]
    # a fixed parallel.encoder is the job's encoder plan; otherwise any plan the planner keeps will
    # do
    expected = (
        allowed[0]
        if config.parallel.fixed_encoder is not None and allowed
        else artifact.encoder_plan
    )
    artifact.check_matches(planned.llm_plan, expected, num_gpus)
    if expected not in allowed:
        raise OptimusError(
            f"schedule artifact has encoder plan {expected}, which the planner rejects for this "
            "config (see optimus-plan); re-run optimus-plan for this config"
        )
    validate_for_job(artifact, config, f"schedule artifact {path}")
    return artifact


def schedule_job_artifact(config: OptimusConfig, planned: PlannerResult) -> ScheduleArtifact:
    """Schedule the job now (what ``optimus-plan --artifact`` would write)."""
    best = best_schedule(config, planned, CostModel.from_config(config)).best
    if best is None:
        raise OptimusError(
            "no encoder plan could be scheduled (see optimus-plan); try the Megatron-style baseline"
        )
    return schedule_to_artifact(best, config)
