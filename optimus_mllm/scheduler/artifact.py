"""The schedule artifact: the versioned JSON contract between the scheduler and the runtime.

It holds the settings of the config it was made for that shape its schedule (``fingerprint``), the
plans, the microbatch partition, the global ordering (which encoder pipeline's local microbatch
feeds each LLM microbatch), the LLM warm-up counts to run with, and for every encoder stage (the
GPUs of one LLM pipeline that hold it) the ordered encoder kernels with the LLM hook point each is
launched at and its predicted start and end.

A hook point names a moment of the LLM's own execution on that GPU, never a time:
- ``{"at": "before_first_compute"}``: before the LLM's first forward on this GPU (coarse forward);
- ``{"at": "llm_kernel", "phase", "chunk", "microbatch", "kernel_index", "kernel", "layer",
  "after"}``: at that kernel of that LLM op (fine-grained): ``after`` true means once it has
  finished (the encoder kernel fills the bubble that follows), false means while it runs (an encoder
  compute kernel in a TP collective's bubble, or an encoder collective under LLM compute);
- ``{"at": "after_last_compute"}``: after the LLM's last backward on this GPU (coarse backward).
An op's ``piece`` [lo, hi) is the share of its kernel's tokens it runs, as fractions ([0, 1]: the
whole kernel); a kernel the job's encoder can split (``EncoderKernel.splittable``) may run as
several pieces that tile [0, 1], in order. ``llm_kernels["stage/chunk/phase"]`` lists the names of
the LLM op's kernels, which ``kernel_index`` counts. All LLM pipelines of the job run the same
schedule, so GPUs are numbered within one LLM pipeline: ``llm_stage * TP_llm + tp_rank``.

A job runs an artifact only if its fingerprint and plans are the job's and its contents are whole
and consistent (``artifact_checks``), all decided before any rank connects.
"""

from __future__ import annotations

import json
from bisect import bisect_right
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from optimus_mllm.config import OptimusConfig
from optimus_mllm.cost_model import CostModel
from optimus_mllm.errors import OptimusError
from optimus_mllm.io_utils import atomic_write_text, read_versioned_json
from optimus_mllm.planner import PlannerResult
from optimus_mllm.planner.plans import ParallelPlan
from optimus_mllm.scheduler.artifact_checks import validate_artifact, validate_for_job
from optimus_mllm.scheduler.bubble_scheduler import Schedule, best_schedule
from optimus_mllm.scheduler.fingerprint import fingerprint_difference, schedule_fingerprint

ARTIFACT_FORMAT = "optimus-schedule"
ARTIFACT_VERSION = 3  # 2: the config's fingerprint; 3: pieces of kernels


def schedule_to_artifact(schedule: Schedule, config: OptimusConfig) -> dict[str, Any]:
    w, tl, t0 = schedule.work, schedule.timeline, schedule.llm_origin_us
    llm_mb = {a: i for i, a in enumerate(schedule.assignment)}
    hooks = [_HookIndex(tl, s, t0) for s in range(tl.pp)]
    stages = []
    for j, stage_list in enumerate(w.stage_gpus):
        for e, gpus in enumerate(stage_list):
            s = w.llm_stage(j, e)
            ops = []
            for c in (c for c in schedule.chains if c.pipeline == j and c.stage == e):
                for run in schedule.runs(c):
                    k = run.kernel
                    ops.append(
                        {
                            "phase": c.phase,
                            "microbatch": llm_mb[(j, c.local_microbatch)],
                            "local_microbatch": c.local_microbatch,
                            "encoder": k.encoder,
                            "layer": k.layer,
                            "kernel": k.name,
                            "kernel_index": run.index,
                            "piece": list(run.piece),
                            "is_comm": k.is_comm,
                            "window": c.window,
                            "start_us": round(run.start_us, 3),
                            "end_us": round(run.end_us, 3),
                            "hook": hooks[s].hook(c.window, run.start_us),
                        }
                    )
            ops.sort(key=lambda op: (op["start_us"], op["phase"] == "bwd"))
            stages.append(
                {
                    "encoder_pipeline": j,
                    "encoder_stage": e,
                    "llm_stage": s,
                    "gpus": list(gpus),
                    "ops": ops,
                }
            )
    return {
        "format": ARTIFACT_FORMAT,
        "version": ARTIFACT_VERSION,
        "config": config.name,
        "fingerprint": schedule_fingerprint(config),
        "num_gpus": config.cluster.num_gpus,
        "llm_plan": schedule.llm_plan.as_dict(),
        "encoder_plan": schedule.encoder_plan.as_dict(),
        "num_microbatches": tl.num_microbatches,
        "partition": list(schedule.partition),
        "assignment": [list(a) for a in schedule.assignment],
        "warmup": list(schedule.dep.warmup),
        "default_warmup": list(schedule.dep.default_warmup),
        "predicted": {
            "iteration_us": schedule.iteration_us,
            "coarse_iteration_us": schedule.coarse_iteration_us,
            "llm_origin_us": t0,
            "F": list(schedule.forward_dependency_us),
            "B": list(schedule.backward_dependency_us),
            "EF": list(schedule.encoder_forward_end_us),
            "EB": list(schedule.encoder_backward_start_us),
        },
        "llm_kernels": {
            f"{s}/{c}/{phase}": [k.name for k in work.kernels]
            for (s, c, phase), work in sorted(tl.work.items())
        },
        "encoder_stages": stages,
    }


