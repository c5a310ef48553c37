"""A schedule per iteration (issue 34): built in the background while the step before runs, handed
out or replaced by the fallback for the planned maximum, never waited on past its deadline."""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from functools import partial

import pytest

from optimus_mllm.config import load_config
from optimus_mllm.costing.cost_model import CostModel
from optimus_mllm.costing.workload import EncoderWorkload, chain_sizes, check_within
from optimus_mllm.errors import OptimusError
from optimus_mllm.planner import plan
from optimus_mllm.scheduler import bubble_scheduler as scheduler_module
from optimus_mllm.scheduler.bubble_scheduler import ChainMoves, bubble_scheduler, search_workload
from optimus_mllm.scheduler.dependencies import EPS_US, get_enc_llm_dep
from optimus_mllm.scheduler.fine import LLMBubbles
from optimus_mllm.scheduler.per_iteration import (
    IterationSchedule,
    IterationScheduler,
    padded,
    schedule_iteration,
)

from support.moves import UnseenMoves
from support.paths import CONFIGS
from support.validity import schedule_violations

MAX_IMAGES = 4


@pytest.fixture(scope="module")
def job():
    config = load_config(
        CONFIGS / "paper" / "fig5_8gpu.yaml", (f"data.max_images_per_microbatch={MAX_IMAGES}",)
    )
    planned = plan(config)
    cost = CostModel.from_config(config)
    candidate = next(c for c in planned.candidates if c.plan.dp == 2 and c.plan.pp == 2)
    bubbles = LLMBubbles.of(get_enc_llm_dep(config, planned.llm_plan, cost))
    maximum = (EncoderWorkload.of_images(config, MAX_IMAGES),) * planned.num_microbatches
    fallback, _ = bubble_scheduler(
        config, planned.llm_plan, candidate, bubbles, cost, workload=maximum
    )
    return config, planned, cost, candidate, fallback


def _workload(config, counts):
    return tuple(EncoderWorkload.of_images(config, n) for n in counts)


