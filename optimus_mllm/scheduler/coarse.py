"""Coarse-grained scheduling (paper §4.3, InitSchedule): an encoder pipeline's work around the LLM.

Forwards run in the ``pre`` window, before the LLM's first computation on each GPU; backwards in the
``post`` window, after its last. Each stage runs one microbatch's chain as one block, GPipe-style.
A pipeline's windows do not depend on the microbatch partition: every layout a partition needs is a
prefix of one pre window and, mostly, of one post window, each laid out once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from operator import gt

from optimus_mllm.scheduler.encoder_costs import EncoderWork, StageChain


@dataclass(frozen=True)
class PreWindow:
    """One encoder pipeline's coarse forwards before the LLM: GPipe-style from the end of the
    encoder's all-gather (iteration time). The first n microbatches of the pipeline run there, so
    every layout that ``evaluate`` needs is a prefix of this one, laid out once."""

    starts: list[list[float]]  # per microbatch k: its start on each stage
    ef: list[tuple[float, int, int]]  # per microbatch k: (EF, j, k)
    ef_times: list[float]  # per microbatch k: its EF
    required: list[float]  # [n - 1]: the t0 that the first n microbatches need

    @classmethod
    def of(cls, w: EncoderWork, j: int, n: int, first: list[float]) -> PreWindow:
        starts, ef, required = [], [], []
        cursor = [w.dp_all_gather_us] * len(w.fwd)
        for k in range(n):
            ready, per_stage = w.dp_all_gather_us, []
            for e, chain in enumerate(w.fwd):
                start = max(cursor[e], ready)
                end = start + chain.duration_us
                per_stage.append(start)
                cursor[e] = end
                ready = end + w.p2p_us
            starts.append(per_stage)
            ef.append((end + w.to_llm_us[j], j, k))
            required.append(max(c - f for c, f in zip(cursor, first)))
        return cls(starts, ef, [e for e, _, _ in ef], required)


class PostWindow:
    """One encoder pipeline's coarse backwards after the LLM (``coarse_backward`` from the LLM
    stages' last computation), laid out once as if every gradient were already there: each
    microbatch starts on the last stage as soon as that stage is free. Gradients arrive during the
    LLM's span, so they are there by then almost always; a layout is this one's prefix up to the
    first microbatch whose gradient comes later, and is laid out from there on from the state the
    prefix leaves."""

    def __init__(self, origin: list[float], work: EncoderWork):
        self.origin, self.work = origin, work
        self.last_stage_starts: list[float] = []  # [k]: microbatch k's start on the last stage
        # [k]: each stage's end after microbatches 0..k-1
        self.ends: list[list[float]] = [list(origin)]
        self.free = [origin[-1]]  # [k]: when the last stage is free for microbatch k

    def queued(self, ready: Sequence[float]) -> bool:
        """Each gradient is there by the time the last stage is free for it: the layout is this
        one's prefix, whose stage ends are ``ends[len(ready)]``."""
        while len(self.last_stage_starts) < len(ready):
            (row,), ends = coarse_backward([float("-inf")], self.ends[-1], self.work)
            self.last_stage_starts.append(row[-1])
            self.ends.append(ends)
            self.free.append(ends[-1])
        return not any(map(gt, ready, self.free))

    def layout(self, ready: tuple[float, ...]) -> tuple[list[float], list[float]]:
        """``coarse_backward(ready, origin)``: each microbatch's start on the last stage, each
        stage's end."""
        n = len(ready)
        if self.queued(ready):
            return self.last_stage_starts[:n], self.ends[n]
        k = next(k for k, (r, free) in enumerate(zip(ready, self.free)) if r > free)
        rows, ends = coarse_backward(ready[k:], self.ends[k], self.work)
        return self.last_stage_starts[:k] + [row[-1] for row in rows], ends


def coarse_backward(
    ready: Sequence[float],
    origin: list[float],
    work: EncoderWork,
    tops: Sequence[int] | None = None,
) -> tuple[list[list[float]], list[float]]:
    """Backwards in a post window: GPipe-style from the last encoder stage to the first, each
    stage's chain as one block, microbatches in the given order with their gradients ready at
    ``ready``, each stage free from ``origin``. ``tops``: per microbatch, the stage it starts on
    there (its chains on the stages above ran in the LLM's bubbles); the last by default. Returns
    every microbatch's start per stage (0 above its top), and each stage's end."""
    cursor = list(origin)
    durations = [chain.duration_us for chain in work.bwd]
    last = len(cursor) - 1
    rows = []
    for n, t in enumerate(ready):
        row = [0.0] * len(cursor)
        for e in range(last if tops is None else tops[n], -1, -1):
            start = cursor[e] if cursor[e] > t else t
            row[e] = start
            cursor[e] = start + durations[e]
            t = cursor[e] + work.p2p_us
        rows.append(row)
    return rows, cursor


def chain_block(start: float, chain: StageChain) -> tuple[float, ...]:
    """The kernel starts of a chain run as one block from ``start``."""
    starts, t = [], start
    for k in chain.kernels:
        starts.append(t)
        t += k.duration_us
    return tuple(starts)
