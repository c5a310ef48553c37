"""Encoder-LLM dependency points (paper §4.3): F_i, B_i, the adjusted warm-up, and the
global-ordering check."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import repeat
from operator import add, ge, itemgetter, le, sub

from optimus_mllm.config import OptimusConfig
from optimus_mllm.costing.cost_model import CostModel
from optimus_mllm.planner.plans import ParallelPlan
from optimus_mllm.scheduler.llm_costs import llm_op_work, timeline_from_work
from optimus_mllm.scheduler.llm_timeline import LLMTimeline, PipelineDeadlock, default_warmup

EPS_US = 1e-6


@dataclass(frozen=True)
class EncLLMDep:
    """Dependency points of one LLM pipeline, relative to the LLM's origin."""

    forward: tuple[float, ...]  # F_i: the first stage needs encoder output A_i
    backward: tuple[float, ...]  # B_i: the first stage has produced gradient G_i
    warmup: tuple[int, ...]  # warm-up forwards per stage giving these points
    default_warmup: tuple[int, ...]
    timeline: LLMTimeline


def adjusted_warmup(default: list[int], compute_end: Callable[[list[int]], float]) -> list[int]:
    """The adjusted warm-up of Fig. 12 for pipeline stages with megatron-core's ``default`` warm-up.

    Fewer warm-up forwards on the first stages defer the forward dependency points of the later
    microbatches into the 1F1B phase, giving the encoder more time, as long as the LLM's computation
    does not end later. We lower the first stage's warm-up one forward at a time, each later stage
    following as ``min(default_s, w_0 - s)``, and keep the last setting that neither deadlocks nor
    lengthens the pipeline (``compute_end`` simulates one). On small pipelines this matches an
    exhaustive search over all per-stage warm-ups (tests/unit/test_scheduler.py).
    """
    limit = compute_end(default)
    best = list(default)
    for first in range(default[0] - 1, -1, -1):
        warmup = [min(d, first - s) for s, d in enumerate(default)]
        if min(warmup) < 0:
            break
        try:
            end = compute_end(warmup)
        except PipelineDeadlock:
            break
        if end > limit + EPS_US:
            break
        best = warmup
    return best


def get_enc_llm_dep(config: OptimusConfig, plan: ParallelPlan, cost: CostModel) -> EncLLMDep:
    """GetEncLLMDep: F_i and B_i of the LLM timeline under the adjusted warm-up
    (``adjusted_warmup``)."""
    work = llm_op_work(config, plan, cost)
    timelines: dict[tuple[int, ...], LLMTimeline] = {}

    def compute_end(warmup: list[int]) -> float:
        timelines[tuple(warmup)] = timeline_from_work(config, plan, cost, work, warmup)
        return timelines[tuple(warmup)].compute_end_us

    n_mb = config.num_microbatches_total // plan.dp
    default = [default_warmup(plan.pp, plan.vp, n_mb, s) for s in range(plan.pp)]
    best = timelines[tuple(adjusted_warmup(default, compute_end))]
    return EncLLMDep(
        tuple(best.forward_dependency_points),
        tuple(best.backward_dependency_points),
        tuple(s.warmup for s in best.stages),
        tuple(default),
        best,
    )


def global_order(encoder_forward_ends: list[tuple[float, int, int]]) -> list[tuple[int, int]]:
    """Global ordering: the i-th finished encoder forward feeds LLM microbatch i.

    Takes (EF, pipeline, local microbatch) and returns (pipeline, local microbatch) per LLM
    microbatch.
    """
    return list(map(itemgetter(1, 2), sorted(encoder_forward_ends)))


# The bubble scheduler checks these once per move it tries, so they loop in C (map), not in Python.


def check_enc_llm_dep_forward(forward_ends: Iterable[float], dep_forward: Iterable[float]) -> bool:
    """checkEncLLMDep, forward half: EF_i <= F_i for every LLM microbatch i (same time base)."""
    return all(map(le, forward_ends, map(add, dep_forward, repeat(EPS_US))))


def check_enc_llm_dep_backward(
    backward_starts: Iterable[float], dep_backward: Iterable[float]
) -> bool:
    """checkEncLLMDep, backward half: EB_i >= B_i for every LLM microbatch i (same time base)."""
    return all(map(ge, backward_starts, map(sub, dep_backward, repeat(EPS_US))))
