"""Fine-grained scheduling (paper §4.3, ScheduleKernels): encoder chains placed kernel by kernel
into the LLM's bubbles, and the moves a plan's partitions share.

An encoder stage's compute kernels go into its LLM stage's idle compute-stream time (TP and PP
bubbles), its communication kernels into time with no LLM TP collective (mostly under LLM compute,
paper Fig. 7). Placement is first-fit, in tau (time from the LLM's origin t0). A kernel the runtime
can split (``EncoderKernel.splittable``) that would start later than a bubble it could partly fill
is cut to fit: that bubble gets a piece of its tokens and the rest goes on from the bubble's end,
so short TP bubbles are used too. A piece takes what the cost model prices it at by its shape
(``EncoderKernel.prices``: whole blocks of rows, tile and wave quantization, recomputation), so a
cut is made only where a piece at that price still fits; a kernel without prices pays its share of
the work plus its launch again (``EncoderWork.launch_us``). Every piece, the last included, holds
at least ``MIN_PIECE_WORK_US`` of the kernel's work beside its launch: a cut never leaves a sliver
(such as the rest of a kernel that missed a bubble by floating-point rounding) that would pay a
whole launch for next to no tokens.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass, replace
from typing import NamedTuple

from optimus_mllm.costing.cost_model import PiecePrices
from optimus_mllm.scheduler.coarse import PostWindow, PreWindow
from optimus_mllm.scheduler.dependencies import EncLLMDep
from optimus_mllm.scheduler.encoder_costs import EncoderWork, StageChain
from optimus_mllm.scheduler.intervals import FreeIntervals
from optimus_mllm.scheduler.llm_timeline import LLMTimeline
from optimus_mllm.scheduler.lower_bound import Lengths


@dataclass(frozen=True)
class LLMBubbles:
    """What every encoder plan's scheduling shares: dependency points and the LLM's bubbles per
    stage."""

    dep: EncLLMDep
    # per stage: (idle compute, no-TP-collective) time
    gaps: list[tuple[FreeIntervals, FreeIntervals]]
    lengths: list[Lengths]  # per stage: its idle compute time by bubble length, for the lower bound

    @classmethod
    def of(cls, dep: EncLLMDep) -> LLMBubbles:
        gaps = stage_gaps(dep.timeline)
        return cls(dep, gaps, [Lengths.of_gaps(compute) for compute, _ in gaps])

    def feeding(self, feeds: tuple[int, ...]) -> LLMBubbles:
        """The same bubbles with one dependency point per encoder microbatch: that of the LLM
        microbatch it feeds (``feeds``, in LLM order). An LLM microbatch fed by none waits on no
        encoder; one fed by several needs each of them by its points."""
        dep = replace(
            self.dep,
            forward=tuple(self.dep.forward[i] for i in feeds),
            backward=tuple(self.dep.backward[i] for i in feeds),
        )
        return LLMBubbles(dep, self.gaps, self.lengths)


def stage_gaps(timeline: LLMTimeline) -> list[tuple[FreeIntervals, FreeIntervals]]:
    """Per LLM stage: (idle compute-stream time, time without an LLM TP collective, hidden ones
    included) inside its span. Where the encoder runs inline (CPU ranks), a TP collective's wait is
    not idle: the thread that would run the encoder is the one waiting."""
    gaps = []
    for s, stage in enumerate(timeline.stages):
        compute, comm, hidden = timeline.kernel_intervals(s)
        link = sorted(comm + hidden)
        busy = sorted(compute + comm) if timeline.tp_comm_is_busy else compute
        lo, hi = stage.first_compute_us, stage.last_compute_us
        gaps.append(
            (FreeIntervals.complement(busy, lo, hi), FreeIntervals.complement(link, lo, hi))
        )
    return gaps


# every piece of a cut kernel holds at least this much of its work beside the launch: a bubble gets
# a piece only if it has that room, and only if the rest keeps as much
MIN_PIECE_WORK_US = 2.0

# a cut kernel's pieces: (lo, hi) of its tokens, start, end
Cut = list[tuple[float, float, float, float]]


class Placement(NamedTuple):
    """A chain as first-fit placed it (a plan keeps every move it placed)."""

    starts: list[float]  # per kernel (a cut one: its first piece's)
    # (compute, comm) time taken, flat start, end, ...: back-to-back pieces as one span
    spans: tuple[array, array]
    end: float
    cuts: dict[int, Cut]  # kernel index -> its pieces, for the kernels cut to fit


@dataclass
class Resource:
    """The GPUs of one encoder stage: their LLM stage's free compute time and comm-allowed time
    (tau)."""

    llm_stage: int
    compute: FreeIntervals
    comm: FreeIntervals

    def copy(self) -> Resource:
        return Resource(self.llm_stage, self.compute.copy(), self.comm.copy())

    def place_chain(
        self, chain: StageChain, ready: float, limit: float, launch_us: float
    ) -> Placement | None:
        """First-fit the chain's kernels in order into the bubbles, cutting the splittable ones to
        fit; None if they do not fit."""
        starts, t = [], ready
        spans = (array("d"), array("d"))  # compute, comm
        cuts: dict[int, Cut] = {}
        min_room = launch_us + MIN_PIECE_WORK_US
        # Per stream (compute, comm): the free interval of its last kernel. A kernel that fits in it
        # from t starts at t, which is what first-fit returns, without searching.
        free, current = (self.compute, self.comm), [(0.0, -1.0), (0.0, -1.0)]
        for i, (d, is_comm, splittable) in enumerate(chain.steps):
            lo, hi = current[is_comm]
            end = t + d
            if lo <= t < hi and end <= hi and end <= limit:
                start = t
            elif splittable and d > min_room:
                prices = chain.kernels[i].prices
                placed = (
                    self._fit_priced(prices, d, t, limit, launch_us)
                    if prices is not None
                    else self._fit(d, t, limit, launch_us, min_room)
                )
                if placed is None:
                    return None
                pieces, current[0] = placed
                if len(pieces) > 1:
                    cuts[i] = pieces
                starts.append(pieces[0][2])
                for _, _, start, end in pieces:
                    _take_span(spans[0], start, end)
                t = end
                continue
            else:
                fit = free[is_comm].earliest_fit(t, d, limit)
                if fit is None:
                    return None
                start, lo, hi = fit
                current[is_comm] = (lo, hi)
                end = start + d
            starts.append(start)
            _take_span(spans[is_comm], start, end)
            t = end
        return Placement(starts, spans, t, cuts)

    def _fit(
        self, d: float, t: float, limit: float, launch_us: float, min_room: float
    ) -> tuple[Cut, tuple[float, float]] | None:
        """A splittable compute kernel of ``d`` us first-fit from ``t``, cut to fit: while a bubble
        it could
        partly fill comes sooner than one that holds the rest, that bubble gets a piece up to its
        end, or up to where the rest keeps ``MIN_PIECE_WORK_US`` of work. Its pieces as fractions
        of its work (``d`` less one launch; one piece if it runs whole), and the last one's bubble;
        None if it does not fit by ``limit``."""
        work = d - launch_us
        pieces, done, left = [], 0.0, d  # left: the rest as one more kernel, launch included
        while True:
            can_cut = left - launch_us >= 2 * MIN_PIECE_WORK_US  # a piece and a rest of the minimum
            runs_whole, fit = _whole_or_piece(
                self.compute, t, left, min_room if can_cut else None, limit
            )
            if runs_whole:
                if fit is None:
                    return None
                start, lo, hi = fit
                pieces.append((done / work, 1.0, start, start + left))
                return pieces, (lo, hi)
            start, lo, hi = fit
            # up to the bubble's end (the rest does not fit this bubble, or ``whole`` would start
            # here), short of it where the rest would keep less than the minimum
            share = min(min(hi, limit) - start, left - MIN_PIECE_WORK_US) - launch_us
            t = start + launch_us + share
            pieces.append((done / work, (done + share) / work, start, t))
            done, left = done + share, left - share

    def _fit_priced(
        self, prices: PiecePrices, d: float, t: float, limit: float, launch_us: float
    ) -> tuple[Cut, tuple[float, float]] | None:
        """``_fit`` for a kernel whose pieces are priced by their shape: each piece is the most
        whole row blocks its bubble holds at ``prices``, the rest runs on from there. A piece, and
        the rest, hold at least ``MIN_PIECE_WORK_US`` of the kernel's work (``least`` blocks), as
        ``_fit``'s do."""
        n = prices.blocks
        least = max(1, math.ceil(MIN_PIECE_WORK_US * n / (d - launch_us) - 1e-9))
        pieces, done = [], 0
        while True:
            left = d if done == 0 else prices.us[n - done]  # the rest as one more kernel
            can_cut = n - done >= 2 * least
            piece_us = prices.us[least] if can_cut else None
            runs_whole, fit = _whole_or_piece(self.compute, t, left, piece_us, limit)
            if runs_whole:
                if fit is None:
                    return None
                start, lo, hi = fit
                pieces.append((done / n, 1.0, start, start + left))
                return pieces, (lo, hi)
            start, lo, hi = fit
            k = min(prices.most_blocks(min(hi, limit) - start), n - done - least)
            t = start + prices.us[k]
            pieces.append((done / n, (done + k) / n, start, t))
            done += k


