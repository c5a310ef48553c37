"""The bubble scheduler: paper §4.2-4.4, Algorithms 1 and 2.

Time base: microseconds from the start of the iteration. The LLM's computation starts at the LLM
origin ``t0`` (the LLM timeline is shifted by it); kernels inside the LLM's span are tracked
relative to ``t0`` (tau = t - t0), so moving ``t0`` never disturbs them.

Encoder work for microbatch k of encoder pipeline j runs on each of its stages e as a chain of
kernels, in one of three windows of the stage's GPUs:
- ``pre``: coarse, before the LLM's first computation on that GPU (DP all-gather and PP warm-up
  bubbles; ``t0`` moves later if it does not fit);
- ``llm``: fine, kernel by kernel in the bubbles between the LLM's first and last computation:
  compute kernels into idle compute-stream time (TP and PP bubbles), communication kernels into
  time with no LLM TP collective (so mostly under LLM compute, paper Fig. 7);
- ``post``: coarse, after the LLM's last computation (PP cool-down and DP reduce-scatter bubbles).
``InitSchedule`` puts every forward in ``pre`` and every backward in ``post``; ``OptimizeSchedule``
moves one microbatch at a time of the critical encoder pipeline into ``llm`` (a backward, if it does
not fit whole, on its upper stages only: the rest stays in ``post``). The windows are laid
out in ``coarse``, the kernels placed into bubbles in ``fine``, and ``lower_bound`` lets the search
skip partitions and plans.

Variable work (``bubble_scheduler``'s ``workload``): the LLM runs the microbatches without an image
first, in data order, and waits on no encoder for them: their dependency points are dropped
(``LLMBubbles.feeding``), so the encoder's microbatches meet the later, looser ones. The images of
the others run as encoder microbatches of at most ``images_per_chain`` images each
(``split_images``): a microbatch with more runs as several, each meeting its LLM microbatch's
dependency points. Every encoder microbatch is one chain, priced for the largest of them
(``EncoderSplit.chain``): a lighter one's kernels take no longer than the slots placed for it, so
the schedule holds for every one of them.
"""

from __future__ import annotations

import gc
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from itertools import repeat
from operator import add, itemgetter
from typing import Literal

from optimus_mllm.config import OptimusConfig
from optimus_mllm.costing.cost_model import CostModel, Phase
from optimus_mllm.costing.workload import (
    EncoderWorkload,
    IterationWorkload,
    max_images_per_microbatch,
    split_images,
)
from optimus_mllm.planner.partitions import microbatch_partitions
from optimus_mllm.planner.planner import EncoderPlanCandidate, PlannerResult
from optimus_mllm.planner.plans import ParallelPlan, symmetry_groups
from optimus_mllm.scheduler.baselines import BaselineResult, runnable_baselines
from optimus_mllm.scheduler.coarse import chain_block, coarse_backward
from optimus_mllm.scheduler.dependencies import (
    EPS_US,
    EncLLMDep,
    check_enc_llm_dep_backward,
    check_enc_llm_dep_forward,
    get_enc_llm_dep,
    global_order,
)
from optimus_mllm.scheduler.encoder_costs import (
    EncoderKernel,
    EncoderWork,
    StageChain,
    build_encoder_work,
)
from optimus_mllm.scheduler.fine import (
    BackwardKey,
    Cut,
    LLMBubbles,
    Move,
    PipelineMoves,
    Placement,
    Resource,
    SeenKey,
)
from optimus_mllm.scheduler.llm_timeline import LLMTimeline
from optimus_mllm.scheduler.lower_bound import PartitionBound, all_gather_t0, reduce_scatters_end

Window = Literal["pre", "llm", "post"]
FWD: Phase = "fwd"
BWD: Phase = "bwd"


@dataclass(frozen=True)
class ChainPlacement:
    """One microbatch's kernel chain on one encoder stage, as placed."""

    pipeline: int
    stage: int
    local_microbatch: int
    phase: Phase
    window: Window
    # iteration time of each kernel of EncoderWork.fwd/bwd[stage] (cut: its first piece)
    starts_us: tuple[float, ...]
    cuts: tuple[
        tuple[int, Cut], ...
    ] = ()  # (kernel index, its pieces in iteration time) of the kernels cut to fit


@dataclass(frozen=True)
class KernelRun:
    """A kernel of a placed chain as it runs: whole, or one piece of its tokens."""

    index: int  # in its chain
    kernel: EncoderKernel
    piece: tuple[float, float]  # the share of its tokens: (0, 1) whole
    start_us: float
    end_us: float


@dataclass
class Schedule:
    """A complete schedule of one LLM pipeline and its encoder pipelines."""

    llm_plan: ParallelPlan
    encoder_plan: ParallelPlan
    partition: tuple[int, ...]
    dep: EncLLMDep
    work: EncoderWork
    llm_origin_us: float  # t0
    # LLM microbatch i <- (encoder pipeline, its local microbatch)
    assignment: tuple[tuple[int, int], ...]
    encoder_forward_end_us: tuple[float, ...]  # EF_i: A_i has reached the first LLM stage
    encoder_backward_start_us: tuple[float, ...]  # EB_i: the encoder starts microbatch i's backward
    chains: tuple[ChainPlacement, ...]
    iteration_us: float
    coarse_iteration_us: float  # InitSchedule's latency for this partition
    # per encoder microbatch (the index of ``assignment``, ``dep`` and the EF/EB times above): the
    # LLM microbatch it feeds; empty: encoder microbatch i feeds LLM microbatch i (today's)
    feeds: tuple[int, ...] = ()

    @property
    def timeline(self) -> LLMTimeline:
        return self.dep.timeline

    @property
    def forward_dependency_us(self) -> tuple[float, ...]:
        """F_i in iteration time."""
        return tuple(f + self.llm_origin_us for f in self.dep.forward)

    @property
    def backward_dependency_us(self) -> tuple[float, ...]:
        """B_i in iteration time."""
        return tuple(b + self.llm_origin_us for b in self.dep.backward)

    def chain_kernels(self, chain: ChainPlacement) -> StageChain:
        return (self.work.fwd if chain.phase == "fwd" else self.work.bwd)[chain.stage]

    def runs(self, chain: ChainPlacement) -> list[KernelRun]:
        """The chain's kernels in order, a cut kernel as its pieces."""
        cuts = dict(chain.cuts)
        runs = []
        for i, (k, start) in enumerate(zip(self.chain_kernels(chain).kernels, chain.starts_us)):
            pieces = cuts.get(i, ((0.0, 1.0, start, start + k.duration_us),))
            runs += [KernelRun(i, k, (lo, hi), a, b) for lo, hi, a, b in pieces]
        return runs


