"""Variable encoder work per microbatch (issue 34): the cost model's chains, the bubble scheduler,
the baselines and the config's workload fields."""

from __future__ import annotations

import json
import random

import pytest

from optimus_mllm.config import load_config
from optimus_mllm.costing.cost_model import CostModel
from optimus_mllm.costing.workload import (
    EncoderWorkload,
    WorkloadDistribution,
    draw_iterations,
    heaviest,
)
from optimus_mllm.errors import ConfigError
from optimus_mllm.planner import plan
from optimus_mllm.scheduler.baselines import megatron_lm_balanced_baseline, megatron_lm_baseline
from optimus_mllm.scheduler.bubble_scheduler import best_schedule, bubble_scheduler
from optimus_mllm.scheduler.dependencies import get_enc_llm_dep
from optimus_mllm.scheduler.encoder_costs import build_encoder_work
from optimus_mllm.scheduler.fine import LLMBubbles

from support.paths import CONFIGS
from support.validity import schedule_violations


def _setup(name: str = "fig5_8gpu", overrides: tuple[str, ...] = ()):
    config = load_config(CONFIGS / "paper" / f"{name}.yaml", overrides)
    planned = plan(config)
    cost = CostModel.from_config(config)
    chosen = best_schedule(config, planned, cost).best
    candidate = next(c for c in planned.candidates if c.plan == chosen.encoder_plan)
    bubbles = LLMBubbles.of(get_enc_llm_dep(config, planned.llm_plan, cost))
    return config, planned, cost, chosen, candidate, bubbles


@pytest.fixture(scope="module")
def fig5():
    return _setup()


def _images(config, counts, tokens=None):
    return tuple(EncoderWorkload.of_images(config, n, tokens) for n in counts)


