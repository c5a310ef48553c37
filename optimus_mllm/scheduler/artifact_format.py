"""The schedule artifact's contents as frozen dataclasses: what the scheduler writes and the runtime
runs. Pure Python, no torch, and nothing of the scheduler's own modules: the runtime reads the
schedule from these types alone, never from the code that made it.

The JSON file is ``to_json(artifact)``; ``artifact_from_json`` reads it back with the config's
loader (``typed_load``): every field typed, a wrong one refused in one line naming its path in the
file (``encoder_stages[3].ops[17].piece``). That the fields fit together is ``artifact_checks``'
job.

Microbatches are numbered four ways, each field saying which: an LLM pipeline's own
(``microbatch``: 0 .. num_microbatches - 1, the order its first stage runs them in), the LLM
pipeline's data order (``llm_order``: the data microbatch each LLM microbatch runs), an encoder
pipeline's own (``local_microbatch`` of ``encoder_pipeline``), and the job's (the global index,
which picks a sample and seeds dropout; not stored here). ``assignment`` (the paper's global
ordering) lists the encoder microbatches and ``feeds`` the LLM microbatch each one feeds: a job's
schedule feeds LLM microbatch i from encoder microbatch i in data order; a per-iteration schedule
(``per_iteration``) runs the imageless microbatches first, feeds them from none, and may feed one
from several encoder microbatches, ``images_per_chain`` images each.
``runtime.microbatches`` converts between all of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from optimus_mllm.config.typed_load import load_typed, to_json
from optimus_mllm.errors import OptimusError
from optimus_mllm.planner.plans import ParallelPlan

ARTIFACT_FORMAT = "optimus-schedule"
# 2: the config's fingerprint; 3: pieces of kernels; 4: typed fields with readable names, the LLM
# op order per stage, ops listed in the order they run; 5: the LLM's data order (``llm_order``) and
# the LLM microbatch each encoder microbatch feeds (``feeds``), with how many of its images
# (``images_per_chain``)
ARTIFACT_VERSION = 5

Phase = Literal["fwd", "bwd"]
HookKind = Literal["before_first_compute", "llm_kernel", "after_last_compute"]
Window = Literal["pre", "llm", "post"]  # the scheduler's window: before, inside or after the LLM's
FingerprintValue = str | int | float | bool | None


@dataclass(frozen=True)
class EncoderMicrobatch:
    """A microbatch as an encoder pipeline numbers it."""

    encoder_pipeline: int
    local_microbatch: int


@dataclass(frozen=True)
class LLMOp:
    """One forward or backward of one model chunk of the LLM, for one microbatch."""

    microbatch: int  # the LLM pipeline's own numbering
    chunk: int  # model chunk (virtual stage) on this pipeline rank
    phase: Phase


@dataclass(frozen=True)
class LLMKernelHook:
    """The LLM kernel an ``llm_kernel`` hook names: kernel ``kernel_index`` of ``op`` on this GPU.

    ``after`` true means once it has finished (the encoder kernel fills the bubble that follows),
    false means while it runs (an encoder compute kernel in a TP collective's bubble, or an encoder
    collective under LLM compute). ``kernel`` and ``layer`` describe it for a reader; the runtime
    goes by ``kernel_index``."""

    op: LLMOp
    kernel_index: int
    kernel: str
    layer: int
    after: bool


@dataclass(frozen=True)
class Hook:
    """When an encoder op is launched: a moment of the LLM's own execution on that GPU, never a
    time. ``before_first_compute``: before the LLM's first forward on the GPU (coarse forward);
    ``llm_kernel``: at ``llm_kernel`` (fine-grained); ``after_last_compute``: after its last
    backward (coarse backward). ``llm_kernel`` is set for that kind only."""

    at: HookKind
    llm_kernel: LLMKernelHook | None = None


@dataclass(frozen=True)
class EncoderOp:
    """One encoder kernel (or a piece of it) of one microbatch on one encoder stage."""

    phase: Phase
    microbatch: int  # the LLM microbatch it feeds (``feeds``)
    local_microbatch: int  # the same microbatch in its encoder pipeline's numbering
    encoder: str
    layer: int
    kernel: str
    kernel_index: int  # position in the stage's forward or backward chain
    # [lo, hi): the share of the kernel's tokens it runs, as fractions; (0, 1) is the whole kernel.
    # A kernel the job's encoder can split (``EncoderKernel.splittable``) may run as several pieces
    # that tile [0, 1], in order.
    piece: tuple[float, float]
    is_comm: bool
    window: Window
    start_us: float  # predicted, from the LLM's origin
    end_us: float
    hook: Hook


@dataclass(frozen=True)
class EncoderStageSchedule:
    """What one encoder stage runs: on the ``gpus`` of LLM stage ``llm_stage`` (GPUs numbered within
    one LLM pipeline, ``llm_stage * TP_llm + tp_rank``), its ops in the order they run."""

    encoder_pipeline: int
    encoder_stage: int
    llm_stage: int
    gpus: tuple[int, ...]
    ops: tuple[EncoderOp, ...]


@dataclass(frozen=True)
class Prediction:
    """The scheduler's predictions, in microseconds; per-microbatch lists by encoder microbatch
    (``assignment``), the dependency points those of the LLM microbatch each one feeds."""

    iteration_us: float
    coarse_iteration_us: float  # the same encoder plan scheduled coarse (the paper's ablation)
    llm_origin_us: float  # when the LLM's first computation starts
    forward_dependency_us: tuple[float, ...]  # F_i: the first LLM stage needs A_i
    backward_dependency_us: tuple[float, ...]  # B_i: the first LLM stage has made G_i
    encoder_forward_end_us: tuple[float, ...]  # EF_i: A_i has reached the first LLM stage
    encoder_backward_start_us: tuple[float, ...]  # EB_i: the encoder starts i's backward


@dataclass(frozen=True)
class ScheduleArtifact:
    """The versioned contract between the scheduler and the runtime.

    ``fingerprint``: the settings of the config it was made for that shape its schedule. The LLM
    side: ``warmup`` (forwards before the first backward, per LLM stage; ``default_warmup`` is
    megatron-core's) and ``llm_op_order``, the ops each LLM stage runs in megatron-core's order
    under that warm-up, which hooks name; ``llm_kernels["stage/chunk/phase"]``, the names of an LLM
    op's kernels, which ``kernel_index`` counts; ``llm_order``, the data microbatch each LLM
    microbatch runs. The encoder side: ``partition`` (encoder microbatches per encoder pipeline),
    ``assignment`` (the encoder microbatches in the global ordering), ``feeds`` (the LLM microbatch
    each one feeds) and ``images_per_chain`` (how many of its images), and per encoder stage its
    ops with their hooks. All LLM pipelines of the job run the same schedule."""

    format: str
    version: int
    config: str
    fingerprint: dict[str, FingerprintValue]
    num_gpus: int
    llm_plan: ParallelPlan
    encoder_plan: ParallelPlan
    num_microbatches: int  # per LLM pipeline
    # per LLM microbatch: the data microbatch it runs (this LLM pipeline's, in data order)
    llm_order: tuple[int, ...]
    partition: tuple[int, ...]
    assignment: tuple[EncoderMicrobatch, ...]  # per encoder microbatch
    # per encoder microbatch: the LLM microbatch it feeds; an LLM microbatch fed by none has no
    # encoder work
    feeds: tuple[int, ...]
    # the most images of one encoder microbatch: an LLM microbatch fed by several gets its images
    # from them in ``feeds``' order, this many from each (the last one the rest); None: one encoder
    # microbatch runs all the images of the LLM microbatch it feeds
    images_per_chain: int | None
    warmup: tuple[int, ...]
    default_warmup: tuple[int, ...]
    llm_op_order: tuple[tuple[LLMOp, ...], ...]  # per LLM stage
    predicted: Prediction
    llm_kernels: dict[str, tuple[str, ...]]
    encoder_stages: tuple[EncoderStageSchedule, ...]

    def check_matches(
        self, llm_plan: ParallelPlan, encoder_plan: ParallelPlan, num_gpus: int
    ) -> None:
        """Refuse to run a schedule made for another job."""
        if self.num_gpus != num_gpus:
            raise OptimusError(
                f"schedule artifact was made for {self.num_gpus} GPUs, this job has "
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

    def kernels_of(self, stage: int, op: LLMOp) -> tuple[str, ...]:
        """The names of the kernels LLM op ``op`` runs on ``stage``."""
        return self.llm_kernels[f"{stage}/{op.chunk}/{op.phase}"]


def artifact_from_json(data: dict[str, Any]) -> ScheduleArtifact:
    """The artifact of a parsed file; ConfigError naming the first field of the wrong type."""
    return load_typed(ScheduleArtifact, data, "")


def artifact_to_json(artifact: ScheduleArtifact) -> dict[str, Any]:
    return to_json(artifact)