# --------------------------------------------------------------------------------------------
# One partition's scheduling state


# A coarse backward in the post window: (its gradient ready at its top stage, tau; its local
# microbatch k; that top stage: the encoder's last, or the stage below a move stopped above one)
_PostBackward = tuple[float, int, int]


@dataclass
class _Evaluation:
    """A partition's state laid out. A forward move's evaluation may leave out the global ordering
    and the coarse backwards' layout (``assignment`` to ``backward_end`` None) when they cannot
    change the latency: see ``_queued_tail``."""

    llm_origin_us: float  # t0
    iteration_us: float  # the latency
    # per pipeline j: the t0 its pre-window work needs
    pre_required_origin_us: dict[int, float]
    # (j, e) -> (end of its gradient reduce-scatters, tau; whether the encoder delays it)
    end_by_resource: dict[tuple[int, int], tuple[float, bool]]
    # LLM microbatch i <- (encoder pipeline j, its local microbatch k)
    assignment: list[tuple[int, int]] | None = None
    encoder_forward_end_us: list[float] | None = None  # EF_i, iteration time
    encoder_backward_start_us: list[float] | None = None  # EB_i, iteration time
    # j -> its coarse backwards, in the order the post window runs them
    post: dict[int, tuple[_PostBackward, ...]] | None = None
    # (j, k) -> its backward's start on the last stage (tau)
    backward_start: dict[tuple[int, int], float] | None = None
    # (j, e) -> end of the stage's last backward (tau)
    backward_end: dict[tuple[int, int], float] | None = None


def _post_order(coarse: _PostBackward) -> tuple[int, float, int]:
    """The post window's order: by top stage, the lowest first, then by gradient arrival."""
    ready_us, microbatch, top = coarse
    return top, ready_us, microbatch