class _HookIndex:
    """The LLM kernels of one stage in launch order, to name the one an encoder kernel follows."""

    def __init__(self, tl, stage: int, t0: float):
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.names: list[dict[str, Any]] = []
        for op in tl.stages[stage].ops:
            for index, k in enumerate(tl.work[(stage, op.chunk, op.phase)].kernels):
                self.starts.append(t0 + op.start_us + k.offset_us)
                self.ends.append(t0 + op.start_us + k.offset_us + k.duration_us)
                self.names.append(
                    {
                        "at": "llm_kernel",
                        "phase": op.phase,
                        "chunk": op.chunk,
                        "microbatch": op.microbatch,
                        "kernel_index": index,
                        "kernel": k.name,
                        "layer": k.layer,
                    }
                )

    def hook(self, window: str, start: float) -> dict[str, Any]:
        if window == "pre":
            return {"at": "before_first_compute"}
        if window == "post":
            return {"at": "after_last_compute"}
        i = max(bisect_right(self.starts, start + 1e-6) - 1, 0)
        return {**self.names[i], "after": start >= self.ends[i] - 1e-6}


def write_artifact(schedule: Schedule, config: OptimusConfig, path: str | Path) -> None:
    atomic_write_text(path, json.dumps(schedule_to_artifact(schedule, config)) + "\n")


@dataclass(frozen=True)
class ScheduleArtifact:
    data: dict[str, Any]

    @property
    def llm_plan(self) -> ParallelPlan:
        return ParallelPlan(**self.data["llm_plan"])

    @property
    def encoder_plan(self) -> ParallelPlan:
        return ParallelPlan(**self.data["encoder_plan"])

    def check_matches(
        self, llm_plan: ParallelPlan, encoder_plan: ParallelPlan, num_gpus: int
    ) -> None:
        """Refuse to run a schedule made for another job."""
        if self.data["num_gpus"] != num_gpus:
            raise OptimusError(
                f"schedule artifact was made for {self.data['num_gpus']} GPUs, this job has "
                f"{num_gpus}; re-run optimus-plan for this world size"
            )
        if self.llm_plan != llm_plan:
            raise OptimusError(
                f"schedule artifact has LLM plan {self.llm_plan}, this job uses {llm_plan}; "
                "re-run optimus-plan with this job's plan"
            )
        if self.encoder_plan != encoder_plan:
            raise OptimusError(
                f"schedule artifact has encoder plan {self.encoder_plan}, this job uses "
                f"{encoder_plan}; re-run optimus-plan with this job's plan"
            )


def load_artifact(path: str | Path) -> ScheduleArtifact:
    """Read a schedule artifact and refuse it unless it is whole and consistent
    (``artifact_checks``)."""
    data = read_versioned_json(
        path,
        "schedule artifact",
        ARTIFACT_FORMAT,
        ARTIFACT_VERSION,
        "write one with optimus-plan --artifact",
    )
    validate_artifact(data, f"schedule artifact {path}")
    return ScheduleArtifact(data)


# -- the schedule a training job runs ----------------------------------------------------------


def load_job_artifact(
    path: str | Path, planned: PlannerResult, config: OptimusConfig, num_gpus: int
) -> dict[str, Any]:
    """An artifact from ``optimus-plan --artifact``, refused unless it was made for this job.

    Everything here is decided from the files alone, so every rank refuses the same artifact before
    any of them connects."""
    artifact = load_artifact(path)
    difference = fingerprint_difference(artifact.data["fingerprint"], schedule_fingerprint(config))
    if difference is not None:
        raise OptimusError(
            f"schedule artifact {path} was made with {difference}; re-run optimus-plan "
            "--artifact for this config"
        )
    allowed = [c.plan for c in planned.candidates]
    # a fixed parallel.encoder is the job's encoder plan; otherwise any plan the planner keeps will
    # do
    expected = (
        allowed[0] if config.parallel.encoder is not None and allowed else artifact.encoder_plan
    )
    artifact.check_matches(planned.llm_plan, expected, num_gpus)
    if expected not in allowed:
        raise OptimusError(
            f"schedule artifact has encoder plan {expected}, which the planner rejects for this "
            "config (see optimus-plan); re-run optimus-plan for this config"
        )
    validate_for_job(artifact.data, config, f"schedule artifact {path}")
    return artifact.data


def schedule_job_artifact(config: OptimusConfig, planned: PlannerResult) -> dict[str, Any]:
    """Schedule the job now (what ``optimus-plan --artifact`` would write)."""
    best = best_schedule(config, planned, CostModel.from_config(config)).best
    if best is None:
        raise OptimusError(
            "no encoder plan could be scheduled (see optimus-plan); try the Megatron-style baseline"
        )
    return schedule_to_artifact(best, config)
