"""A schedule per iteration: iteration k+1's bubble schedule built in the background while
iteration k trains, with the schedule for the planned maximum as the fallback when it is late.

How the runtime uses it (one instance per LLM pipeline; every rank of the pipeline builds the same
schedule from the same workload, or rank 0 builds it and broadcasts the plan)::

    scheduler = IterationScheduler.for_plan(config, llm_plan, candidate, cost, fallback)
    scheduler.submit(0, workload_0)                    # the first batch's workload
    for k in range(iterations):
        scheduler.submit(k + 1, workload_of(batch k + 1))  # as soon as batch k+1 is fetched
        plan = scheduler.take(k)                       # never waits longer than ``wait_s``
        run(plan.schedule, plan.llm_order)             # the step line prints plan.source
    scheduler.close()

``plan.llm_order[i]`` is the data microbatch LLM microbatch i runs; encoder microbatch s (the index
of ``plan.schedule.assignment``) runs the next ``plan.images_per_chain`` images of LLM microbatch
``plan.schedule.feeds[s]``, in order (None, as in the fallback: one encoder microbatch per LLM
microbatch, all its images).

``take`` hands back an ``IterationPlan``: the iteration's own schedule (``source`` "per-iteration")
or, where it is not ready by the deadline, could not be built, or is not faster, the ``fallback``
(``source`` "fallback", ``reason`` saying why). The fallback is the schedule for the maximum memory
is planned for (``data.max_images_per_microbatch``): it runs every microbatch in data order in slots
sized for the largest, so it holds for any batch within that maximum.

An iteration's own schedule runs its imageless microbatches first (``llm_order``) and its images as
encoder microbatches of at most ``images_per_chain`` images each (``schedule_iteration`` tries the
heaviest microbatch's count, half and a quarter of it, and keeps the fastest; see
``bubble_scheduler``). Where none schedules, mostly because its images make fewer encoder
microbatches than the plan has encoder pipelines (a few images among many imageless microbatches),
it is scheduled ``padded``: every microbatch in one encoder microbatch priced at the heaviest, the
imageless ones keeping slots they leave empty. The LLM's dependency points and bubbles are computed
once for the job, and an iteration whose workload one of the last ``KEPT_SCHEDULES`` had reuses
that schedule without a search (``reused``); a build still running for the same workload is waited
on, not repeated. Other workloads are searched afresh, but from the encoder chains and their moves
into the bubbles kept from earlier iterations priced at the same chain (``ChainMoves``): the same
schedule as alone, sooner (at fig5_8gpu, with the fine placement's single search, a build takes a
third of the CPU time it did: ``benchmarks/bench_dynamic.py``'s scheduler share, 70 % of the step
before, 23 % after; 31 % under a later cost model, whose step is another). A backward move is
reused by what its placement sees (``PipelineMoves.backward_seen``) and only the fastest size's
schedule is laid out: 12.35 % before, 6.85 % after. Each size's search stops once
``ITERATION_SCHEDULES`` partitions have scheduled: 9.28 % before, 3.73-4.87 % after, the mean
iteration 0.01 % longer (``docs/benchmarks.md``).

What the training runtime runs (``runtime/iteration_schedules``): the plan as a schedule artifact
(``schedule_to_artifact`` with ``llm_order`` and ``images_per_chain``), whose ``feeds`` names the
LLM microbatch each encoder microbatch feeds; the LLM runs its data microbatches in ``llm_order``,
waits on no encoder for an imageless one, and joins a split microbatch's image tokens in image
order before its first stage's forward. Iterations whose workloads are the same once in
``llm_order`` share one schedule (the artifact differs only in ``llm_order``).

Builds run on one background thread by default (the scheduler is pure Python: it shares the
interpreter with the training loop; pass a process pool as ``executor`` to keep it off the GIL, with
a ``build`` that pickles). No torch here.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Literal

from optimus_mllm.config import OptimusConfig
from optimus_mllm.costing.cost_model import CostModel
from optimus_mllm.costing.workload import IterationWorkload, chain_sizes, heaviest, llm_order
from optimus_mllm.planner.planner import EncoderPlanCandidate
from optimus_mllm.planner.plans import ParallelPlan
from optimus_mllm.scheduler.bubble_scheduler import (
    ChainMoves,
    Schedule,
    WorkloadBest,
    cyclic_gc_paused,
    search_workload,
)
from optimus_mllm.scheduler.dependencies import EPS_US, get_enc_llm_dep
from optimus_mllm.scheduler.fine import LLMBubbles

Source = Literal["per-iteration", "fallback"]

# the workloads whose schedules an IterationScheduler keeps for reuse (bounded: a schedule holds
# every chain's kernel starts, and a long job's workloads rarely repeat exactly)
KEPT_SCHEDULES = 64

# An iteration's own schedule is searched over the first partitions that schedule, in lower-bound
# order, not over every one the bound leaves: the bound is loose by a few per cent and equal for
# most partitions, so the full search ran some 15-25 partitions a size, while the fastest was among
# the first four on every one of 40 drawn fig5_8gpu iterations. At 4, benchmarks/bench_dynamic.py
# at fig5_8gpu gave a mean iteration 0.01 % longer for about half the scheduler time
# (docs/benchmarks.md). The job's own schedule (``bubble_scheduler``) still searches them all.
ITERATION_SCHEDULES = 4


@dataclass(frozen=True)
class IterationSchedule:
    """An iteration's own schedule and the encoder microbatch size it runs its images at."""

    schedule: Schedule  # ``Schedule.feeds``: the LLM position each encoder microbatch feeds
    # None: one encoder microbatch per LLM microbatch, each priced at the heaviest (``padded``)
    images_per_chain: int | None