def test_a_chain_grows_with_the_images_and_their_tokens_and_is_empty_without_one(fig5):
    config, planned, cost, chosen, _, _ = fig5
    enc_plan = chosen.encoder_plan

    def duration(workload):
        work = build_encoder_work(config, planned.llm_plan, enc_plan, cost, workload)
        return sum(c.duration_us for c in work.fwd + work.bwd)

    seq = config.encoders[0].seq_length
    one, two = (EncoderWorkload.of_images(config, n) for n in (1, 2))
    assert duration(None) == duration(EncoderWorkload.constant(config)) == duration(one)
    # twice the tokens in the same kernels: more time, less than twice (launches, rooflines)
    assert duration(one) < duration(two) < 2 * duration(one)
    assert duration(EncoderWorkload.of_images(config, 1, seq // 4)) < duration(one)
    empty = build_encoder_work(config, planned.llm_plan, enc_plan, cost, _images(config, [0])[0])
    assert not any(c.kernels for c in empty.fwd + empty.bwd)
    assert empty.to_llm_us == (0.0,) * len(empty.to_llm_us)


@pytest.mark.parametrize("name", ["fig5_8gpu", "model_a"])
def test_the_constant_workload_gives_todays_schedule(name):
    config, planned, cost, chosen, candidate, bubbles = _setup(name)
    constant = (EncoderWorkload.constant(config),) * planned.num_microbatches
    schedule, _ = bubble_scheduler(
        config, planned.llm_plan, candidate, bubbles, cost, workload=constant
    )
    assert schedule.iteration_us == chosen.iteration_us
    assert schedule.chains == chosen.chains
    assert schedule.assignment == chosen.assignment
    assert schedule.feeds == tuple(range(planned.num_microbatches))


def test_imageless_microbatches_run_first_and_the_llm_waits_on_no_encoder_for_them(fig5):
    config, planned, cost, chosen, candidate, bubbles = fig5
    n = planned.num_microbatches
    imageless = 6
    workload = _images(config, [0] * imageless + [1] * (n - imageless))
    schedule, _ = bubble_scheduler(
        config, planned.llm_plan, candidate, bubbles, cost, workload=workload
    )
    assert schedule_violations(schedule) == []
    assert schedule.feeds == tuple(range(imageless, n))
    assert len(schedule.assignment) == sum(schedule.partition) == n - imageless
    # the encoder meets the dependency points of LLM microbatches 6.. only
    assert schedule.dep.forward == bubbles.dep.forward[imageless:]
    # fewer encoder microbatches, looser deadlines: never slower than every microbatch with one
    assert schedule.iteration_us < chosen.iteration_us


def test_a_mixed_iteration_is_scheduled_for_its_heaviest_microbatch():
    config, planned, cost, _, candidate, bubbles = _setup(
        "fig5_8gpu", ("data.max_images_per_microbatch=4",)
    )
    n = planned.num_microbatches
    mixed = _images(config, [0] * 2 + [1, 2, 3] * ((n - 2) // 3) + [4] * ((n - 2) % 3))
    heavy = _images(config, [0] * 2 + [4] * (n - 2))
    run = [
        bubble_scheduler(config, planned.llm_plan, candidate, bubbles, cost, workload=w)[0]
        for w in (mixed, heavy)
    ]
    assert heaviest(mixed[2:]) == EncoderWorkload.of_images(config, 4)
    assert schedule_violations(run[0]) == []
    assert run[0].iteration_us == run[1].iteration_us
    # at most 2 images per encoder microbatch: a microbatch of 3 or 4 feeds its LLM microbatch
    # twice, each of those encoder microbatches meeting that LLM microbatch's dependency points
    halves, _ = bubble_scheduler(
        config, planned.llm_plan, candidate, bubbles, cost, workload=mixed, images_per_chain=2
    )
    assert schedule_violations(halves) == []
    expected = [i for i, w in enumerate(mixed) for _ in range(-(-w.images // 2))]
    assert halves.feeds == tuple(expected)
    assert halves.dep.forward == tuple(bubbles.dep.forward[i] for i in expected)
    assert sum(halves.partition) == len(expected) > n - 2
    assert halves.work.fwd[0].duration_us < run[0].work.fwd[0].duration_us
    with pytest.raises(ValueError, match="imageless microbatches first"):
        bubble_scheduler(config, planned.llm_plan, candidate, bubbles, cost, workload=mixed[::-1])


def test_baselines_run_each_microbatchs_own_encoder_work(fig5):
    config, planned, cost, *_ = fig5
    llm_plan, n = planned.llm_plan, planned.num_microbatches
    today = megatron_lm_baseline(config, llm_plan, cost).iteration_us
    constant = (EncoderWorkload.constant(config),) * n
    assert megatron_lm_baseline(config, llm_plan, cost, constant).iteration_us == pytest.approx(
        today, rel=1e-12
    )
    light = _images(config, [0] * (n // 2) + [1] * (n - n // 2))
    heavy = _images(config, [4] * n)
    times = [megatron_lm_baseline(config, llm_plan, cost, w).iteration_us for w in (light, heavy)]
    assert times[0] < today < times[1]
    balanced_today = megatron_lm_balanced_baseline(config, llm_plan, cost).iteration_us
    balanced = megatron_lm_balanced_baseline(config, llm_plan, cost, workload=constant).iteration_us
    assert balanced == pytest.approx(balanced_today, rel=1e-12)
    # the split made for 4 images, run with half the microbatches imageless: faster than full
    split = EncoderWorkload.of_images(config, 4)
    half = megatron_lm_balanced_baseline(config, llm_plan, cost, workload=light, split_for=split)
    full = megatron_lm_balanced_baseline(config, llm_plan, cost, workload=heavy, split_for=split)
    assert half.iteration_us < full.iteration_us


DISTRIBUTION = (
    "data.max_images_per_microbatch=8",
    "data.images_per_sample={0: 0.25, 1: 0.4, 2: 0.2, 4: 0.1, 8: 0.05}",
)


def test_iterations_are_drawn_from_the_distribution_by_seed():
    config = load_config(CONFIGS / "paper" / "fig5_8gpu.yaml", DISTRIBUTION)
    distribution = WorkloadDistribution.of_config(config)
    drawn = draw_iterations(config, distribution, 50, 16, seed=3)
    assert drawn == draw_iterations(config, distribution, 50, 16, seed=3)
    assert drawn != draw_iterations(config, distribution, 50, 16, seed=4)
    counts = [w.images for it in drawn for w in it]
    assert set(counts) <= {0, 1, 2, 4, 8}
    assert 0.15 < counts.count(0) / len(counts) < 0.35
    assert distribution.maximum(config) == EncoderWorkload.of_images(config, 8)
    # 1.6 images per sample, rounded
    assert distribution.mean(config) == EncoderWorkload.of_images(config, 2)
    assert all(distribution.maximum(config).covers(w) for it in drawn for w in it)
    rng = random.Random(0)
    capped = WorkloadDistribution(((8, 1.0),), None, 4)
    assert capped.draw_microbatch(config, rng).images == 4


@pytest.mark.parametrize(
    "overrides, field",
    [
        (
            ("data.images_per_sample={0: 0.5, 1: 0.6}", "data.max_images_per_microbatch=2"),
            "data.images_per_sample: weights sum to 1.1",
        ),
        (("data.images_per_sample={0: 0.5, 1: 0.5}",), "data.max_images_per_microbatch: is needed"),
        (("data.max_images_per_microbatch=0",), "data.max_images_per_microbatch: must be positive"),
        (
            ("training.schedule_per_iteration=true",),
            "data.max_images_per_microbatch: is needed with training.schedule_per_iteration",
        ),
        (
            ("data.tokens_per_image={256: 1.0}",),
            "data.tokens_per_image: needs data.images_per_sample",
        ),
        (
            (*DISTRIBUTION, "data.tokens_per_image={100000: 1.0}"),
            "data.tokens_per_image[100000]: must be at most the encoder's seq_length",
        ),
        (
            ("data.images_per_sample={-1: 1.0}", "data.max_images_per_microbatch=2"),
            "data.images_per_sample[-1]: keys must be integers >= 0",
        ),
    ],
)
def test_bad_workload_fields_name_the_field(overrides, field):
    with pytest.raises(ConfigError) as error:
        load_config(CONFIGS / "paper" / "fig5_8gpu.yaml", overrides)
    assert str(error.value).startswith(field)
    assert "\n" not in str(error.value)


def test_optimus_plan_ranks_plans_by_expected_time_over_the_distribution(tmp_path, capsys):
    from optimus_mllm.cli.plan import main
    from optimus_mllm.scheduler.artifact import load_artifact

    out, artifact = tmp_path / "plan.json", tmp_path / "schedule.json"
    args = ["--config", str(CONFIGS / "paper" / "fig5_8gpu.yaml"), "--json", str(out)]
    args += ["--artifact", str(artifact)]
    for override in DISTRIBUTION:
        args += ["--override", override]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert (
        "ranked by expected iteration time over 8 iterations drawn from it (seed 1234)" in printed
    )
    expected = json.loads(out.read_text())["expected"]
    times = [row["expected_iteration_us"] for row in expected["ranked"]]
    assert times == sorted(times) and len(times) == 6
    # a lighter iteration than the maximum is never slower than the maximum's schedule
    assert all(r["expected_iteration_us"] <= r["fallback_iteration_us"] for r in expected["ranked"])
    best = expected["ranked"][0]
    assert load_artifact(artifact).encoder_plan.as_dict() == best["encoder_plan"]
    assert f"chosen for the distribution: encoder {_plan_text(best['encoder_plan'])};" in printed


def _plan_text(plan: dict) -> str:
    return f"DP{plan['dp']} PP{plan['pp']} TP{plan['tp']}"
