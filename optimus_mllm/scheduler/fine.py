"""Fine-grained scheduling (paper §4.3, ScheduleKernels): encoder chains placed kernel by kernel into
the LLM's bubbles, and the moves a plan's partitions share.

An encoder stage's compute kernels go into its LLM stage's idle compute-stream time (TP and PP
bubbles), its communication kernels into time with no LLM TP collective (mostly under LLM compute,
paper Fig. 7). Placement is first-fit, in tau (time from the LLM's origin t0).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

from optimus_mllm.scheduler.coarse import PostWindow, PreWindow
from optimus_mllm.scheduler.dependencies import EncLLMDep
from optimus_mllm.scheduler.encoder_costs import EncoderWork, StageChain
from optimus_mllm.scheduler.intervals import FreeIntervals
from optimus_mllm.scheduler.llm_timeline import LLMTimeline
from optimus_mllm.scheduler.lower_bound import Lengths


@dataclass(frozen=True)
class LLMBubbles:
    """What every encoder plan's scheduling shares: dependency points and the LLM's bubbles per stage."""

    dep: EncLLMDep
    gaps: list[tuple[FreeIntervals, FreeIntervals]]  # per stage: (idle compute, no-TP-collective) time
    lengths: list[Lengths]  # per stage: its idle compute time by bubble length, for the lower bound

    @classmethod
    def of(cls, dep: EncLLMDep) -> LLMBubbles:
        gaps = stage_gaps(dep.timeline)
        return cls(dep, gaps, [Lengths.of_gaps(compute) for compute, _ in gaps])


def stage_gaps(timeline: LLMTimeline) -> list[tuple[FreeIntervals, FreeIntervals]]:
    """Per LLM stage: (idle compute-stream time, time without an LLM TP collective) inside its span."""
    gaps = []
    for s, stage in enumerate(timeline.stages):
        compute, comm = timeline.kernel_intervals(s)
        lo, hi = stage.first_compute_us, stage.last_compute_us
        gaps.append((FreeIntervals.complement(compute, lo, hi), FreeIntervals.complement(comm, lo, hi)))
    return gaps


# A chain as first-fit placed it: its kernels' starts, and the (compute, comm) time they take as flat
# start, end, ... arrays, back-to-back kernels of one stream as one span (a plan keeps every move it placed)
Placement = tuple[list[float], tuple[array, array]]


@dataclass
class Resource:
    """The GPUs of one encoder stage: their LLM stage's free compute time and comm-allowed time (tau)."""

    llm_stage: int
    compute: FreeIntervals
    comm: FreeIntervals

    def copy(self) -> Resource:
        return Resource(self.llm_stage, self.compute.copy(), self.comm.copy())

    def place_chain(self, chain: StageChain, ready: float, limit: float) -> Placement | None:
        """First-fit the chain's kernels in order into the bubbles; None if they do not fit."""
        starts, t = [], ready
        spans = (array("d"), array("d"))  # compute, comm
        # Per stream (compute, comm): the free interval of its last kernel. A kernel that fits in it from t
        # starts at t, which is what first-fit returns, without searching.
        free, current = (self.compute, self.comm), [(0.0, -1.0), (0.0, -1.0)]
        for d, is_comm in chain.steps:
            lo, hi = current[is_comm]
            end = t + d
            if lo <= t < hi and end <= hi and end <= limit:
                start = t
            else:
                fit = free[is_comm].earliest_fit(t, d, limit)
                if fit is None:
                    return None
                start, lo, hi = fit
                current[is_comm] = (lo, hi)
                end = start + d
            starts.append(start)
            stream = spans[is_comm]
            if stream and stream[-1] == start:  # back to back on its stream: one span
                stream[-1] = end
            else:
                stream.extend((start, end))
            t = end
        return starts, spans


@dataclass(frozen=True)
class Move:
    """One microbatch's chains as placed on every stage of an encoder pipeline: the kernels' starts (tau)
    and, per stage, the spans they take from the compute and the comm stream. Moves are shared by a
    plan's partitions, and each partition takes the same spans from its own copy of the bubbles."""

    starts: list[list[float]]
    busy: list[tuple[array, array]]  # per stage: (compute, comm) spans as flat start, end, start, end, ...

    @classmethod
    def of(cls, placements: list[Placement]) -> Move:
        return cls([starts for starts, _ in placements], [spans for _, spans in placements])

    def take(self, resources: list[Resource]) -> None:
        """Occupy the move's spans in a pipeline's bubbles (a stage without kernels takes nothing)."""
        for r, (compute, comm) in zip(resources, self.busy):
            for free, spans in ((r.compute, compute), (r.comm, comm)):
                pairs = iter(spans)
                for start, end in zip(pairs, pairs):
                    free.occupy(start, end)


