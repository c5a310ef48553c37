"""A lower bound on every schedule of one microbatch partition.

The bubble scheduler skips partitions, and whole encoder plans, whose bound cannot beat the best
schedule found so far; a bound that is never above what scheduling gives drops no better schedule.
The bound counts the exposed collectives, the backward of the last LLM microbatch, and each encoder
stage's compute against the time its GPUs can give it: before the LLM starts (forwards only), in the
LLM's bubbles, and after the LLM's last computation (backwards only). An encoder kernel runs inside
one bubble or not at all, so kernels of d us or more can use only the bubbles at least d long; one
the scheduler may cut into pieces (``fine``) counts as 0 us long, free to use any bubble.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable
from dataclasses import dataclass

from optimus_mllm.scheduler.dependencies import EncLLMDep
from optimus_mllm.scheduler.encoder_costs import EncoderWork, StageChain
from optimus_mllm.scheduler.intervals import FreeIntervals
from optimus_mllm.scheduler.llm_timeline import LLMTimeline


@dataclass(frozen=True)
class Lengths:
    """Durations by the length of bubble they need, ascending, to total those needing at least some
    length."""

    values: tuple[float, ...]  # the lengths
    total_from: tuple[float, ...]  # [i]: the durations of values[i:] summed; one more entry, 0

    @classmethod
    def of(cls, durations: Iterable[float]) -> Lengths:
        """Bubbles, or kernels run whole: each needs its own duration."""
        return cls.of_items((d, d) for d in durations)

    @classmethod
    def of_items(cls, items: Iterable[tuple[float, float]]) -> Lengths:
        """(length needed, duration) items."""
        ordered = sorted(items)
        totals = [0.0] * (len(ordered) + 1)
        for i in reversed(range(len(ordered))):
            totals[i] = totals[i + 1] + ordered[i][1]
        return cls(tuple(length for length, _ in ordered), tuple(totals))

    @classmethod
    def of_gaps(cls, gaps: FreeIntervals) -> Lengths:
        return cls.of(end - start for start, end in gaps.intervals())

    @classmethod
    def of_compute(cls, chain: StageChain) -> Lengths:
        """The chain's compute kernels (its collectives run on the comm stream); a splittable one
        needs no
        length (any bubble may take a piece of it)."""
        return cls.of_items(
            (0.0 if splittable else d, d) for d, is_comm, splittable in chain.steps if not is_comm
        )

    def at_least(self, d: float) -> float:
        return self.total_from[bisect_left(self.values, d)]


# per kernel length d: forward, backward compute in kernels >= d, room
Demand = list[tuple[float, float, float]]


def stage_demand(fwd: Lengths, bwd: Lengths, bubbles: Lengths) -> Demand:
    """For each length d of the stage's compute kernels (``fwd``, ``bwd``: one microbatch's): its
    forward
    and backward compute in kernels at least d long, and the LLM stage's idle time in bubbles at
    least d long."""
    return [
        (fwd.at_least(d), bwd.at_least(d), bubbles.at_least(d))
        for d in sorted(set(fwd.values) | set(bwd.values))
    ]


def stage_excess_us(demand: Demand, n: int) -> tuple[float, float, float]:
    """Compute of ``n`` microbatches on one encoder stage that the LLM's bubbles cannot hold, at
    least: (of the forwards, of the backwards, of both), each 0 or more.

    For every kernel length d, the kernels at least d long must fit, beyond the bubbles at least d
    long, before the LLM starts (forwards) or after it ends (backwards).
    """
    forward = backward = both = 0.0
    for f, b, room in demand:
        f, b = n * f, n * b
        forward, backward, both = (
            max(forward, f - room),
            max(backward, b - room),
            max(both, f + b - room),
        )
    return forward, backward, both


class PartitionBound:
    """``bound(partition)``: no schedule of that partition of one encoder plan is faster
    (``bubbles``: per
    LLM stage, its idle compute time by length).

    t0 is at least what the all-gathers need and what each stage's forwards left out of the bubbles
    need before the stage's first computation. Then every iteration contains the LLM's span and
    reduce-scatters; the encoder's reduce-scatter follows the backward of the last LLM microbatch
    through a whole encoder pipeline; and it follows the compute a stage's GPUs must run after their
    LLM stage's last computation.
    """

    def __init__(self, work: EncoderWork, dep: EncLLMDep, bubbles: list[Lengths]):
        self.work, self.dep = work, dep
        tl = dep.timeline
        self.first = [st.first_compute_us for st in tl.stages]
        self.t0_low = all_gather_t0(work, tl)
        # the encoder's reduce-scatter after the last LLM microbatch's backward (tau)
        self.tail = 0.0
        if any(chain.kernels for chain in work.bwd):
            # The last LLM microbatch's gradient leaves the LLM at B_last; some encoder pipeline
            # must then run its whole backward before its first stage's GPUs can reduce-scatter the
            # encoder's gradients.
            chain = sum(c.duration_us for c in work.bwd) + (len(work.bwd) - 1) * work.p2p_us
            self.tail = min(
                reduce_scatters_end(
                    tl,
                    work.llm_stage(j, 0),
                    work.dp_reduce_scatter_us,
                    dep.backward[-1] + work.to_llm_us[j] + chain,
                    work.optimizer_step_us,
                )
                for j in range(work.num_pipelines)
            )
        self.stages = [
            [work.llm_stage(j, e) for e in range(len(work.fwd))] for j in range(work.num_pipelines)
        ]
        fwd, bwd = (
            [Lengths.of_compute(c) for c in work.fwd],
            [Lengths.of_compute(c) for c in work.bwd],
        )
        self.demand = {
            (e, s): stage_demand(fwd[e], bwd[e], bubbles[s])
            for stages in self.stages
            for e, s in enumerate(stages)
        }
        self.excess: dict[
            tuple[int, int, int], tuple[float, float, float]
        ] = {}  # (e, s, n) -> stage_excess_us

    def __call__(self, partition: tuple[int, ...]) -> float:
        work, tl = self.work, self.dep.timeline
        excess = []
        for stages, n in zip(self.stages, partition):
            for e, s in enumerate(stages if n else ()):
                if (e, s, n) not in self.excess:
                    self.excess[(e, s, n)] = stage_excess_us(self.demand[(e, s)], n)
                excess.append((s, self.excess[(e, s, n)]))
        t0 = max(
            [self.t0_low]
            + [work.dp_all_gather_us + forward - self.first[s] for s, (forward, _, _) in excess]
        )
        bound = t0 + max(tl.tail_us, self.tail)
        for s, (_, backward, both) in excess:
            # the stage's time before its LLM stage starts
            before = t0 + self.first[s] - work.dp_all_gather_us
            # the least compute after its LLM stage's last computation
            after = max(backward, both - before)
            if after > 0:
                encoder_done = tl.stages[s].last_compute_us + after
                bound = max(
                    bound,
                    t0
                    + reduce_scatters_end(
                        tl, s, work.dp_reduce_scatter_us, encoder_done, work.optimizer_step_us
                    ),
                )
        return bound


def all_gather_t0(work: EncoderWork, timeline: LLMTimeline) -> float:
    """The least t0 (the LLM's origin): the encoder's all-gather, then each LLM stage's own, before
    the stage's first computation."""
    return max(
        [0.0]
        + [
            work.dp_all_gather_us + ag - st.first_compute_us
            for st, ag in zip(timeline.stages, timeline.dp_all_gather_us)
        ]
    )


def reduce_scatters_end(
    timeline: LLMTimeline,
    stage: int,
    encoder_rs_us: float,
    encoder_done: float | None,
    encoder_optimizer_us: float = 0.0,
) -> float:
    """When the GPUs of LLM stage ``stage`` finish their gradient reduce-scatters (tau): the LLM's
    after
    its last computation, and the encoder's (``encoder_rs_us``) after its last backward there
    (``encoder_done``; None where these GPUs hold no encoder gradients); then the optimizer steps
    over the stage's parameters (the encoder's, ``encoder_optimizer_us``, where it has some)."""
    transfers = [(timeline.stages[stage].last_compute_us, timeline.dp_reduce_scatter_us[stage])]
    optimizer = timeline.stage_optimizer_us(stage)
    if encoder_done is not None:
        transfers.append((encoder_done, encoder_rs_us))
        optimizer += encoder_optimizer_us
    return network_fifo_end(transfers) + optimizer


def network_fifo_end(transfers: list[tuple[float, float]]) -> float:
    """End of (ready, duration) transfers sharing one GPU's network link, served in ready order.

    The encoder's gradient reduce-scatter starts as soon as its last backward is done, under the
    LLM's computation if that is still running; the LLM's own starts after its last backward.
    """
    t = 0.0
    for ready, duration in sorted(transfers):
        t = max(t, ready) + duration
    return t