class _PartitionScheduler:
    """Scheduling state for one microbatch partition (one element of InitSchedule's output)."""

    def __init__(
        self,
        work: EncoderWork,
        dep: EncLLMDep,
        partition: tuple[int, ...],
        moves: list[PipelineMoves],
    ):
        self.work, self.dep, self.partition = work, dep, partition
        self.timeline = dep.timeline
        self.pp_enc = len(work.fwd)
        self.moves = moves
        self.resources: dict[tuple[int, int], Resource] = {}
        # per pipeline: (LLM microbatch, lowest stage placed into bubbles) of its backward moves, in
        # order
        # per pipeline: (gradient arrival, lowest stage placed into bubbles) of its backward moves,
        # in order (``PipelineMoves.backward``'s key)
        self.moved_backward: list[list[tuple[float, int]]] = [[] for _ in partition]
        # backward moves not yet in resources
        self.uncommitted: list[list[Move]] = [[] for _ in partition]
        # per pipeline: the spans of its backward moves (``Move.spans_key``) and when each ends
        # (tau), in order
        self.committed: list[list[tuple[tuple[bytes, ...], float]]] = [[] for _ in partition]
        self.n_coarse_fwd = list(partition)  # microbatches 0..n-1 of pipeline j run in ``pre``
        self.fine_fwd: dict[
            tuple[int, int], Move
        ] = {}  # (j, k) -> its chains placed into bubbles (tau)
        self.fine_bwd: dict[
            tuple[int, int], Move
        ] = {}  # from its stage Move.low up; the rest in ``post``
        self.has_backward = any(chain.kernels for chain in work.bwd)
        self.pre = [m.pre(len(dep.forward)) for m in moves]
        self.t0_low = all_gather_t0(work, self.timeline)
        self.queued_tail = self._queued_tail()
        self.evaluation = self.evaluate()

    # -- resources ---------------------------------------------------------------------------

    def resource(self, j: int, e: int) -> Resource:
        """Stage e of pipeline j's bubbles, taken by j's forward moves so far (the forward pass runs
        before any backward placement) and by this partition's backward moves."""
        if (j, e) not in self.resources:
            resources = self.moves[j].resources_after(self.moved_forward(j))
            self.resources.update(((j, stage), r) for stage, r in enumerate(resources))
        if self.uncommitted[j]:
            resources = [self.resources[(j, stage)] for stage in range(self.pp_enc)]
            for move in self.uncommitted[j]:
                move.take(resources)
            self.uncommitted[j] = []
        return self.resources[(j, e)]

    def moved_forward(self, j: int) -> int:
        return self.partition[j] - self.n_coarse_fwd[j]

    def place_backward(self, j: int, i: int, low: int = 0) -> Move | None:
        """LLM microbatch i's encoder backward on pipeline j, from the last stage down to stage
        ``low`` as
        its gradient arrives; None if it does not fit before the LLM's end."""
        key = self._backward_key(j, i, low)
        moves = self.moves[j]
        if key not in moves.backward:
            seen = self._seen_key(j, i, low)
            if seen in moves.backward_seen:
                moves.backward[key] = moves.backward_seen[seen]
            else:
                self._first_fit_backward(j, i, low)
        return moves.backward[key]

    def _backward_key(self, j: int, i: int, low: int) -> BackwardKey:
        return self.moved_forward(j), tuple(self.moved_backward[j]), self.dep.backward[i], low

    def _seen_key(self, j: int, i: int, low: int) -> SeenKey:
        """What the first-fit of LLM microbatch i's backward on pipeline j sees of the moves
        before it: those that end after its gradient arrives (``PipelineMoves``)."""
        arrival = self.dep.backward[i]
        ready = arrival + self.work.to_llm_us[j]
        ends = self.moves[j].forward_last_end
        forward = tuple(t for t in range(self.moved_forward(j)) if ends[t] > ready)
        backward = tuple(spans for spans, end in self.committed[j] if end > ready)
        return forward, backward, arrival, low

    def _first_fit_backward(self, j: int, i: int, low: int) -> None:
        """Place the backward from the last stage down to ``low`` into ``PipelineMoves.backward``
        (and ``backward_seen``), and with it the move stopped above each stage on the way (its
        first placements, which ``schedule_kernels`` tries next where this one fails or lengthens
        the iteration): one walk down the stages instead of one per stage it stops above."""
        w, moves = self.work, self.moves[j]
        moved, prefix, arrival, _ = self._backward_key(j, i, low)
        forward, backward, _, _ = self._seen_key(j, i, low)

        def keep(stop: int, move: Move | None) -> None:
            moves.backward[(moved, prefix, arrival, stop)] = move
            moves.backward_seen[(forward, backward, arrival, stop)] = move

        ready = arrival + w.to_llm_us[j]
        placements: list[Placement] = []  # from the last stage to the first
        for e in reversed(range(low, self.pp_enc)):
            placement = self.resource(j, e).place_chain(
                w.bwd[e], ready, self.last(j, e), w.launch_us
            )
            if placement is None:  # so does every move down to a stage below
                for stop in range(low, e + 1):
                    keep(stop, None)
                return
            # a frozen stage passes the gradient on at once (its chain ends where it starts)
            placements.append(placement if placement.starts else placement._replace(starts=[ready]))
            ready = placement.end + w.p2p_us
            keep(e, Move.of(placements[::-1], e))

    def commit_backward(self, j: int, i: int, low: int) -> None:
        """Take the bubbles of the backward move just placed, once a later placement must search
        them."""
        move = self.moves[j].backward[self._backward_key(j, i, low)]
        self.uncommitted[j].append(move)
        self.committed[j].append((move.spans_key(), move.last_end()))
        self.moved_backward[j].append((self.dep.backward[i], low))

    def last(self, j: int, e: int) -> float:
        return self.timeline.stages[self.work.llm_stage(j, e)].last_compute_us

    # -- evaluation: windows, t0, global ordering, latency ------------------------------------

    def evaluate(
        self, before: _Evaluation | None = None, moved_pipeline: int = -1
    ) -> _Evaluation | None:
        """Lay out the coarse windows around the fine chains; None if dependencies cannot hold.

        ``before``: the evaluation before a backward move of ``moved_pipeline``, which changes that
        pipeline's backwards only; t0, the assignment and the other pipelines' backwards are taken
        from it.
        """
        work, top_stage = self.work, self.pp_enc - 1
        if before is None:
            forward = self._forward_side()
            if forward is None:
                return None
            origin_us, forward_ends, required_origin_us = forward
            assignment = global_order(forward_ends)
            forward_end_us = [end_us for end_us, _, _ in forward_ends]
            changed: Sequence[int] = range(work.num_pipelines)
            # per pipeline: its coarse backwards in order of LLM microbatch, to be laid out
            arrivals: dict[int, list[_PostBackward]] = {pipeline: [] for pipeline in changed}
            for gradient_us, (pipeline, microbatch) in zip(self.dep.backward, assignment):
                if (pipeline, microbatch) not in self.fine_bwd:
                    ready_us = gradient_us + work.to_llm_us[pipeline]
                    arrivals[pipeline].append((ready_us, microbatch, top_stage))
            post: dict[int, tuple[_PostBackward, ...]] = {}
            backward_start: dict[tuple[int, int], float] = {}
            backward_end: dict[tuple[int, int], float] = {}
        else:
            origin_us, required_origin_us = before.llm_origin_us, before.pre_required_origin_us
            assignment, forward_end_us = before.assignment, before.encoder_forward_end_us
            changed = (moved_pipeline,)
            arrivals = {
                moved_pipeline: [
                    (ready_us, microbatch, top)
                    for ready_us, microbatch, top in before.post.get(moved_pipeline, ())
                    if (moved_pipeline, microbatch) not in self.fine_bwd
                ]
            }
            post = {
                pipeline: ps for pipeline, ps in before.post.items() if pipeline != moved_pipeline
            }
            backward_start = dict(before.backward_start)
            backward_end = {
                key: end_us
                for key, end_us in before.backward_end.items()
                if key[0] != moved_pipeline
            }
        self._place_fine_backwards(changed, arrivals, backward_start, backward_end)
        # B_i, iteration time
        backward_dependency_us = [gradient_us + origin_us for gradient_us in self.dep.backward]
        if self.has_backward:
            self._lay_out_post(changed, arrivals, post, backward_start, backward_end)
            backward_start_us = [backward_start[key] + origin_us for key in assignment]
            # checkEncLLMDep: its forward half is how _forward_side chose t0
            if not check_enc_llm_dep_backward(backward_start_us, backward_dependency_us):
                return None
        else:
            backward_start_us = backward_dependency_us  # nothing to order against
        end_by_resource, tail_us = self._tail(backward_end)
        return _Evaluation(
            llm_origin_us=origin_us,
            iteration_us=origin_us + tail_us,
            pre_required_origin_us=required_origin_us,
            end_by_resource=end_by_resource,
            assignment=assignment,
            encoder_forward_end_us=forward_end_us,
            encoder_backward_start_us=backward_start_us,
            post=post,
            backward_start=backward_start,
            backward_end=backward_end,
        )

    def _place_fine_backwards(
        self,
        changed: Sequence[int],
        arrivals: dict[int, list[_PostBackward]],
        backward_start: dict[tuple[int, int], float],
        backward_end: dict[tuple[int, int], float],
    ) -> None:
        """The ``changed`` pipelines' backward moves: their starts and stage ends (tau), and, for a
        move stopped above a stage, the coarse backward of the stages below it in ``arrivals``."""
        for (pipeline, microbatch), move in self.fine_bwd.items():
            if pipeline not in changed:
                continue
            backward_start[(pipeline, microbatch)] = move.starts[-1][0]
            for stage in range(move.low, self.pp_enc):
                key = (pipeline, stage)
                backward_end[key] = max(backward_end.get(key, float("-inf")), move.ends[stage])
            # its stages below run in the post window, from the gradient the move sent down
            if move.low:
                ready_us = move.ends[move.low] + self.work.p2p_us
                arrivals[pipeline].append((ready_us, microbatch, move.low - 1))

    def _lay_out_post(
        self,
        changed: Sequence[int],
        arrivals: dict[int, list[_PostBackward]],
        post: dict[int, tuple[_PostBackward, ...]],
        backward_start: dict[tuple[int, int], float],
        backward_end: dict[tuple[int, int], float],
    ) -> None:
        """The ``changed`` pipelines' coarse backwards after the LLM's last computation, in order of
        gradient arrival (tau): those whose upper stages ran in bubbles first, the furthest down
        first (they are that much further)."""
        top_stage = self.pp_enc - 1
        for pipeline in changed:
            coarse = tuple(sorted(arrivals[pipeline], key=_post_order))
            if not coarse:
                continue
            post[pipeline] = coarse
            ready_us, microbatches, top_stages = zip(*coarse)
            window = self.moves[pipeline].post
            if all(top == top_stage for top in top_stages):
                starts_us, stage_ends_us = window.layout(ready_us)
                backward_start.update(zip(zip(repeat(pipeline), microbatches), starts_us))
            else:
                rows, stage_ends_us = coarse_backward(
                    ready_us, window.origin, self.work, top_stages
                )
                backward_start.update(
                    ((pipeline, microbatch), row[-1])
                    for microbatch, row, top in zip(microbatches, rows, top_stages)
                    if top == top_stage
                )
            for stage, end_us in enumerate(stage_ends_us):
                key = (pipeline, stage)
                backward_end[key] = max(backward_end.get(key, float("-inf")), end_us)

    def evaluate_forward_move(self) -> _Evaluation | None:
        """``evaluate`` after a forward move, without the global ordering and the coarse backwards'
        layout
        where they cannot change the latency (see ``_queued_tail``); ``optimize_schedule`` lays them
        out when the forward pass ends. Each of those backwards starts after its gradient arrives,
        so checkEncLLMDep's backward half holds."""
        if self.queued_tail is None or self.fine_bwd:
            return self.evaluate()
        forward = self._forward_side(ordered=False)
        if forward is None:
            return None
        origin_us, _, required_origin_us = forward
        end_by_resource, tail_us = self.queued_tail
        return _Evaluation(
            llm_origin_us=origin_us,
            iteration_us=origin_us + tail_us,
            pre_required_origin_us=required_origin_us,
            end_by_resource=end_by_resource,
        )

    def _queued_tail(self) -> tuple[dict[tuple[int, int], tuple[float, bool]], float] | None:
        """The tail (end by resource, and the latest) while no backward has moved, if every coarse
        backward then waits for its stage however the LLM's microbatches are assigned: the post
        windows are then prefixes of the queued layout, so they and the tail do not depend on the
        assignment. None where a gradient could come after the stage is free for it."""
        latest = sorted(self.dep.backward)
        backward_end: dict[tuple[int, int], float] = {}
        for j, n in enumerate(self.partition):
            if not (n and self.has_backward):
                continue
            # pipeline j's k-th earliest gradient comes no later than the (N - n + k)-th of all N
            ready = tuple(b + self.work.to_llm_us[j] for b in latest[len(latest) - n :])
            window = self.moves[j].post
            if not window.queued(ready):
                return None
            backward_end.update(((j, e), end) for e, end in enumerate(window.ends[n]))
        return self._tail(backward_end)

    def _tail(
        self, backward_end: dict[tuple[int, int], float]
    ) -> tuple[dict[tuple[int, int], tuple[float, bool]], float]:
        """Per encoder stage: when its GPUs' gradient reduce-scatters end (tau) and whether the
        encoder's
        delays them; and the latest of these."""
        w, tl = self.work, self.timeline
        end_by_resource = {}
        tail = 0.0
        for j in range(w.num_pipelines):
            for e in range(self.pp_enc):
                s = w.llm_stage(j, e)
                llm_only = (
                    tl.stages[s].last_compute_us
                    + tl.dp_reduce_scatter_us[s]
                    + tl.stage_optimizer_us(s)
                )
                end = reduce_scatters_end(
                    tl, s, w.dp_reduce_scatter_us, backward_end.get((j, e)), w.optimizer_step_us
                )
                end_by_resource[(j, e)] = (end, end > llm_only + EPS_US)
                tail = max(tail, end)
        return end_by_resource, tail

    def _forward_side(
        self, ordered: bool = True
    ) -> tuple[float, list[tuple[float, int, int]] | None, dict[int, float]] | None:
        """t0, every encoder forward's (EF, j, k) earliest first, and the t0 each pipeline's pre
        window needs; None if no t0 lets every EF_i come by F_i. Not ``ordered``: the EFs are only
        checked against the dependency points, unless t0 has to be searched for."""
        required: dict[int, float] = {}
        for j, window in enumerate(self.pre):
            n = self.n_coarse_fwd[j]
            if n:
                required[j] = window.required[n - 1]
        t0 = max([self.t0_low] + list(required.values()))
        if not ordered:
            times: list[float] = []
            for j, (window, m) in enumerate(zip(self.pre, self.moves)):
                times.extend(window.ef_times[: self.n_coarse_fwd[j]])
                times.extend(map(add, m.forward_ends[: self.moved_forward(j)], repeat(t0)))
            times.sort()
            if check_enc_llm_dep_forward(times, map(add, self.dep.forward, repeat(t0))):
                return t0, None, required
        pre_ef: list[tuple[float, int, int]] = []
        for j, window in enumerate(self.pre):
            pre_ef.extend(window.ef[: self.n_coarse_fwd[j]])
        # pipeline j's t-th forward move carries its microbatch partition[j] - 1 - t: (EFs in tau,
        # j, ks)
        fine: list[_FineForwards] = []
        for j, (m, p) in enumerate(zip(self.moves, self.partition)):
            t = self.moved_forward(j)
            fine.append((m.forward_ends[:t], j, range(p - 1, p - 1 - t, -1)))
        merged = _merged_forward_ends(pre_ef, fine, t0)
        if not self._forward_feasible(merged, t0):
            t0 = self._earliest_feasible_t0(t0, pre_ef, fine)
            if t0 is None:
                return None
            merged = _merged_forward_ends(pre_ef, fine, t0)
        return t0, merged, required

    def _forward_feasible(self, merged: list[tuple[float, int, int]], t0: float) -> bool:
        """The forward half of checkEncLLMDep: the i-th earliest EF_i <= F_i + t0."""
        return check_enc_llm_dep_forward(
            map(itemgetter(0), merged), map(add, self.dep.forward, repeat(t0))
        )

    def _earliest_feasible_t0(
        self, infeasible: float, pre_ef: list[tuple[float, int, int]], fine: list[_FineForwards]
    ) -> float | None:
        """Smallest feasible t0 above ``infeasible`` (feasibility is monotone in t0), to 0.01 us."""

        def feasible(t0: float) -> bool:
            return self._forward_feasible(_merged_forward_ends(pre_ef, fine, t0), t0)

        hi = infeasible + max([ef for ef, _, _ in pre_ef] + [0.0]) + 1.0
        if not feasible(hi):
            return None
        lo = infeasible
        while hi - lo > 0.01:
            mid = (lo + hi) / 2
            if not lo < mid < hi:  # times so long that 0.01 us is below their float spacing
                break
            lo, hi = (lo, mid) if feasible(mid) else (mid, hi)
        return hi


