"""tests/support/check_plans.py: a few seeds of the randomized plan-equivalence check, and the check
failing.

The seeds are chosen so that together they cover an LLM PP4 job with the scheduler's adjusted
warm-up (seed 44, two encoders, the first with CLIP's embedding), a frozen encoder split over 4
encoder stages with a forced warm-up and SiLU MLPs (seed 37, which found stages without a backward
never finishing), a PP2 V1 job whose 5 microbatches are not a multiple of PP (seed 179), encoder
kernels run in random pieces of their tokens (seed 401, DP2 PP4 with an adjusted warm-up, and seed
179), and backward moves the scheduler stopped above a stage (seed 24). test_runtime.py forces
reduced warm-ups too. Each test first asserts that its seed still draws what it is here for.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from optimus_mllm.scheduler.artifact_format import ScheduleArtifact

from support.check_plans import (
    Row,
    check_seed,
    compare,
    draw_job,
    main,
    run_optimus,
    run_reference,
    schedule_job,
    summary,
)

pytestmark = pytest.mark.distributed

STEPS = 2
TIMEOUT = 240.0


@pytest.mark.parametrize(
    "seed, expected",
    [
        (44, {"pp": 4, "vp": 2, "warmup_kind": "adjusted", "encoders": "dual+clip"}),
        # a frozen encoder over 4 encoder stages: only the last (projector) stage runs a backward
        (37, {"pp": 4, "vp": 3, "warmup_kind": "forced", "encoders": "single+frozen"}),
        (401, {"dp": 2, "pp": 4, "warmup_kind": "adjusted", "cut_kernels": True}),
        # the scheduler's backward moves stopped above a stage: upper stages in bubbles, the rest
        # after the LLM
        (24, {"pp": 4, "split_backward": True}),
    ],
    ids=[
        "PP4-adjusted-dual",
        "PP4-V3-frozen-encoder-PP4",
        "DP2-PP4-kernels-in-pieces",
        "PP4-backward-split",
    ],
)
def test_seed_trains_like_one_rank(seed, expected):
    job = draw_job(seed)
    setup = schedule_job(job)
    drawn = {
        **{k: getattr(job, k) for k in ("dp", "pp", "vp", "encoders", "cut_kernels")},
        "warmup_kind": setup.warmup_kind,
        "split_backward": _split_backward(setup.artifact),
    }
    assert drawn.items() >= expected.items(), f"seed {seed} no longer draws {expected}: {drawn}"
    row = check_seed(seed, STEPS, TIMEOUT)
    assert row.status == "PASS", row


def _split_backward(artifact: ScheduleArtifact) -> bool:
    """Some microbatch's backward runs partly in the LLM's bubbles and partly after the LLM."""
    windows: dict[tuple[int, int], set[str]] = {}
    for stage in artifact.encoder_stages:
        for op in stage.ops:
            if op.phase == "bwd":
                windows.setdefault((stage.encoder_pipeline, op.local_microbatch), set()).add(
                    op.window
                )
    return any(len(w) > 1 for w in windows.values())


@pytest.mark.parametrize(
    "seed, expected",
    [
        # a tied embedding on pipeline rank 0's second chunk, its output copy on rank 1, DP2: the
        # copies' DP shards must line up (seed 47 found them summed unaligned)
        (47, {"dp": 2, "pp": 2, "vp": 3, "llm": "tied"}),
        # the whole LLM, embedding and output layer, in one chunk of the last pipeline rank (seed 39
        # found a group of one rank twice)
        (39, {"dp": 2, "pp": 2, "vp": 1, "llm": "tied+rope"}),
    ],
    ids=["DP2-V3-tied", "DP2-TP2-tied-one-chunk"],
)
def test_balanced_seed_trains_like_one_rank(seed, expected):
    job = draw_job(seed)
    drawn = {k: getattr(job, k) for k in ("dp", "pp", "vp", "llm")}
    assert drawn.items() >= expected.items(), f"seed {seed} no longer draws {expected}: {drawn}"
    row = check_seed(seed, STEPS, TIMEOUT, "balanced")
    assert row.status == "PASS", row
    assert row.encoder_plan == "balanced"


def test_a_job_the_balanced_baseline_cannot_run_is_skipped_with_the_reason():
    row = check_seed(44, STEPS, TIMEOUT, "balanced")
    assert (row.status, row.note) == (
        "SKIP",
        "the balanced baseline splits one encoder's layers with the LLM's; give a single encoder",
    )


@pytest.fixture(scope="module")
def non_multiple_run():
    """Seed 179's job, its Optimus ranks and its one-rank reference."""
    job = draw_job(179)
    assert (job.pp, job.vp, job.num_microbatches % job.pp, job.cut_kernels) == (2, 1, 1, True), job
    return job, run_optimus(schedule_job(job), STEPS, TIMEOUT), run_reference(job, STEPS, TIMEOUT)


