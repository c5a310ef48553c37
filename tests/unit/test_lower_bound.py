"""The partition lower bound: never above what scheduling gives, and what it prunes never held the
best."""

import random

import pytest

from optimus_mllm.config import config_from_dict
from optimus_mllm.costing.cost_model import CostModel
from optimus_mllm.planner import plan
from optimus_mllm.scheduler import bubble_scheduler
from optimus_mllm.scheduler.bubble_scheduler import (
    BWD,
    FWD,
    best_schedule,
    init_schedule,
    optimize_schedule,
)
from optimus_mllm.scheduler.dependencies import get_enc_llm_dep
from optimus_mllm.scheduler.encoder_costs import EncoderKernel, StageChain, build_encoder_work
from optimus_mllm.scheduler.fine import LLMBubbles
from optimus_mllm.scheduler.lower_bound import (
    Lengths,
    PartitionBound,
    stage_demand,
    stage_excess_us,
)

from support.random_configs import heavy_random_config, random_config


def _config(kind: str, seed: int):
    return config_from_dict((heavy_random_config if kind == "heavy" else random_config)(seed))


def test_lengths_total_the_durations_at_least_d():
    rng = random.Random(0)
    durations = [rng.choice([1.0, 2.5, 4.0, 7.0]) for _ in range(40)]
    lengths = Lengths.of(durations)
    for d in (0.0, 1.0, 2.0, 2.5, 4.0, 6.9, 7.0, 7.1):
        assert lengths.at_least(d) == pytest.approx(sum(x for x in durations if x >= d))


def _chain(*durations: float) -> StageChain:
    return StageChain(
        tuple(EncoderKernel("enc", 0, f"k{i}", "fwd", False, d) for i, d in enumerate(durations))
    )


def test_stage_excess_counts_long_kernels_against_long_bubbles_only():
    """Bubbles of 10, 10 and 50 us; two microbatches of forward kernels 20 + 5 us and a backward
    kernel of
    40 us. The 80 us of backward kernels fit only the 50 us bubble: 30 us at least run after the
    LLM. Forward and backward kernels of 20 us or more (120 us) against 50 us of such bubbles: 70 us
    at least run before or after it. All 130 us against the 70 us of bubbles would leave only 60."""
    bubbles = Lengths.of([10.0, 10.0, 50.0])
    demand = stage_demand(
        Lengths.of_compute(_chain(20.0, 5.0)), Lengths.of_compute(_chain(40.0)), bubbles
    )
    assert stage_excess_us(demand, 2) == pytest.approx((0.0, 30.0, 70.0))
    assert stage_excess_us(demand, 1) == pytest.approx((0.0, 0.0, 10.0))


@pytest.mark.parametrize("kind", ["random", "heavy"])
@pytest.mark.parametrize("seed", range(30))
def test_no_partition_schedules_faster_than_its_lower_bound(seed, kind):
    """The bound that skips partitions and plans never exceeds what scheduling the partition gives,
    coarse
    or fine, so pruning by it drops no better schedule."""
    config = _config(kind, seed)
    _bound_holds(config, CostModel.from_config(config))


@pytest.mark.parametrize("kind", ["random", "heavy"])
@pytest.mark.parametrize("seed", range(10))
def test_the_bound_holds_with_a_cpu_profiles_inline_encoder_and_optimizer_step(seed, kind):
    """A CPU profile's cost model: TP collectives' waits are busy and every rank's optimizer step
    follows its reduce-scatters; the bound still never exceeds a schedule."""
    config = _config(kind, seed)
    cost = CostModel(
        config.cluster, config.cost_model, device_kind="cpu", optimizer_us_per_param=1e-4
    )
    _bound_holds(config, cost)


def _bound_holds(config, cost) -> None:
    planned = plan(config)
    bubbles = LLMBubbles.of(get_enc_llm_dep(config, planned.llm_plan, cost))
    for candidate in planned.candidates:
        work = build_encoder_work(config, planned.llm_plan, candidate.plan, cost)
        bound = PartitionBound(work, bubbles.dep, bubbles.lengths)
        for partition in candidate.partitions.partitions:
            coarse = init_schedule(work, bubbles, partition)
            if coarse is None:
                continue
            assert coarse.evaluation.iteration_us >= bound(partition) - 1e-6, (
                candidate.plan,
                partition,
                "coarse",
            )
            fine = optimize_schedule(optimize_schedule(coarse, FWD), BWD)
            assert fine.evaluation.iteration_us >= bound(partition) - 1e-6, (
                candidate.plan,
                partition,
                "fine",
            )


class _NoBound(PartitionBound):
    def __call__(self, partition: tuple[int, ...]) -> float:
        return float("-inf")


def test_pruning_keeps_the_fastest_schedule(monkeypatch):
    """Across random and heavy-encoder configs, Optimus with its bound finds as fast a schedule as
    with every plan's every partition scheduled, while the bound skips some of them."""
    pruned = total = 0
    for kind, seed in [(kind, seed) for kind in ("random", "heavy") for seed in range(0, 30, 2)]:
        config = _config(kind, seed)
        planned = plan(config)
        cost = CostModel.from_config(config)
        bounded = best_schedule(config, planned, cost)
        with monkeypatch.context() as patch:
            patch.setattr(bubble_scheduler, "PartitionBound", _NoBound)
            exhaustive = best_schedule(config, planned, cost)
        assert bounded.best.iteration_us == pytest.approx(exhaustive.best.iteration_us, abs=1e-6), (
            kind,
            seed,
        )
        pruned += sum(o.stats.partitions_pruned for o in bounded.outcomes)
        total += sum(o.stats.partitions_total for o in bounded.outcomes)
    assert pruned > 0, (pruned, total)