# one pipeline's fine forwards: EFs (tau), j, their ks
_FineForwards = tuple[list[float], int, range]


def _merged_forward_ends(
    pre_ef: list[tuple[float, int, int]], fine: list[_FineForwards], t0: float
) -> list[tuple[float, int, int]]:
    """Every encoder forward's (EF, j, k) in iteration time, earliest first: pre EFs are in
    iteration time already, fine ones in tau."""
    merged = list(pre_ef)
    for efs, j, ks in fine:
        merged.extend(zip(map(add, efs, repeat(t0)), repeat(j), ks))
    merged.sort()
    return merged


# --------------------------------------------------------------------------------------------
# Algorithm 2


def init_schedule(
    work: EncoderWork,
    bubbles: LLMBubbles,
    partition: tuple[int, ...],
    moves: list[PipelineMoves] | None = None,
) -> _PartitionScheduler | None:
    """InitSchedule for one microbatch partition: every encoder forward before the LLM's
    computation, every backward after it (coarse-grained). None if the dependencies cannot be met.

    The paper builds these for all partitions up front; ``bubble_scheduler`` builds them one at a
    time so that its lower bound can skip partitions that cannot win.
    """
    state = _PartitionScheduler(
        work, bubbles.dep, partition, moves or PipelineMoves.of_pipelines(work, bubbles)
    )
    return state if state.evaluation is not None else None