def test_microbatches_not_a_multiple_of_pp(non_multiple_run):
    _, ranks, reference = non_multiple_run
    diffs = compare(ranks, reference)
    assert diffs.passed, diffs
    assert any(rank["p2p"] for rank in ranks), "the PP2 job's pipeline P2P was not recorded"


def test_a_p2p_call_nccl_would_mismatch_fails_the_seed(non_multiple_run):
    """Right numbers are not enough: a tagged send on the default group fails the comparison."""
    _, ranks, reference = non_multiple_run
    damaged = [dict(rank) for rank in ranks]
    damaged[0]["p2p"] = [*ranks[0]["p2p"], ("isend", "default", 0, 1, (2,), "torch.float32", 7)]
    diffs = compare(damaged, reference)
    assert not diffs.passed and "NCCL would mismatch" in diffs.problem, diffs


def test_a_wrong_run_fails(non_multiple_run):
    """Against a reference trained from another seed (other weights and data) the check fails."""
    job, ranks, _ = non_multiple_run
    other = run_reference(replace(job, model=(*job.model, "training.seed=99991")), STEPS, TIMEOUT)
    diffs = compare(ranks, other)
    assert not diffs.passed and diffs.problem is None
    assert min(diffs.loss, diffs.grad, diffs.weight) > 1e-3, diffs


def _one_rank(norm: float, gradient: float) -> dict:
    return {
        "losses": [5.5],
        "norms": [norm],
        "tensors": {"w": (np.ones(3), np.full(3, gradient))},
        "p2p": [],
    }


def test_the_gradient_norm_is_compared_relative_to_its_size():
    """A norm of 26.8 off by 1.0e-5 (fp32 sums in another order: seed 13) passes; off by 1e-3 it
    fails, and so does a single gradient off by 2e-5."""
    reference = _one_rank(26.81378953, 0.5)
    assert compare([_one_rank(26.81378953 + 1.02e-5, 0.5)], reference).passed
    assert not compare([_one_rank(26.81378953 + 1e-3, 0.5)], reference).passed
    assert not compare([_one_rank(26.81378953, 0.5 + 2e-5)], reference).passed
    assert not compare([_one_rank(0.5 + 2e-5, 0.5)], _one_rank(0.5, 0.5)).passed


def test_summary_line():
    rows = [
        Row(
            0,
            1,
            "1/1/1/1",
            "1/1/1",
            1,
            1,
            "single",
            "-",
            "0",
            "adjusted",
            0.0,
            0.0,
            0.0,
            1.0,
            "PASS",
            "",
        ),
        Row(
            1,
            2,
            "1/2/1/1",
            "2/1/1",
            2,
            1,
            "dual",
            "sp",
            "1,0",
            "forced",
            None,
            None,
            None,
            9.0,
            "HANG",
            "",
        ),
    ]
    lines = summary(rows)
    assert lines[0] == "1 passed, 1 failed"
    assert "1 adjusted" in lines[1] and "0 forced" in lines[1]
    skipped = replace(rows[1], status="SKIP")
    assert summary([rows[0], skipped])[0] == "1 passed, 0 failed, 1 skipped"


@pytest.mark.parametrize(
    "argv", [[], ["--seeds", "0"], ["--seeds", "2", "--timeout", "0"], ["--seeds", "x"]]
)
def test_bad_arguments_exit_2_with_one_line(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("check_plans: error:") and "\n" not in err