def _iterations(config, n):
    """Three distinct workloads, then the first again."""
    first = [0, 1] * (n // 2)
    return [
        _workload(config, first),
        _workload(config, [2] * n),
        _workload(config, [0] * (n - 3) + [1, 1, 3]),
        _workload(config, first),
    ]


def test_each_iteration_runs_its_own_valid_schedule(job):
    config, planned, cost, candidate, fallback = job
    scheduler = IterationScheduler.for_plan(config, planned.llm_plan, candidate, cost, fallback)
    iterations = _iterations(config, planned.num_microbatches)
    for k, workload in enumerate(iterations):
        scheduler.submit(k, workload)
    plans = [scheduler.take(k, wait_s=60.0) for k in range(len(iterations))]
    scheduler.close()
    assert [p.source for p in plans] == ["per-iteration"] * 4
    assert [p.reused for p in plans] == [False, False, False, True]
    for p, workload in zip(plans, iterations):
        assert schedule_violations(p.schedule) == []
        assert p.schedule.iteration_us <= fallback.iteration_us
        # the LLM runs the imageless microbatches first, and waits on no encoder for them
        imageless = sum(w.empty for w in workload)
        assert all(workload[i].empty for i in p.llm_order[:imageless])
        assert sorted(p.llm_order) == list(range(len(workload)))
        fed = [workload[p.llm_order[i]].images for i in p.schedule.feeds]
        assert min(fed) > 0 and set(p.schedule.feeds) == set(range(imageless, len(workload)))
        # each LLM microbatch is fed by as many encoder microbatches as its images need
        for position in set(p.schedule.feeds):
            images = workload[p.llm_order[position]].images
            assert p.schedule.feeds.count(position) == -(-images // p.images_per_chain)
    # different workloads, different schedules
    assert len({p.schedule.iteration_us for p in plans[:3]}) == 3
    assert plans[3].schedule is plans[0].schedule


def test_a_slowed_scheduler_makes_iterations_fall_back_without_stalling(job):
    config, planned, cost, candidate, fallback = job
    real = IterationScheduler.for_plan(config, planned.llm_plan, candidate, cost, fallback)
    release = threading.Event()

    def slow_build(workload):
        release.wait(timeout=30.0)  # held back until the test lets it finish
        return real.build(workload)

    scheduler = IterationScheduler(slow_build, fallback)
    iterations = _iterations(config, planned.num_microbatches)
    waits, plans = [], []
    scheduler.submit(0, iterations[0])
    for k in range(3):
        scheduler.submit(k + 1, iterations[k + 1])
        started = time.monotonic()
        plans.append(scheduler.take(k, wait_s=0.05))
        waits.append(time.monotonic() - started)
    assert [p.source for p in plans] == ["fallback"] * 3
    assert all(p.reason.startswith("late") for p in plans)
    assert all(p.schedule is fallback for p in plans)
    assert plans[0].llm_order == tuple(range(planned.num_microbatches))
    assert max(waits) < 1.0  # the deadline, not the 30 s build
    # once the late build is done, a later iteration of the same workload runs its own schedule
    release.set()
    scheduler.take(3, wait_s=60.0)
    scheduler.submit(4, iterations[0])
    late = scheduler.take(4, wait_s=60.0)
    scheduler.close()
    assert (late.source, late.reused) == ("per-iteration", True)
    assert schedule_violations(late.schedule) == []


def test_a_schedule_slower_than_the_fallback_or_missing_falls_back(job):
    config, planned, _, _, fallback = job
    slower = dataclasses.replace(fallback, iteration_us=fallback.iteration_us * 2)
    too_slow = IterationSchedule(slower, MAX_IMAGES)
    for build, reason in ((lambda w: too_slow, "not faster"), (lambda w: None, "no schedule")):
        scheduler = IterationScheduler(build, fallback)
        scheduler.submit(0, _workload(config, [1] * planned.num_microbatches))
        p = scheduler.take(0, wait_s=60.0)
        scheduler.close()
        assert (p.source, p.schedule) == ("fallback", fallback)
        assert p.reason.startswith(reason)


def test_a_batch_above_the_planned_maximum_is_one_line_naming_the_microbatch(job):
    config, planned, *_ = job
    maximum = EncoderWorkload.of_images(config, MAX_IMAGES)
    check_within(_workload(config, [0, MAX_IMAGES, 1]), maximum, config)
    with pytest.raises(OptimusError) as error:
        check_within(_workload(config, [0, 1, MAX_IMAGES + 1]), maximum, config)
    assert str(error.value).startswith("data microbatch 2: 5 images for encoder 'vit', above ")
    assert "data.max_images_per_microbatch=4" in str(error.value)
    too_long = (EncoderWorkload.of_images(config, 1, config.encoders[0].seq_length * 2),)
    with pytest.raises(OptimusError, match="data microbatch 0: images of 512 tokens"):
        check_within(too_long, maximum, config)


def test_a_reordered_split_schedule_becomes_an_artifact_that_says_so(job):
    """The artifact the runtime runs carries the iteration's LLM order (imageless microbatches
    first), the LLM microbatch each encoder microbatch feeds, and how many images each runs."""
    from optimus_mllm.scheduler.artifact import schedule_to_artifact
    from optimus_mllm.scheduler.artifact_checks import validate_artifact

    config, planned, cost, candidate, fallback = job
    n = planned.num_microbatches
    static = schedule_to_artifact(fallback, config)
    assert static.num_microbatches == n and static.images_per_chain is None
    assert static.llm_order == static.feeds == tuple(range(n))
    assert candidate.plan.dp == 2  # two encoder pipelines per LLM pipeline (the fixture's)
    scheduler = IterationScheduler.for_plan(config, planned.llm_plan, candidate, cost, fallback)
    # one encoder microbatch of all four images is fewer than the two pipelines: it must split
    scheduler.submit(0, _workload(config, [MAX_IMAGES] + [0] * (n - 1)))
    own = scheduler.take(0, wait_s=60.0)
    scheduler.close()
    assert own.source == "per-iteration" and own.images_per_chain < MAX_IMAGES
    artifact = schedule_to_artifact(own.schedule, config, own.llm_order, own.images_per_chain)
    validate_artifact(artifact, "a per-iteration schedule")
    assert artifact.llm_order == own.llm_order == (*range(1, n), 0)
    assert artifact.images_per_chain == own.images_per_chain
    parts = -(-MAX_IMAGES // own.images_per_chain)
    # the imageless microbatches are fed by none, the last the LLM runs by its images' chains
    assert artifact.feeds == (n - 1,) * parts
    assert len(artifact.assignment) == sum(artifact.partition) == len(artifact.feeds)
    assert {op.microbatch for s in artifact.encoder_stages for op in s.ops} == {n - 1}


def test_workloads_that_differ_in_order_only_share_a_schedule_not_an_order(job):
    """Iterations whose microbatches carry the same images in another data order reuse one
    schedule, each running its own data microbatches at the LLM positions it priced; an imageless
    iteration has no schedule of its own."""
    config, planned, cost, candidate, fallback = job
    n = planned.num_microbatches
    scheduler = IterationScheduler.for_plan(config, planned.llm_plan, candidate, cost, fallback)
    counts = [[0, 1] * (n // 2), [1, 0] * (n // 2), [0] * (n - 1) + [3], [0] * n]
    for k, c in enumerate(counts):
        scheduler.submit(k, _workload(config, c))
    plans = [scheduler.take(k, wait_s=60.0) for k in range(len(counts))]
    scheduler.close()
    assert [p.source for p in plans[:3]] == ["per-iteration"] * 3
    assert [p.reused for p in plans[:3]] == [False, True, False]
    assert (plans[3].source, plans[3].reason) == ("fallback", "no schedule for this workload")
    assert plans[0].schedule is plans[1].schedule
    assert plans[0].llm_order == (*range(0, n, 2), *range(1, n, 2))
    assert plans[1].llm_order == (*range(1, n, 2), *range(0, n, 2))
    for c, p in zip(counts, plans[:3]):
        assert schedule_violations(p.schedule) == []
        assert [c[i] for i in p.llm_order] == sorted(c, key=bool)  # imageless first
    assert plans[2].schedule.iteration_us <= fallback.iteration_us


def test_too_few_images_for_the_encoder_pipelines_run_padded(job):
    """One image among imageless microbatches makes one encoder microbatch, fewer than the plan's
    encoder pipelines: the iteration's own schedule then prices every microbatch at that image, in
    one encoder microbatch each, still faster than the fallback for the maximum."""
    config, planned, cost, candidate, fallback = job
    n = planned.num_microbatches
    assert candidate.plan.dp // planned.llm_plan.dp > 1
    scheduler = IterationScheduler.for_plan(config, planned.llm_plan, candidate, cost, fallback)
    workload = _workload(config, [0] * (n - 1) + [1])
    scheduler.submit(0, workload)
    own = scheduler.take(0, wait_s=60.0)
    scheduler.close()
    assert own.source == "per-iteration" and own.images_per_chain is None
    assert own.schedule.feeds == tuple(range(n))
    assert own.llm_order[-1] == n - 1  # the one with the image runs last
    assert schedule_violations(own.schedule) == []
    assert own.schedule.iteration_us < fallback.iteration_us


def test_an_iteration_late_on_another_rank_runs_the_fallback(job):
    config, planned, cost, candidate, fallback = job
    scheduler = IterationScheduler.for_plan(config, planned.llm_plan, candidate, cost, fallback)
    scheduler.submit(0, _workload(config, [1] * planned.num_microbatches))
    while not scheduler.ready(0):
        time.sleep(0.01)
    p = scheduler.take(0, ready_elsewhere=False)
    scheduler.close()
    assert (p.source, p.schedule) == ("fallback", fallback)
    assert p.reason == "late: not built on every rank by the step"


def _same_schedule(a, b):
    if a is None or b is None:
        return a is b
    fields = ("partition", "llm_origin_us", "assignment", "encoder_forward_end_us")
    fields += ("encoder_backward_start_us", "chains", "iteration_us", "feeds", "work")
    return all(getattr(a, f) == getattr(b, f) for f in fields)


def test_chains_kept_across_iterations_schedule_each_as_alone(job):
    """``ChainMoves`` keeps an encoder chain's work and moves from one iteration's build to the
    next: iterations whose encoder microbatches feed different LLM microbatches (so gradients
    arrive at other times) and run at other chain sizes, built in any order with the kept ones,
    get exactly the schedule each gets alone."""
    config, planned, cost, candidate, _ = job
    n = planned.num_microbatches
    bubbles = LLMBubbles.of(get_enc_llm_dep(config, planned.llm_plan, cost))
    counts = [
        [0, 2] * (n // 2),
        [2] * n,
        [0] * (n - 3) + [2, 1, 2],
        [0] * 4 + [2, 1] * (n // 2 - 2),
    ]
    builds = [(c, size) for size in (1, 2) for c in counts] + [(counts[1], 2), (counts[0], 2)]
    chains = ChainMoves(config, planned.llm_plan, candidate.plan, bubbles, cost)
    kept = 0
    for c, size in builds:
        workload = _workload(config, sorted(c, key=bool))  # imageless first, as the LLM runs them
        alone, _ = bubble_scheduler(
            config,
            planned.llm_plan,
            candidate,
            bubbles,
            cost,
            workload=workload,
            images_per_chain=size,
        )
        together, _ = bubble_scheduler(
            config,
            planned.llm_plan,
            candidate,
            bubbles,
            cost,
            workload=workload,
            images_per_chain=size,
            chains=chains,
        )
        assert alone is not None and _same_schedule(alone, together), (c, size)
        backward = [len(m.backward) for _, moves in chains._kept.values() for m in moves]
        kept = max(kept, *backward)
    assert len(chains._kept) == 2  # one per chain size: every workload's heaviest has 2 images
    assert kept > 0
    other = dataclasses.replace(candidate.plan, pp=candidate.plan.pp + 1)
    with pytest.raises(ValueError, match="one encoder plan"):
        chains.of(other, EncoderWorkload.of_images(config, 2), bubbles)


def test_the_schedules_kept_for_reuse_are_bounded_and_never_those_still_to_run(job):
    config, planned, _, _, fallback = job
    built = []

    def build(workload):
        built.append(workload)
        return IterationSchedule(fallback, MAX_IMAGES)

    scheduler = IterationScheduler(build, fallback, kept=2)
    workloads = [_workload(config, [k + 1] * planned.num_microbatches) for k in range(4)]
    reused = []
    for k, workload in enumerate(workloads[:3] + [workloads[0], workloads[2]]):
        scheduler.submit(k, workload)
        reused.append(scheduler.take(k, wait_s=60.0).reused)
    # the first workload was dropped for the third; the third, kept, is reused
    assert reused == [False, False, False, False, True]
    assert len(built) == 4
    # iterations submitted but not taken keep their builds, whatever ``kept`` says
    for k, workload in enumerate(workloads, start=5):
        scheduler.submit(k, workload)
    plans = [scheduler.take(k, wait_s=60.0) for k in range(5, 9)]
    scheduler.close()
    assert [p.source for p in plans] == ["per-iteration"] * 4
    assert len(scheduler._by_key) == 2


def _full_search(config, planned, candidate, bubbles, cost, workload, bound_us):
    """``schedule_iteration`` as a plain search: every size's schedule laid out, its encoder work
    built afresh (no ``ChainMoves``); run with ``UnseenMoves``."""
    best = None
    sizes = chain_sizes(workload)
    for size in sizes:
        bound = min(bound_us, best.schedule.iteration_us if best else bound_us)
        schedule, _ = bubble_scheduler(
            config,
            planned.llm_plan,
            candidate,
            bubbles,
            cost,
            bound_us=bound,
            workload=workload,
            images_per_chain=size,
        )
        if schedule is not None and (
            best is None or schedule.iteration_us < best.schedule.iteration_us - EPS_US
        ):
            best = IterationSchedule(schedule, size)
    if best is None and sizes and padded(workload) != workload:
        schedule, _ = bubble_scheduler(
            config, planned.llm_plan, candidate, bubbles, cost, bound_us, workload=padded(workload)
        )
        best = IterationSchedule(schedule, None) if schedule is not None else None
    return best


def test_a_build_is_the_full_searchs_schedule_on_random_draws(job, monkeypatch):
    """The per-iteration build's shortcuts (chains kept across builds, backward moves reused by
    what they see, one size's schedule laid out, the collector paused once) give, on random image
    counts built one after another, the schedule the plain search over the same sizes gives: not
    another, not a slower one. (Without its budget of partitions: see the next test.)"""
    config, planned, cost, candidate, fallback = job
    bubbles = LLMBubbles.of(get_enc_llm_dep(config, planned.llm_plan, cost))
    chains = ChainMoves(config, planned.llm_plan, candidate.plan, bubbles, cost)
    rng = random.Random(52)
    for _ in range(6):
        counts = rng.choices(range(MAX_IMAGES + 1), k=planned.num_microbatches)
        workload = _workload(config, sorted(counts, key=bool))  # in the LLM's order
        fast = schedule_iteration(
            config,
            planned.llm_plan,
            candidate,
            bubbles,
            cost,
            workload,
            fallback.iteration_us,
            chains,
            schedules_at_most=None,
        )
        with monkeypatch.context() as plain:
            plain.setattr(scheduler_module, "PipelineMoves", UnseenMoves)
            full = _full_search(
                config, planned, candidate, bubbles, cost, workload, fallback.iteration_us
            )
        assert (fast is None) == (full is None), counts
        if fast is not None:
            assert fast.images_per_chain == full.images_per_chain, counts
            assert _same_schedule(fast.schedule, full.schedule), counts


def test_an_iterations_search_stops_after_its_budget_of_schedules(job):
    """``schedules_at_most``: the search runs partitions in lower-bound order until that many have
    scheduled and keeps the fastest of those; a budget above what the bound leaves is the full
    search, schedule for schedule; a smaller one never beats it and never searches more."""
    config, planned, cost, candidate, fallback = job
    bubbles = LLMBubbles.of(get_enc_llm_dep(config, planned.llm_plan, cost))
    rng = random.Random(7)
    budgeted = 0
    for _ in range(4):
        counts = rng.choices(range(1, MAX_IMAGES + 1), k=planned.num_microbatches)
        workload = _workload(config, counts)
        search = partial(
            search_workload, config, planned.llm_plan, candidate, bubbles, cost, workload
        )
        full, full_stats = search(fallback.iteration_us)
        whole, _ = search(fallback.iteration_us, schedules_at_most=10**6)
        one, one_stats = search(fallback.iteration_us, schedules_at_most=1)
        assert (full is None) == (whole is None) == (one is None), counts
        if full is None:
            continue
        assert _same_schedule(whole.schedule(), full.schedule()), counts
        assert one.iteration_us >= full.iteration_us - EPS_US, counts
        assert one_stats.partitions_searched <= full_stats.partitions_searched, counts
        assert (
            one_stats.partitions_searched + one_stats.partitions_pruned
            == one_stats.partitions_total
        )
        budgeted += one_stats.partitions_searched < full_stats.partitions_searched
    assert budgeted, "the budget of one schedule cut no search short: the test checks nothing"