def find_critical(state: _PartitionScheduler, phase: Phase) -> int | None:
    """findCritical: the encoder pipeline on the critical path, or None if the LLM itself is."""
    ev = state.evaluation
    if phase == FWD:
        if not ev.pre_required_origin_us:
            return None
        j, need = max(
            ev.pre_required_origin_us.items(),
            key=lambda item: (item[1], state.n_coarse_fwd[item[0]]),
        )
        return j if need >= ev.llm_origin_us - EPS_US else None
    (j, _), (end, encoder_bound) = max(ev.end_by_resource.items(), key=lambda item: item[1][0])
    return j if encoder_bound else None


def schedule_kernels(state: _PartitionScheduler, j: int, phase: Phase) -> bool:
    """ScheduleKernels: move one microbatch of pipeline j into the LLM's bubbles, kernel by kernel.

    Forward: its last coarse microbatch, stage by stage from upstream to downstream; backward: the
    coarse microbatch whose gradient arrives first, from downstream to upstream. Kept only if the
    dependencies still hold (checkEncLLMDep) and the iteration gets no longer.

    A backward move that does not fit (or lengthens the iteration) is tried again stopped above a
    stage ``low``, from the lowest: stages ``low`` and up run in bubbles and send the gradient down
    to the rest in the post window, which then need not wait for the encoder pipeline to drain after
    the LLM ends.
    """
    before = state.evaluation
    if phase == FWD:
        if state.n_coarse_fwd[j] == 0:
            return False
        k = state.n_coarse_fwd[j] - 1
        move = state.moves[j].move(state.moved_forward(j))
        if move is None:
            return False
        state.n_coarse_fwd[j] -= 1
        state.fine_fwd[(j, k)] = move
        after = state.evaluate_forward_move()
        if after is None or after.iteration_us > before.iteration_us + EPS_US:
            state.n_coarse_fwd[j] += 1
            del state.fine_fwd[(j, k)]
            return False
    else:
        last = state.pp_enc - 1
        # (gradient ready, k, top): the earliest one not moved yet at all
        k = next((k for _, k, top in before.post.get(j, ()) if top == last), None)
        if k is None:
            return False
        i = before.assignment.index((j, k))
        for low in range(last + 1):
            move = state.place_backward(j, i, low)
            if move is None:
                continue
            state.fine_bwd[(j, k)] = move
            after = state.evaluate(before, j)
            if after is not None and after.iteration_us <= before.iteration_us + EPS_US:
                state.commit_backward(j, i, low)
                break
            del state.fine_bwd[(j, k)]
        else:
            return False
    state.evaluation = after
    return True