def _whole_or_piece(
    free: FreeIntervals, t: float, whole_us: float, piece_us: float | None, limit: float
) -> tuple[bool, tuple[float, float, float] | None]:
    """Where a cuttable kernel goes first-fit from ``t``: (True, its whole run's fit, None where it
    fits nowhere) unless a piece of ``piece_us`` (None: it cannot be cut) starts sooner than the
    whole kernel would: then (False, the piece's fit).

    A piece no longer than the whole kernel fits wherever the whole does, so the whole starts no
    sooner than the piece: it wins only if it fits where the piece starts. That is one check
    instead of a second first-fit search, which for a long kernel scans past every shorter bubble
    (most of the per-iteration scheduler's time). A piece priced above the whole (not one the cost
    model makes today) takes both searches."""
    if piece_us is None:
        return True, free.earliest_fit(t, whole_us, limit)
    piece = free.earliest_fit(t, piece_us, limit)
    if piece is None:
        return True, free.earliest_fit(t, whole_us, limit)
    start, _, hi = piece
    if piece_us <= whole_us:
        end = start + whole_us
        return (True, piece) if end <= hi and end <= limit else (False, piece)
    whole = free.earliest_fit(t, whole_us, limit)
    return (True, whole) if whole is not None and whole[0] <= start else (False, piece)