@dataclass(frozen=True)
class IterationPlan:
    """The schedule one iteration runs, and the order the LLM takes its data microbatches in."""

    iteration: int
    schedule: Schedule
    # LLM microbatch i runs data microbatch llm_order[i]
    llm_order: tuple[int, ...]
    source: Source
    reason: str  # why the fallback runs; "" for the iteration's own schedule
    # the most images of one encoder microbatch (``split_images``); None: one encoder microbatch
    # per LLM microbatch, as the fallback runs them
    images_per_chain: int | None = None
    reused: bool = False  # the own schedule was an earlier iteration's, no search ran


class IterationScheduler:
    """Builds each iteration's schedule in the background; hands out it or the fallback."""

    def __init__(
        self,
        build: Callable[[IterationWorkload], IterationSchedule | None],
        fallback: Schedule,
        executor: Executor | None = None,
        kept: int = KEPT_SCHEDULES,
    ):
        """``build``: a workload in ``llm_order`` -> its schedule, or None where none exists;
        ``fallback``: the schedule for the planned maximum; ``kept``: the most workloads whose
        schedules are kept for reuse (the ones submitted last; a workload of an iteration not
        taken yet is always kept)."""
        self.build, self.fallback = build, fallback
        self.kept = kept
        self._own_executor = executor is None
        self.executor = executor or ThreadPoolExecutor(1, thread_name_prefix="optimus-schedule")
        # the builds by workload, the one submitted last at the end
        self._by_key: OrderedDict[IterationWorkload, Future[IterationSchedule | None]] = (
            OrderedDict()
        )
        self._pending: dict[int, tuple[IterationWorkload, tuple[int, ...], bool]] = {}

    @classmethod
    def for_plan(
        cls,
        config: OptimusConfig,
        llm_plan: ParallelPlan,
        candidate: EncoderPlanCandidate,
        cost: CostModel,
        fallback: Schedule,
        executor: Executor | None = None,
    ) -> IterationScheduler:
        """Per-iteration schedules of one encoder plan, its LLM's bubbles computed once here."""
        bubbles = LLMBubbles.of(get_enc_llm_dep(config, llm_plan, cost))
        build = partial(
            schedule_iteration,
            config,
            llm_plan,
            candidate,
            bubbles,
            cost,
            bound_us=fallback.iteration_us,
            chains=ChainMoves(config, llm_plan, candidate.plan, bubbles, cost),
        )
        return cls(build, fallback, executor)

    def submit(self, iteration: int, workload: IterationWorkload) -> None:
        """Start building ``iteration``'s schedule (as soon as its batch is known)."""
        order = llm_order(workload)
        key = tuple(workload[i] for i in order)
        reused = key in self._by_key
        if reused:
            self._by_key.move_to_end(key)
        else:
            self._by_key[key] = self.executor.submit(self.build, key)
        self._pending[iteration] = (key, order, reused)
        self._forget_beyond_kept()

    def _forget_beyond_kept(self) -> None:
        """Drop the schedules of the workloads submitted longest ago beyond ``kept``, except
        those of iterations not taken yet."""
        waiting = {key for key, _, _ in self._pending.values()}
        for key in list(self._by_key):
            if len(self._by_key) <= self.kept:
                return
            if key not in waiting:
                del self._by_key[key]

    def ready(self, iteration: int) -> bool:
        """Whether ``iteration``'s schedule is built (or failed): ``take`` would not wait."""
        key, _, _ = self._pending[iteration]
        return self._by_key[key].done()

    def llm_order(self, iteration: int) -> tuple[int, ...]:
        """The LLM order ``iteration``'s own schedule runs its data microbatches in."""
        return self._pending[iteration][1]

    def built(self, iteration: int) -> IterationSchedule | None:
        """``iteration``'s build, once ``ready``: its schedule, or None where none exists."""
        key, _, _ = self._pending[iteration]
        return self._by_key[key].result()

    def take(
        self, iteration: int, wait_s: float = 0.0, ready_elsewhere: bool = True
    ) -> IterationPlan:
        """``iteration``'s plan, waiting at most ``wait_s`` for its schedule; the fallback where it
        is late (it goes on building, for later iterations of the same key), failed, or is not
        faster than the fallback. ``ready_elsewhere`` false: another rank that must run the same
        schedule has not built it in time, so this one runs the fallback too."""
        key, order, reused = self._pending.pop(iteration)
        future = self._by_key[key]
        self._forget_beyond_kept()
        if not ready_elsewhere:
            return self._fallback(iteration, "late: not built on every rank by the step")
        deadline = time.monotonic() + wait_s
        while not future.done() and time.monotonic() < deadline:
            time.sleep(min(0.001, max(0.0, deadline - time.monotonic())))
        if not future.done():
            return self._fallback(iteration, f"late: not built within {wait_s:g} s")
        built = future.result()
        if built is None:
            return self._fallback(iteration, "no schedule for this workload")
        if built.schedule.iteration_us > self.fallback.iteration_us + EPS_US:
            return self._fallback(iteration, "not faster than the fallback")
        return IterationPlan(
            iteration,
            built.schedule,
            order,
            "per-iteration",
            "",
            built.images_per_chain,
            reused,
        )

    def _fallback(self, iteration: int, reason: str) -> IterationPlan:
        n = len(self.fallback.assignment)
        return IterationPlan(iteration, self.fallback, tuple(range(n)), "fallback", reason)

    def close(self, wait: bool = True) -> None:
        """Stop the background builds (a running one finishes first; ``wait`` false: without
        waiting for it here)."""
        if self._own_executor:
            self.executor.shutdown(wait=wait, cancel_futures=True)