def optimize_schedule(state: _PartitionScheduler, phase: Phase) -> _PartitionScheduler:
    """OptimizeSchedule: keep moving the critical pipeline's work into bubbles while it helps."""
    if phase == BWD and not state.has_backward:
        return state
    while True:
        j = find_critical(state, phase)
        if j is None or not schedule_kernels(state, j, phase):
            if state.evaluation.post is None:  # left out by the forward moves
                state.evaluation = state.evaluate()
            return state


@dataclass
class SchedulerStats:
    partitions_total: int = 0
    partitions_searched: int = 0
    partitions_pruned: int = 0  # skipped by the lower bound


def bubble_scheduler(
    config: OptimusConfig,
    llm_plan: ParallelPlan,
    candidate: EncoderPlanCandidate,
    bubbles: LLMBubbles,
    cost: CostModel,
    bound_us: float = float("inf"),
    fine: bool = True,
    workload: IterationWorkload | None = None,
    images_per_chain: int | None = None,
    chains: ChainMoves | None = None,
) -> tuple[Schedule | None, SchedulerStats]:
    """BubbleScheduler (Algorithm 2): coarse schedules for every partition, refined, the fastest
    kept.

    Partitions whose lower bound (``PartitionBound``) cannot beat ``bound_us`` (the best schedule of
    other plans) or this plan's best so far are skipped; this never drops a schedule that could have
    won. Returns this plan's best schedule found, or None if no partition was feasible or searched
    (or, with a ``workload``, if it has no image, or fewer encoder microbatches than the plan has
    encoder pipelines per LLM pipeline).

    ``workload``: one per microbatch of the LLM pipeline, in the order the LLM is to run them
    (imageless ones first, see the module's note); None: every microbatch carries today's
    constant work. ``images_per_chain``: the most images of one encoder microbatch (default: the
    workload's heaviest microbatch's, one encoder microbatch per LLM microbatch). ``chains``: the
    encoder chains and moves kept from earlier workloads of this plan (``ChainMoves``); the
    schedule is the same with or without.
    """
    if workload is None:
        plan_input = _PlanInput.of(config, llm_plan, candidate, bubbles, cost)
        best, stats = _search_partitions(plan_input, llm_plan, bubbles, bound_us, fine)
        return (best.schedule() if best else None), stats
    found, stats = search_workload(
        config,
        llm_plan,
        candidate,
        bubbles,
        cost,
        workload,
        bound_us,
        fine,
        images_per_chain,
        chains,
    )
    return (found.schedule() if found else None), stats


@dataclass(frozen=True)
class WorkloadBest:
    """A workload's fastest partition as searched (``search_workload``), laid out as a Schedule
    only when wanted: a per-iteration build searches several encoder microbatch sizes and runs
    one, and laying out every size's schedule took a tenth of its time."""

    best: _PlanBest
    feeds: tuple[int, ...]  # ``Schedule.feeds``

    @property
    def iteration_us(self) -> float:
        return self.best.iteration_us

    def schedule(self) -> Schedule:
        return replace(self.best.schedule(), feeds=self.feeds)


def search_workload(
    config: OptimusConfig,
    llm_plan: ParallelPlan,
    candidate: EncoderPlanCandidate,
    bubbles: LLMBubbles,
    cost: CostModel,
    workload: IterationWorkload,
    bound_us: float = float("inf"),
    fine: bool = True,
    images_per_chain: int | None = None,
    chains: ChainMoves | None = None,
    schedules_at_most: int | None = None,
) -> tuple[WorkloadBest | None, SchedulerStats]:
    """``bubble_scheduler`` of a ``workload``, its best not laid out yet (see there).
    ``schedules_at_most``: stop once that many partitions have scheduled, in lower-bound order
    (None: every partition the bound leaves)."""
    imageless = sum(w.empty for w in workload)
    if any(w.empty for w in workload[imageless:]):
        raise ValueError("the LLM runs the imageless microbatches first: order them so")
    split = split_images(workload, images_per_chain)
    if split is None:
        return None, SchedulerStats()
    # an encoder microbatch of fewer images than planned keeps fewer activations in flight
    most = candidate.max_microbatches_per_pipeline * max_images_per_microbatch(config)
    partitions = microbatch_partitions(
        len(split.feeds),
        symmetry_groups(llm_plan, candidate.plan),
        most // max(load.images for load in split.chain.loads),
        config.planner.max_partitions,
    )
    if not partitions.partitions:
        return None, SchedulerStats()
    candidate = replace(candidate, partitions=partitions)
    bubbles = bubbles.feeding(split.feeds)
    if chains is None:
        work = build_encoder_work(config, llm_plan, candidate.plan, cost, split.chain)
        moves = None
    else:
        work, moves = chains.of(candidate.plan, split.chain, bubbles)
    plan_input = _PlanInput.of_work(candidate, work, bubbles)
    best, stats = _search_partitions(
        plan_input, llm_plan, bubbles, bound_us, fine, moves, schedules_at_most
    )
    return (WorkloadBest(best, split.feeds) if best else None), stats


