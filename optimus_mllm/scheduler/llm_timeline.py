"""The LLM's timeline for one pipeline: Megatron's (interleaved) 1F1B with every kernel placed.

Op order per pipeline rank is megatron-core's: ``get_schedule_table`` order of (microbatch, chunk)
for forwards, the same order with the chunk mirrored for backwards, ``warmup`` forwards first, then
one forward and one backward at a time, then the remaining backwards. A rank runs its ops in that
order, each as soon as its input has arrived (P2P overlapped with compute, as with
``overlap_p2p_comm``). Inside an op the layer kernels run back to back on the compute stream; TP
collectives block it (these are the TP bubbles), except those megatron-core runs asynchronously
under a GEMM (``KernelItem.hidden``), which hold the link but not the compute stream. All TP ranks
of a stage have the same timeline.

Times are microseconds from the start of the first LLM computation (the LLM's origin); the DP
all-gather before it and the reduce-scatter after are kept separately.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from optimus_mllm.costing.cost_model import Phase
from optimus_mllm.scheduler.pipeline_order import default_warmup, pipeline_producer, rank_op_order


class KernelItem(NamedTuple):
    """A kernel of an op, in launch order, before it is placed (``OpWork.sequential``)."""

    name: str
    layer: int  # layer index within the whole LLM; -1 for embedding / output layer
    is_comm: bool
    duration_us: float
    # a collective launched asynchronously under the compute kernel after it: it starts with that
    # kernel and holds the link, not the compute stream (the wait for any rest is its own item)
    hidden: bool = False

    @property
    def stream_us(self) -> float:
        """The time it holds the compute stream."""
        return 0.0 if self.hidden else self.duration_us


@dataclass(frozen=True)
class KernelSlot:
    """A kernel's position inside an op: offsets from the op's start."""

    name: str
    layer: int  # layer index within the whole LLM; -1 for embedding / output layer
    is_comm: bool
    offset_us: float
    duration_us: float
    hidden: bool = False  # as ``KernelItem.hidden``


Intervals = list[tuple[float, float]]


@dataclass(frozen=True)
class OpWork:
    """The kernels of one chunk's forward or backward on one stage (same for every microbatch)."""

    kernels: tuple[KernelSlot, ...]

    @property
    def duration_us(self) -> float:
        # a hidden collective never ends after the GEMM it runs under, which comes after it
        return self.kernels[-1].offset_us + self.kernels[-1].duration_us if self.kernels else 0.0

    @staticmethod
    def sequential(items: Sequence[KernelItem]) -> OpWork:
        """Lay the kernels back to back on the compute stream, each hidden collective beside the
        kernel after it."""
        slots, t = [], 0.0
        for k in items:
            slots.append(KernelSlot(k.name, k.layer, k.is_comm, t, k.duration_us, k.hidden))
            t += k.stream_us
        return OpWork(tuple(slots))

    def items(self) -> list[KernelItem]:
        """Its kernels as ``sequential`` takes them."""
        return [
            KernelItem(k.name, k.layer, k.is_comm, k.duration_us, k.hidden) for k in self.kernels
        ]


@dataclass(frozen=True)
class PipelineOp:
    stage: int
    chunk: int
    microbatch: int
    phase: Phase
    start_us: float
    end_us: float


@dataclass
class StageTimeline:
    stage: int
    warmup: int
    ops: list[PipelineOp] = field(default_factory=list)

    @property
    def first_compute_us(self) -> float:
        return self.ops[0].start_us

    @property
    def last_compute_us(self) -> float:
        return self.ops[-1].end_us