def schedule_iteration(
    config: OptimusConfig,
    llm_plan: ParallelPlan,
    candidate: EncoderPlanCandidate,
    bubbles: LLMBubbles,
    cost: CostModel,
    workload: IterationWorkload,
    bound_us: float = float("inf"),
    chains: ChainMoves | None = None,
    schedules_at_most: int | None = ITERATION_SCHEDULES,
) -> IterationSchedule | None:
    """The fastest schedule of ``workload`` (in ``llm_order``) over the encoder microbatch sizes
    ``chain_sizes`` gives; where none schedules (mostly: the images make fewer encoder microbatches
    than the plan has encoder pipelines), the one with every microbatch priced at the heaviest
    (``padded``). None where no image, or nothing beats ``bound_us`` (the fallback's time:
    partitions whose lower bound cannot beat it, or the best size so far, are not searched).
    ``chains``: the plan's chains and moves kept from earlier iterations (the same schedule,
    sooner). ``schedules_at_most``: each size's search stops once that many partitions have
    scheduled (``ITERATION_SCHEDULES``; None: all the bound leaves). Only the fastest size's
    schedule is laid out, and Python's cyclic collector runs once after the build rather than
    after each size's search (``cyclic_gc_paused``)."""
    search = partial(
        search_workload,
        config,
        llm_plan,
        candidate,
        bubbles,
        cost,
        chains=chains,
        schedules_at_most=schedules_at_most,
    )
    best: tuple[WorkloadBest, int | None] | None = None
    sizes = chain_sizes(workload)
    with cyclic_gc_paused():
        for size in sizes:
            bound = min(bound_us, best[0].iteration_us if best else bound_us)
            found, _ = search(workload, bound, images_per_chain=size)
            if found is not None and (
                best is None or found.iteration_us < best[0].iteration_us - EPS_US
            ):
                best = found, size
        if best is None and sizes and padded(workload) != workload:
            found, _ = search(padded(workload), bound_us)
            best = (found, None) if found is not None else None
        return IterationSchedule(best[0].schedule(), best[1]) if best else None


def padded(workload: IterationWorkload) -> IterationWorkload:
    """Every microbatch at the heaviest one's work, in one encoder microbatch each: an imageless
    microbatch keeps slots it leaves empty, so the LLM's order of the microbatches does not matter.
    As many encoder microbatches as LLM microbatches, for an iteration whose images are too few to
    give each of the plan's encoder pipelines one."""
    return (heaviest(workload),) * len(workload)
