"""Each step's bubble schedule, built while the step before trains
(``training.schedule_per_iteration``).

On a webdataset every microbatch's images are known before its step without decoding an image
(``ImageCount``), so the workload of iteration k+1 is submitted to an ``IterationScheduler`` when
step k starts, and built on its background thread while step k trains. Before step k+1 the runtime
takes that iteration's schedule, or the fallback where it is not built in time: the schedule for
``data.max_images_per_microbatch`` images in every microbatch, built when the job starts for the
artifact's encoder plan, which holds for any batch within that maximum. The step then runs the
chosen schedule as a schedule artifact (``schedule_to_artifact``): its hook plan, LLM warm-up and op
order, the data microbatch each LLM microbatch runs (``llm_order``: an iteration's own schedule runs
its imageless microbatches first), the LLM microbatch each encoder microbatch feeds (``feeds``: none
for an imageless microbatch, which then waits on no encoder; several, ``images_per_chain`` images
each, for one whose images the schedule splits, joined in image order at the LLM's first stage), and
the message shapes that follow. The fallback runs in data order, one encoder microbatch per LLM
microbatch.

Only the order of the step's sums changes with ``llm_order``: each microbatch keeps its samples,
its dropout seed (the job's microbatch number) and its image tokens (a split microbatch's parts run
the same per-image ViT, without dropout across images), so its loss and gradients are the
baseline's; megatron-core adds the microbatches' losses and gradients into its buffers in the order
they run, and float addition in another order differs in the last bits only (the tests compare at
relative 1e-5). An encoder with dropout draws a split microbatch's masks per part, from the same
seed: not the masks one whole batch draws.

Agreement. Every rank of one LLM pipeline must run the same schedule. Each rank builds its own
pipeline's schedule from the same workload, and the build is deterministic (pure Python, no clock or
randomness in its choices); the one thing timing decides, whether the build is done by the step, is
agreed before each step by one gather over the world of every rank's ``ready`` flag: where any rank
is late, every rank runs the fallback. The same gather carries each rank's digest of the schedule it
would run, so ranks of one pipeline that built different schedules fail loudly instead of hanging.
Rank 0 building and broadcasting was not chosen: it would have to build every LLM pipeline's
schedule and send a large object each step, while the flag and digest are two integers per rank.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch.distributed as dist

from optimus_mllm.config import OptimusConfig
from optimus_mllm.costing.cost_model import CostModel
from optimus_mllm.costing.workload import (
    EncoderWorkload,
    IterationWorkload,
    max_images_per_microbatch,
)
from optimus_mllm.errors import OptimusError
from optimus_mllm.planner import plan
from optimus_mllm.planner.plans import ParallelPlan
from optimus_mllm.scheduler.artifact import artifact_text, schedule_to_artifact
from optimus_mllm.scheduler.artifact_checks import validate_artifact
from optimus_mllm.scheduler.artifact_format import ScheduleArtifact
from optimus_mllm.scheduler.bubble_scheduler import ChainMoves, Schedule, bubble_scheduler
from optimus_mllm.scheduler.dependencies import get_enc_llm_dep
from optimus_mllm.scheduler.fine import LLMBubbles
from optimus_mllm.scheduler.per_iteration import (
    IterationPlan,
    IterationSchedule,
    IterationScheduler,
    Source,
    schedule_iteration,
)

# this replica's workload of an iteration, every microbatch of the job checked against the maximum
WorkloadOf = Callable[[int], IterationWorkload]


@dataclass(frozen=True)
class StepSchedule:
    """The schedule one step runs."""

    iteration: int
    artifact: ScheduleArtifact
    source: Source
    reason: str  # why the fallback runs; "" for the iteration's own schedule
    reused: bool  # the iteration's own schedule was an earlier iteration's (no search ran)

    @property
    def text(self) -> str:
        """For the step line: which schedule ran, and why where it is the fallback."""
        if self.source == "fallback":
            return f"fallback ({self.reason})"
        return "per-iteration (reused)" if self.reused else "per-iteration"


class IterationSchedules:
    """This rank's schedules: each submitted a step ahead, agreed and taken at its step."""

    def __init__(
        self,
        config: OptimusConfig,
        llm_plan: ParallelPlan,
        artifact: ScheduleArtifact,
        workload_of: WorkloadOf,
        pipeline: int,
    ):
        """``artifact``: the job's schedule, whose encoder plan every step's schedule keeps;
        ``workload_of``: iteration -> this LLM pipeline's workload; ``pipeline``: this rank's LLM
        pipeline (its data-parallel replica), whose ranks must run one schedule."""
        self.config, self.llm_plan = config, llm_plan
        self.workload_of, self.pipeline = workload_of, pipeline
        candidates = [c for c in plan(config).candidates if c.plan == artifact.encoder_plan]
        if not candidates:
            raise OptimusError(
                f"training.schedule_per_iteration: the artifact's encoder plan "
                f"{artifact.encoder_plan} is not one the planner keeps; re-run optimus-plan"
            )
        self.candidate, self.cost = candidates[0], CostModel.from_config(config)
        self.bubbles = LLMBubbles.of(get_enc_llm_dep(config, llm_plan, self.cost))
        most = max_images_per_microbatch(config)
        maximum = (EncoderWorkload.of_images(config, most),) * artifact.num_microbatches
        # the chains and moves every build shares (``ChainMoves``; builds run one at a time, on
        # the scheduler's thread), the fallback's among them
        self.chains = ChainMoves(config, llm_plan, self.candidate.plan, self.bubbles, self.cost)
        fallback, _ = bubble_scheduler(
            config,
            llm_plan,
            self.candidate,
            self.bubbles,
            self.cost,
            workload=maximum,
            chains=self.chains,
        )
        if fallback is None:
            raise OptimusError(
                f"data.max_images_per_microbatch={most}: encoder plan {artifact.encoder_plan} has "
                "no schedule for it; lower it or train without training.schedule_per_iteration"
            )
        # schedule -> its artifact (in data order) and digest, made on the build thread; a key
        # holds its schedule
        self._artifacts: dict[int, tuple[Schedule, ScheduleArtifact, int]] = {}
        # (schedule, LLM order) -> the artifact a step runs: iterations whose workloads differ only
        # in where their imageless microbatches are share a schedule, not an order
        self._ordered: dict[tuple[int, tuple[int, ...]], ScheduleArtifact] = {}
        self._convert(fallback, None)
        self.scheduler = IterationScheduler(self._build, fallback)
        self._submitted: set[int] = set()

    def for_step(self, iteration: int) -> StepSchedule:
        """``iteration``'s schedule, agreed by every rank; iteration + 1's build started (it runs
        while this step trains). Collective: every rank calls it before every step."""
        self._submit(iteration)
        self._submit(iteration + 1)
        ready = self.scheduler.ready(iteration)
        digest = self._digest(iteration) if ready else None
        seen: list = [None] * dist.get_world_size()
        dist.all_gather_object(seen, (self.pipeline, ready, digest))
        everywhere = all(r for _, r, _ in seen)
        taken = self.scheduler.take(iteration, ready_elsewhere=everywhere)
        self._submitted.discard(iteration)
        if everywhere:
            digests = {d for p, _, d in seen if p == self.pipeline}
            if len(digests) != 1:
                raise RuntimeError(
                    f"iteration {iteration}: the ranks of LLM pipeline {self.pipeline} built "
                    f"different schedules ({len(digests)} digests)"
                )
        return self._step_schedule(taken)

    def close(self) -> None:
        """Stop building; a build still running is not waited for."""
        self.scheduler.close(wait=False)

    def _submit(self, iteration: int) -> None:
        if iteration not in self._submitted:
            self._submitted.add(iteration)
            self.scheduler.submit(iteration, self.workload_of(iteration))

    def _build(self, workload: IterationWorkload) -> IterationSchedule | None:
        """On the build thread: the workload's schedule, and its artifact for the step."""
        built = schedule_iteration(
            self.config,
            self.llm_plan,
            self.candidate,
            self.bubbles,
            self.cost,
            workload,
            bound_us=self.scheduler.fallback.iteration_us,
            chains=self.chains,
        )
        if built is not None:
            self._convert(built.schedule, built.images_per_chain)
        return built

    def _convert(self, schedule: Schedule, images_per_chain: int | None) -> None:
        artifact = schedule_to_artifact(schedule, self.config, images_per_chain=images_per_chain)
        validate_artifact(artifact, "a per-iteration schedule")
        digest = zlib.crc32(artifact_text(artifact).encode())
        self._artifacts[id(schedule)] = (schedule, artifact, digest)

    def _digest(self, iteration: int) -> int | None:
        """The digest of the schedule, and the LLM order, ``iteration`` would run if every rank is
        ready."""
        built = self.scheduler.built(iteration)
        if built is None:
            return self._artifacts[id(self.scheduler.fallback)][2]
        digest = self._artifacts[id(built.schedule)][2]
        return zlib.crc32(repr(self.scheduler.llm_order(iteration)).encode(), digest)

    def _step_schedule(self, taken: IterationPlan) -> StepSchedule:
        _, artifact, _ = self._artifacts[id(taken.schedule)]
        if artifact.llm_order != taken.llm_order:
            key = (id(taken.schedule), taken.llm_order)
            if key not in self._ordered:
                self._ordered[key] = replace(artifact, llm_order=taken.llm_order)
            artifact = self._ordered[key]
        return StepSchedule(taken.iteration, artifact, taken.source, taken.reason, taken.reused)