@dataclass
class LLMTimeline:
    """One LLM pipeline's iteration (all times relative to the LLM's origin)."""

    pp: int
    vp: int
    num_microbatches: int
    stages: list[StageTimeline]
    work: dict[tuple[int, int, Phase], OpWork]  # (stage, chunk, phase) -> kernels
    p2p_us: float
    dp_all_gather_us: list[float]  # per stage, exposed before the first computation
    dp_reduce_scatter_us: list[float]  # per stage, exposed after the last computation
    # the encoder cannot run while the LLM waits for a TP collective: on CPU ranks the runtime runs
    # encoder ops inline on the one thread that waits (a GPU runs them on a side stream)
    tp_comm_is_busy: bool = False
    # per stage: its optimizer step, after its gradients are reduced (0 without a profile)
    optimizer_step_us: list[float] | None = None
    # the schedule's host work after each op's kernels (``simulate``'s ``op_host_us``): busy
    op_host_us: float = 0.0

    def stage_optimizer_us(self, stage: int) -> float:
        return self.optimizer_step_us[stage] if self.optimizer_step_us else 0.0

    @property
    def forward_dependency_points(self) -> list[float]:
        """F_i: when the first stage starts chunk 0's forward of microbatch i (needs A_i)."""
        return [op.start_us for op in self._first_chunk_ops("fwd")]

    @property
    def backward_dependency_points(self) -> list[float]:
        """B_i: when the first stage finishes chunk 0's backward of microbatch i (produces G_i)."""
        return [op.end_us for op in self._first_chunk_ops("bwd")]

    def _first_chunk_ops(self, phase: Phase) -> list[PipelineOp]:
        ops = sorted(
            (op for op in self.stages[0].ops if op.chunk == 0 and op.phase == phase),
            key=lambda op: op.microbatch,
        )
        return ops

    @property
    def compute_end_us(self) -> float:
        """Relative time when the last LLM computation of any stage ends."""
        return max(s.last_compute_us for s in self.stages)

    @property
    def origin_us(self) -> float:
        """Earliest start of the LLM's computation: every stage's DP all-gather done before its
        first op."""
        return max(
            0.0, max(ag - s.first_compute_us for s, ag in zip(self.stages, self.dp_all_gather_us))
        )

    @property
    def tail_us(self) -> float:
        """From the LLM's origin to the end of the last stage's reduce-scatter and optimizer
        step."""
        return max(
            s.last_compute_us + rs + self.stage_optimizer_us(i)
            for i, (s, rs) in enumerate(zip(self.stages, self.dp_reduce_scatter_us))
        )

    @property
    def iteration_us(self) -> float:
        """One training step of the LLM alone: all-gather, computation, reduce-scatter."""
        return self.origin_us + self.tail_us

    def kernel_intervals(self, stage: int) -> tuple[Intervals, Intervals, Intervals]:
        """A stage's (compute, tp_comm, hidden_comm) intervals, each in time order: its compute
        kernels and each op's host work after them, the TP collectives its compute stream waits
        for (the TP bubbles), and those it runs under a GEMM (they hold the link only)."""
        compute: Intervals = []
        comm: Intervals = []
        hidden: Intervals = []
        for op in self.stages[stage].ops:
            for k in self.work[(stage, op.chunk, op.phase)].kernels:
                if k.duration_us <= 0:
                    continue
                start = op.start_us + k.offset_us
                into = (hidden if k.hidden else comm) if k.is_comm else compute
                into.append((start, start + k.duration_us))
            if self.op_host_us > 0:
                compute.append((op.end_us - self.op_host_us, op.end_us))
        return compute, comm, hidden


# (stage, chunk, microbatch, phase) -> the op's duration
OpDuration = Callable[[int, int, int, Phase], float]


class PipelineDeadlock(Exception):
    """The op orders cannot all make progress (only possible with a hand-made warm-up)."""


def simulate(
    pp: int,
    vp: int,
    num_microbatches: int,
    work: dict[tuple[int, int, Phase], OpWork],
    p2p_us: float,
    warmup: list[int] | None = None,
    group_size: int | None = None,
    input_ready_us: list[float] | None = None,
    op_us: OpDuration | None = None,
    op_host_us: float = 0.0,
) -> list[StageTimeline]:
    """Run the pipeline: every op starts when its rank is free and its input has arrived.

    ``input_ready_us[i]``, if given, is when microbatch i's input (the encoder output) reaches the
    first stage; by default inputs are ready at time 0. ``op_us``, if given, is each op's duration
    where it differs by microbatch (a baseline that runs a microbatch's own encoder work inside an
    LLM op); by default its ``work``'s. ``op_host_us``: the schedule's host work each op adds after
    its kernels (``CostModel.microbatch_host_us``), so the kernels keep their offsets from the op's
    start.
    """
    group = group_size or pp
    warmups = (
        warmup
        if warmup is not None
        else [default_warmup(pp, vp, num_microbatches, s, group) for s in range(pp)]
    )
    orders = [rank_op_order(num_microbatches, vp, warmups[s], group) for s in range(pp)]
    done: dict[tuple[int, int, int, Phase], float] = {}
    stages = [StageTimeline(s, warmups[s]) for s in range(pp)]
    cursor = [0] * pp
    free = [0.0] * pp
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(pp):
            order = orders[s]
            while cursor[s] < len(order):
                mb, chunk, phase = order[cursor[s]]
                ready = _input_ready(s, chunk, mb, phase, pp, vp, p2p_us, done, input_ready_us)
                if ready is None:
                    break
                start = max(free[s], ready)
                if op_us is None:
                    kernels_us = work[(s, chunk, phase)].duration_us
                else:
                    kernels_us = op_us(s, chunk, mb, phase)
                end = start + kernels_us + op_host_us
                done[(s, chunk, mb, phase)] = end
                stages[s].ops.append(PipelineOp(s, chunk, mb, phase, start, end))
                free[s] = end
                cursor[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise PipelineDeadlock(
                f"warm-up {warmups} deadlocks with pp={pp}, vp={vp}, "
                f"{num_microbatches} microbatches"
            )
    return stages


def _input_ready(
    s: int,
    chunk: int,
    mb: int,
    phase: Phase,
    pp: int,
    vp: int,
    p2p_us: float,
    done: dict,
    input_ready_us: list[float] | None,
) -> float | None:
    """When op (s, chunk, mb, phase)'s input is available, or None if its producer has not run."""
    producer = pipeline_producer(s, chunk, phase, pp, vp)
    if producer is None:
        if phase == "bwd":  # the loss is on the same rank: no transfer
            return done.get((s, chunk, mb, "fwd"))
        return input_ready_us[mb] if input_ready_us is not None else 0.0
    end = done.get((*producer, mb, phase))
    return None if end is None else end + p2p_us