def _take_span(stream: array, start: float, end: float) -> None:
    if stream and stream[-1] == start:  # back to back on its stream: one span
        stream[-1] = end
    else:
        stream.extend((start, end))


@dataclass(frozen=True)
class Move:
    """One microbatch's chains as placed on every stage of an encoder pipeline: the kernels' starts
    (tau)
    and, per stage, the spans they take from the compute and the comm stream, where its chain ends
    and its cut kernels' pieces. Moves are shared by a plan's partitions, and each partition takes
    the same spans from its own copy of the bubbles."""

    starts: list[list[float]]
    # per stage: (compute, comm) spans as flat start, end, start, end, ...
    busy: list[tuple[array, array]]
    ends: list[float]
    cuts: list[dict[int, Cut]]
    # a backward move's lowest stage: the stages below it run their chains in the post window
    low: int = 0

    @classmethod
    def of(cls, placements: list[Placement], low: int = 0) -> Move:
        """From the placements of stages ``low`` and on (the ones below take nothing)."""
        none = [Placement([], (array("d"), array("d")), float("-inf"), {})] * low
        placements = none + placements
        return cls(
            [p.starts for p in placements],
            [p.spans for p in placements],
            [p.end for p in placements],
            [p.cuts for p in placements],
            low,
        )

    def spans_key(self) -> tuple[bytes, ...]:
        """The spans the move takes, as a key: moves equal in it leave the same bubbles."""
        return tuple(spans.tobytes() for busy in self.busy for spans in busy)

    def last_end(self) -> float:
        """When its last span ends (tau): a first-fit from then on does not see the move."""
        return max((spans[-1] for busy in self.busy for spans in busy if spans), default=-math.inf)

    def take(self, resources: list[Resource]) -> None:
        """Occupy the move's spans in a pipeline's bubbles (a stage without kernels takes
        nothing)."""
        for r, (compute, comm) in zip(resources, self.busy):
            for free, spans in ((r.compute, compute), (r.comm, comm)):
                pairs = iter(spans)
                for start, end in zip(pairs, pairs):
                    free.occupy(start, end)


# a backward move's placement, by what it depends on: the forward moves before it (t), the
# backward moves before it as (gradient arrival, lowest stage), and its own arrival and lowest stage
BackwardKey = tuple[int, tuple[tuple[float, int], ...], float, int]


# a backward move's placement, by what its first-fit sees (``PipelineMoves.backward_seen``): the
# forward moves (by index) and the backward moves (by the spans they take, ``Move.spans_key``)
# before it that end after its gradient arrives, its own arrival and lowest stage
SeenKey = tuple[tuple[int, ...], tuple[tuple[bytes, ...], ...], float, int]