class PipelineMoves:
    """One encoder pipeline's microbatches moved into the LLM's bubbles, shared by all partitions of a plan.

    OptimizeSchedule's forward pass moves pipeline j's microbatches one at a time, each from the
    pipeline's first LLM computation up to the same limit, into bubbles that only j's earlier forward
    moves have taken, and ends at the first move it rejects. So j's t-th move lands at the same times
    whatever the partition, and is placed here once. The bubbles left after t moves are rebuilt from
    a copy taken every ``SNAPSHOT_EVERY`` moves plus the moves since.

    A backward move of LLM microbatch i's encoder work lands where the bubbles left by j's t forward
    moves and its earlier backward moves put it, so its placement is kept by (t, the LLM microbatches
    moved before, i) too: partitions that move the same microbatches in the same order reuse it.

    The pipeline's coarse windows do not depend on the partition either: every layout a partition
    needs is a prefix of one pre window and, mostly, of one post window (see ``PostWindow``).
    """

    SNAPSHOT_EVERY = 8

    def __init__(self, work: EncoderWork, dep: EncLLMDep, gaps: list[tuple[FreeIntervals, FreeIntervals]], j: int):
        self.work, self.j = work, j
        stages = [work.llm_stage(j, e) for e in range(len(work.fwd))]
        self.first = [dep.timeline.stages[s].first_compute_us for s in stages]
        # the LLM's last forward dependency point bounds every encoder forward's end
        self.limit = max(dep.forward) - work.to_llm_us[j]
        self.builder = [Resource(s, gaps[s][0].copy(), gaps[s][1].copy()) for s in stages]
        self.moves: list[Move] = []  # t -> the t-th forward move
        self.forward_ends: list[float] = []  # t -> its EF (tau): when its output reaches the first LLM stage
        self.exhausted = False  # move len(moves) does not fit
        self.snapshots = {0: [r.copy() for r in self.builder]}
        self.backward: dict[tuple[int, tuple[int, ...], int], Move | None] = {}
        self.pre = PreWindow.of(work, j, len(dep.forward), self.first)  # no partition gives j more
        self.post = PostWindow([dep.timeline.stages[s].last_compute_us for s in stages], work)

    @classmethod
    def of_pipelines(cls, work: EncoderWork, bubbles: LLMBubbles) -> list[PipelineMoves]:
        """One per encoder pipeline, to share among a plan's partitions."""
        return [cls(work, bubbles.dep, bubbles.gaps, j) for j in range(work.num_pipelines)]

    def move(self, t: int) -> list[list[float]] | None:
        """Per stage kernel starts of the pipeline's t-th forward move (from 0); None if it does not fit."""
        w = self.work
        while len(self.moves) <= t and not self.exhausted:
            placements, ready = [], self.first[0]
            for e, r in enumerate(self.builder):
                placement = r.place_chain(w.fwd[e], max(ready, self.first[e]), self.limit)
                if placement is None:
                    self.exhausted = True
                    return None
                placements.append(placement)
                ready = placement[0][-1] + w.fwd[e].kernels[-1].duration_us + w.p2p_us
            move = Move.of(placements)
            move.take(self.builder)
            self.moves.append(move)
            self.forward_ends.append(move.starts[-1][-1] + w.fwd[-1].kernels[-1].duration_us + w.to_llm_us[self.j])
            if len(self.moves) % self.SNAPSHOT_EVERY == 0:
                self.snapshots[len(self.moves)] = [r.copy() for r in self.builder]
        return self.moves[t].starts if t < len(self.moves) else None

    def resources_after(self, t: int) -> list[Resource]:
        """Per stage: the bubbles left after the first t moves, as fresh copies. Partitions often end
        their forward pass after the same number of moves, so that state is kept too."""
        if t not in self.snapshots:
            base = t - t % self.SNAPSHOT_EVERY
            resources = [r.copy() for r in self.snapshots[base]]
            for move in self.moves[base:t]:
                move.take(resources)
            self.snapshots[t] = resources
        return [r.copy() for r in self.snapshots[t]]