class ChainMoves:
    """One encoder plan's kernel chains and pipeline moves per chain, kept from one iteration's
    schedule to the next (``per_iteration``).

    An iteration's encoder microbatches are all priced at one chain workload
    (``EncoderSplit.chain``); its kernel chains (``build_encoder_work``) depend on nothing else,
    and the pipelines' moves into the LLM's bubbles (``PipelineMoves``) only on those chains, the
    bubbles and the last forward dependency point, not on which LLM microbatches the encoder
    microbatches feed. Iterations differ mostly in the latter, so a job's builds share the former:
    kept by (chain workload, last forward dependency point) for the ``kept`` chains used last, for
    one LLM timeline's bubbles and one encoder plan. A chain's backward moves are dropped beyond
    ``BACKWARD_KEPT`` per pipeline (kept only for reuse, they would grow with every iteration).
    Not thread-safe: a job's builds run one at a time.
    """

    KEPT = 16
    BACKWARD_KEPT = 4096

    def __init__(
        self,
        config: OptimusConfig,
        llm_plan: ParallelPlan,
        encoder_plan: ParallelPlan,
        bubbles: LLMBubbles,
        cost: CostModel,
        kept: int = KEPT,
    ):
        self.config, self.llm_plan, self.encoder_plan = config, llm_plan, encoder_plan
        self.bubbles, self.cost, self.kept = bubbles, cost, kept
        self._kept: OrderedDict[
            tuple[EncoderWorkload, float], tuple[EncoderWork, list[PipelineMoves]]
        ] = OrderedDict()

    def of(
        self, encoder_plan: ParallelPlan, chain: EncoderWorkload, bubbles: LLMBubbles
    ) -> tuple[EncoderWork, list[PipelineMoves]]:
        """``chain``'s encoder work and pipeline moves into ``bubbles`` (the job's, ``feeding``
        some LLM microbatches).

        Raises:
            ValueError: ``encoder_plan`` or ``bubbles``' LLM timeline is not the one kept for.
        """
        if encoder_plan != self.encoder_plan or bubbles.gaps is not self.bubbles.gaps:
            raise ValueError("ChainMoves keeps one encoder plan's moves into one job's bubbles")
        key = (chain, max(bubbles.dep.forward))
        if key in self._kept:
            self._kept.move_to_end(key)
            work, moves = self._kept[key]
            for pipeline in moves:
                if len(pipeline.backward) > self.BACKWARD_KEPT:
                    pipeline.backward.clear()
                    pipeline.backward_seen.clear()
            return work, moves
        work = build_encoder_work(self.config, self.llm_plan, encoder_plan, self.cost, chain)
        self._kept[key] = work, PipelineMoves.of_pipelines(work, bubbles)
        if len(self._kept) > self.kept:
            self._kept.popitem(last=False)
        return self._kept[key]


@dataclass(frozen=True)
class _PlanInput:
    """One encoder plan as the search takes it: its encoder work and each partition's lower
    bound."""

    candidate: EncoderPlanCandidate
    work: EncoderWork
    bounds: dict[tuple[int, ...], float]

    @classmethod
    def of(
        cls,
        config: OptimusConfig,
        llm_plan: ParallelPlan,
        candidate: EncoderPlanCandidate,
        bubbles: LLMBubbles,
        cost: CostModel,
        cut_kernels: bool = True,
        heavy: EncoderWorkload | None = None,
    ) -> _PlanInput:
        """``heavy``: the workload every encoder microbatch is priced at (default: today's)."""
        work = build_encoder_work(config, llm_plan, candidate.plan, cost, heavy)
        return cls.of_work(candidate, work if cut_kernels else work.whole(), bubbles)

    @classmethod
    def of_work(
        cls, candidate: EncoderPlanCandidate, work: EncoderWork, bubbles: LLMBubbles
    ) -> _PlanInput:
        """The plan with its encoder work built already."""
        bound = PartitionBound(work, bubbles.dep, bubbles.lengths)
        return cls(candidate, work, {p: bound(p) for p in candidate.partitions.partitions})

    @property
    def lower_bound_us(self) -> float:
        return min(self.bounds.values(), default=float("inf"))


@dataclass(frozen=True)
class _PlanBest:
    """A plan's fastest partition, as searched: laid out as a Schedule only if it is wanted."""

    state: _PartitionScheduler
    llm_plan: ParallelPlan
    encoder_plan: ParallelPlan
    coarse_us: float  # InitSchedule's latency for the partition

    @property
    def iteration_us(self) -> float:
        return self.state.evaluation.iteration_us

    def schedule(self) -> Schedule:
        return _to_schedule(self.state, self.llm_plan, self.encoder_plan, self.coarse_us)


def _search_partitions(
    plan_input: _PlanInput,
    llm_plan: ParallelPlan,
    bubbles: LLMBubbles,
    bound_us: float,
    fine: bool,
    moves: list[PipelineMoves] | None = None,
    schedules_at_most: int | None = None,
) -> tuple[_PlanBest | None, SchedulerStats]:
    """``bubble_scheduler`` up to its fastest partition; ``moves``: the encoder pipelines' moves
    kept from an earlier search of the same work and bubbles (default: new ones);
    ``schedules_at_most``: the search stops once that many partitions have scheduled (the rest
    count as pruned)."""
    work, bounds = plan_input.work, plan_input.bounds
    stats = SchedulerStats(partitions_total=len(bounds))
    scheduled = 0
    with cyclic_gc_paused():
        if moves is None:
            moves = PipelineMoves.of_pipelines(work, bubbles)
        best: _PlanBest | None = None
        for partition in sorted(bounds, key=bounds.get):
            if (
                bounds[partition] >= min(bound_us, best.iteration_us if best else bound_us) - EPS_US
                or scheduled == schedules_at_most
            ):
                stats.partitions_pruned += 1
                continue
            stats.partitions_searched += 1
            state = init_schedule(work, bubbles, partition, moves)
            if state is None:
                continue
            scheduled += 1
            coarse_us = state.evaluation.iteration_us
            if fine:
                state = optimize_schedule(state, FWD)
                state = optimize_schedule(state, BWD)
            if best is None or state.evaluation.iteration_us < best.iteration_us - EPS_US:
                best = _PlanBest(state, llm_plan, plan_input.candidate.plan, coarse_us)
    return best, stats


@contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """The search allocates millions of small objects (kernel starts, spans, layouts) and no
    reference cycles; Python's cyclic collector would scan the growing heap again and again for
    nothing (about a fifth of the 12288-GPU benchmark row)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _to_schedule(
    state: _PartitionScheduler, llm_plan: ParallelPlan, enc_plan: ParallelPlan, coarse_us: float
) -> Schedule:
    ev, w = state.evaluation, state.work
    t0 = ev.llm_origin_us
    chains = []
    for j, window in enumerate(state.pre):
        for k in range(state.n_coarse_fwd[j]):
            for e, start in enumerate(window.starts[k]):
                chains.append(ChainPlacement(j, e, k, "fwd", "pre", chain_block(start, w.fwd[e])))
    for phase, fine in (("fwd", state.fine_fwd), ("bwd", state.fine_bwd)):
        for (j, k), move in fine.items():
            for e, (starts, cuts) in enumerate(zip(move.starts, move.cuts)):
                if phase == "fwd" or (e >= move.low and w.bwd[e].kernels):
                    chains.append(
                        ChainPlacement(
                            j,
                            e,
                            k,
                            phase,
                            "llm",
                            tuple(s + t0 for s in starts),
                            tuple(
                                (i, tuple((lo, hi, a + t0, b + t0) for lo, hi, a, b in pieces))
                                for i, pieces in cuts.items()
                            ),
                        )
                    )
    for j, coarse in ev.post.items():
        ready, ks, tops = zip(*coarse)
        rows, _ = coarse_backward(ready, state.moves[j].post.origin, w, tops)
        for e in reversed(range(state.pp_enc)):
            if w.bwd[e].kernels:
                chains.extend(
                    ChainPlacement(j, e, k, "bwd", "post", chain_block(row[e] + t0, w.bwd[e]))
                    for k, row, top in zip(ks, rows, tops)
                    if e <= top
                )
    return Schedule(
        llm_plan=llm_plan,
        encoder_plan=enc_plan,
        partition=state.partition,
        dep=state.dep,
        work=w,
        llm_origin_us=t0,
        assignment=tuple(ev.assignment),
        encoder_forward_end_us=tuple(ev.encoder_forward_end_us),
        encoder_backward_start_us=tuple(ev.encoder_backward_start_us),
        chains=tuple(chains),
        iteration_us=ev.iteration_us,
        coarse_iteration_us=coarse_us,
    )


# --------------------------------------------------------------------------------------------
# Algorithm 1


@dataclass(frozen=True)
class PlanOutcome:
    """What the bubble scheduler made of one encoder plan."""

    plan: ParallelPlan
    # bounded: its lower bound cannot beat the best
    status: Literal["scheduled", "bounded", "infeasible"]
    iteration_us: float | None  # best schedule found for this plan
    lower_bound_us: float
    stats: SchedulerStats


@dataclass
class OptimusResult:
    best: Schedule | None  # Optimus's fastest schedule
    outcomes: list[PlanOutcome] = field(default_factory=list)
    llm_alone_us: float = 0.0
    runtime_s: float = 0.0
    # a baseline placement faster than ``best``: the job's choice then
    baseline: BaselineResult | None = None

    @property
    def iteration_us(self) -> float | None:
        """The chosen placement's iteration time: the baseline's if one beats Optimus, else
        Optimus's."""
        if self.baseline is not None:
            return self.baseline.iteration_us
        return self.best.iteration_us if self.best is not None else None

    @property
    def ranked(self) -> list[PlanOutcome]:
        """Scheduled plans fastest first, then plans the bound ruled out, then infeasible ones."""
        order = {"scheduled": 0, "bounded": 1, "infeasible": 2}
        return sorted(
            self.outcomes, key=lambda o: (order[o.status], o.iteration_us or o.lower_bound_us)
        )


def optimus_gains(optimus_us: float, baseline_us: float, noise: float) -> bool:
    """Whether an Optimus schedule is predicted faster than a baseline by more than the machine's
    step-to-step noise (a share, the profile's): a gain inside the noise is no gain, and running
    the baseline then is never slower; a tie goes to the baseline."""
    return optimus_us < baseline_us * (1.0 - noise) - EPS_US


def best_schedule(
    config: OptimusConfig,
    planned: PlannerResult,
    cost: CostModel,
    fine: bool = True,
    cut_kernels: bool = True,
) -> OptimusResult:
    """Optimus (Algorithm 1): run the bubble scheduler on every encoder plan, keep the fastest
    schedule;
    then the baseline placements the runtime can run (``runnable_baselines``, at the LLM plan's V)
    as further candidates: where the fastest schedule does not gain on one (``optimus_gains``), the
    fastest such baseline is the result's ``baseline``.

    Plans are tried in order of their lower bound, so that the best schedule found early lets the
    bound skip plans (and partitions) that cannot beat it. ``cut_kernels=False`` runs every encoder
    kernel whole, as the paper's Algorithm 1 does.
    """
    started = time.perf_counter()
    with cyclic_gc_paused():
        bubbles = LLMBubbles.of(get_enc_llm_dep(config, planned.llm_plan, cost))
        result = OptimusResult(best=None, llm_alone_us=bubbles.dep.timeline.iteration_us)
        plan_inputs = [
            _PlanInput.of(config, planned.llm_plan, c, bubbles, cost, cut_kernels)
            for c in planned.candidates
        ]
        best: _PlanBest | None = None
        for plan_input in sorted(plan_inputs, key=lambda p: p.lower_bound_us):
            bound = best.iteration_us if best else float("inf")
            plan_best, stats = _search_partitions(
                plan_input, planned.llm_plan, bubbles, bound, fine
            )
            enc_plan, lower_bound = plan_input.candidate.plan, plan_input.lower_bound_us
            if plan_best is not None:
                outcome = PlanOutcome(
                    enc_plan, "scheduled", plan_best.iteration_us, lower_bound, stats
                )
                if best is None or plan_best.iteration_us < best.iteration_us:
                    best = plan_best
            elif stats.partitions_searched == 0:
                outcome = PlanOutcome(enc_plan, "bounded", None, lower_bound, stats)
            else:
                outcome = PlanOutcome(enc_plan, "infeasible", None, lower_bound, stats)
            result.outcomes.append(outcome)
        result.best = best.schedule() if best else None
        no_slower = [
            b
            for b in runnable_baselines(config, planned.llm_plan, cost)
            if best is None or not optimus_gains(best.iteration_us, b.iteration_us, cost.step_noise)
        ]
        result.baseline = min(no_slower, key=lambda b: b.iteration_us, default=None)
    result.runtime_s = time.perf_counter() - started
    return result