class PipelineMoves:
    """One encoder pipeline's microbatches moved into the LLM's bubbles, shared by all partitions of
    a plan.

    OptimizeSchedule's forward pass moves pipeline j's microbatches one at a time, each from the
    pipeline's first LLM computation up to the same limit, into bubbles that only j's earlier
    forward moves have taken, and ends at the first move it rejects. So j's t-th move lands at the
    same times whatever the partition, and is placed here once. The bubbles left after t moves are
    rebuilt from a copy taken every ``SNAPSHOT_EVERY`` moves plus the moves since.

    A backward move of LLM microbatch i's encoder work lands where the bubbles left by j's t forward
    moves and its earlier backward moves put it, so its placement is kept by (t, the gradients'
    arrivals (tau) and lowest stages of the backward moves before, its own arrival and lowest
    stage) too: partitions that move the same microbatches in the same order reuse it.

    A first-fit from a time never looks at the bubbles before it, so a backward move's placement
    depends only on the moves before it that end after its gradient arrives (the forward ones
    mostly end before): it is kept by those too (``backward_seen``), for partitions and iterations
    whose other moves differ.

    The pipeline's coarse windows do not depend on the partition either: every layout a partition
    needs is a prefix of one pre window and, mostly, of one post window (see ``PostWindow``).

    None of this depends on which LLM microbatch each encoder microbatch feeds, beyond the last
    forward dependency point (``limit``), which bounds every forward move: a backward move is kept
    by when its gradient arrives, not by its microbatch's index. So an iteration's schedule
    (``bubble_scheduler``'s ``workload``) shares these moves with every other iteration whose
    encoder microbatches run the same chains to the same limit (``ChainMoves``).
    """

    SNAPSHOT_EVERY = 8

    def __init__(
        self,
        work: EncoderWork,
        dep: EncLLMDep,
        gaps: list[tuple[FreeIntervals, FreeIntervals]],
        j: int,
    ):
        self.work, self.j = work, j
        stages = [work.llm_stage(j, e) for e in range(len(work.fwd))]
        self.first = [dep.timeline.stages[s].first_compute_us for s in stages]
        # the LLM's last forward dependency point bounds every encoder forward's end
        self.limit = max(dep.forward) - work.to_llm_us[j]
        self.builder = [Resource(s, gaps[s][0].copy(), gaps[s][1].copy()) for s in stages]
        self.moves: list[Move] = []  # t -> the t-th forward move
        self.forward_ends: list[
            float
        ] = []  # t -> its EF (tau): when its output reaches the first LLM stage
        self.forward_last_end: list[float] = []  # t -> the t-th forward move's ``last_end``
        self.exhausted = False  # move len(moves) does not fit
        self.snapshots = {0: [r.copy() for r in self.builder]}
        # (t, (arrival, low) of each backward move before, arrival, low) -> its placement
        self.backward: dict[BackwardKey, Move | None] = {}
        self.backward_seen: dict[SeenKey, Move | None] = {}
        self._pre = PreWindow.of(work, j, len(dep.forward), self.first)  # no partition gives j more
        self.post = PostWindow([dep.timeline.stages[s].last_compute_us for s in stages], work)

    @classmethod
    def of_pipelines(cls, work: EncoderWork, bubbles: LLMBubbles) -> list[PipelineMoves]:
        """One per encoder pipeline, to share among a plan's partitions."""
        return [cls(work, bubbles.dep, bubbles.gaps, j) for j in range(work.num_pipelines)]

    def pre(self, n: int) -> PreWindow:
        """The pre window of at least the pipeline's first ``n`` microbatches (a longer one's
        layouts are prefixes: the first n are the same)."""
        if len(self._pre.starts) < n:
            self._pre = PreWindow.of(self.work, self.j, n, self.first)
        return self._pre

    def move(self, t: int) -> Move | None:
        """The pipeline's t-th forward move (from 0); None if it does not fit."""
        w = self.work
        while len(self.moves) <= t and not self.exhausted:
            placements, ready = [], self.first[0]
            for e, r in enumerate(self.builder):
                placement = r.place_chain(
                    w.fwd[e], max(ready, self.first[e]), self.limit, w.launch_us
                )
                if placement is None:
                    self.exhausted = True
                    return None
                placements.append(placement)
                ready = placement.end + w.p2p_us
            move = Move.of(placements)
            move.take(self.builder)
            self.moves.append(move)
            self.forward_ends.append(move.ends[-1] + w.to_llm_us[self.j])
            self.forward_last_end.append(move.last_end())
            if len(self.moves) % self.SNAPSHOT_EVERY == 0:
                self.snapshots[len(self.moves)] = [r.copy() for r in self.builder]
        return self.moves[t] if t < len(self.moves) else None

    def resources_after(self, t: int) -> list[Resource]:
        """Per stage: the bubbles left after the first t moves, as fresh copies. Partitions often
        end their forward pass after the same number of moves, so that state is kept too."""
        if t not in self.snapshots:
            base = t - t % self.SNAPSHOT_EVERY
            resources = [r.copy() for r in self.snapshots[base]]
            for move in self.moves[base:t]:
                move.take(resources)
            self.snapshots[t] = resources
        return [r.copy() for r in self.snapshots[t]]
