"""``python -m optimus_mllm.train`` under torchrun on 4 CPU processes, and its errors on every rank.

The Optimus runs (scheduled in the job, or from an ``optimus-plan --artifact`` file) print the same
losses as the Megatron-style baseline; a bad job makes every rank exit 2, with one error line from
rank 0 and no traceback, instead of hanging.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from support.paths import balanced_wins
from support.train_utils import (
    STEP,
    SUMMARY,
    TINY,
    assert_one_error_everywhere,
    ranks,
    step_losses,
    torchrun,
)

pytestmark = pytest.mark.distributed


def _torchrun(*args: str, interpreters: bool = False) -> list[str]:
    """Train 3 steps on 4 processes: 3 step lines and the summary."""
    lines = torchrun(*args, interpreters=interpreters)
    assert len(lines) == 4, lines
    assert [STEP.match(line).group(1) for line in lines[:3]] == ["1", "2", "3"], lines
    assert SUMMARY.match(lines[3]).group(2) == STEP.match(lines[2]).group(3)
    return lines


def _losses(lines: list[str]) -> list[str]:
    return list(step_losses(lines).values())


@pytest.fixture(scope="module")
def baseline() -> list[str]:
    # torchrun itself, as the README runs it; the module's other runs fork their ranks
    lines = _torchrun("--baseline", interpreters=True)
    assert all(STEP.match(line).group(4) == "baseline" for line in lines[:3])
    return lines


def _bubble_shares(lines: list[str]) -> list[float]:
    shares = [
        re.fullmatch(
            r"encoder ops inside LLM span ([\d.]+)% \| ops moved from their hook 0",
            STEP.match(line).group(4),
        )
        for line in lines[:3]
    ]
    return [float(s.group(1)) for s in shares]


def test_scheduled_in_the_job_trains_like_the_baseline_and_logs_its_step_lines(baseline, tmp_path):
    """Also the TensorBoard scalars: one launch for both (CI time)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    lines = _torchrun("--tensorboard-dir", str(tmp_path))
    assert _losses(lines) == _losses(baseline)
    assert all(0 < share <= 100 for share in _bubble_shares(lines))
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert {
        "lm loss",
        "step time (ms)",
        "tokens per second",
        "encoder ops inside LLM span (%)",
    } <= set(events.Tags()["scalars"])
    logged = {e.step: f"{e.value:.4f}" for e in events.Scalars("lm loss")}
    assert logged == step_losses(lines)


def _write_artifact(path: Path, *overrides: str) -> None:
    from optimus_mllm.cli.plan import main as optimus_plan

    args = ["--config", TINY, "--artifact", str(path)] + [f"--override={o}" for o in overrides]
    assert optimus_plan(args) == 0


def test_schedule_artifact_trains_like_the_baseline(baseline, tmp_path):
    artifact = tmp_path / "schedule.json"
    _write_artifact(artifact, "parallel.encoder={pp: 2, tp: 1}")
    lines = _torchrun("--schedule", str(artifact), "--override", "parallel.encoder={pp: 2, tp: 1}")
    assert _losses(lines) == _losses(baseline)


def test_wrong_world_size_exits_2_on_every_rank():
    assert_one_error_everywhere(ranks(2), "2 processes but cluster.num_gpus=4")


def test_artifact_for_another_plan_exits_2_on_every_rank(tmp_path):
    artifact = tmp_path / "schedule.json"
    _write_artifact(artifact, "parallel.llm={dp: 1, pp: 4, tp: 1, vp: 1}")
    assert_one_error_everywhere(ranks(4, "--schedule", str(artifact)), "re-run optimus-plan")


def test_encoder_plan_not_dividing_the_llm_plan_exits_2_on_every_rank():
    assert_one_error_everywhere(
        ranks(4, "--override", "parallel.encoder={pp: 1, tp: 4}"),
        "parallel.encoder.tp: 4 does not divide the LLM's tp=2",
    )


def test_missing_dataset_exits_2_on_every_rank(tmp_path):
    # fresh interpreters, as torchrun starts them: nothing the imports print reaches stderr either
    missing = tmp_path / "no-such-data"
    assert_one_error_everywhere(
        ranks(4, "--override", f"data.path={missing}", interpreters=True),
        f"data.path: {missing} does not",
    )


@pytest.fixture(scope="module")
def sample_dataset(tmp_path_factory) -> Path:
    from support.paths import REPO

    out = tmp_path_factory.mktemp("data") / "sample"
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "make_sample_dataset.py"),
            "--format",
            "captions",
            "--out",
            str(out),
            "--num-samples",
            "40",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return out


def test_dataset_trains_the_same_under_both_runtimes(sample_dataset, baseline):
    """Every rank reads the same samples: the Optimus runtime and the baseline print the same
    losses."""
    data = f"data.path={sample_dataset}"
    optimus_lines = _torchrun("--override", data)
    assert _losses(optimus_lines) == _losses(_torchrun("--override", data, "--baseline"))
    assert _losses(optimus_lines) != _losses(baseline)  # not the synthetic data


def test_tensorboard_dir_without_tensorboard_is_a_one_line_error(monkeypatch):
    import importlib.util

    from optimus_mllm.errors import OptimusError
    from optimus_mllm.train import build_parser, prepare

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "tensorboard" else real(name, *a),
    )
    args = build_parser().parse_args(["--config", TINY, "--tensorboard-dir", "tb"])
    with pytest.raises(
        OptimusError, match=r"^--tensorboard-dir needs the tensorboard package; pip install"
    ):
        prepare(args, 4)


def test_the_balanced_baseline_trains_like_the_baseline(baseline):
    """--baseline balanced: encoder and LLM layers split together over the virtual stages, same
    losses."""
    lines = _torchrun("--baseline", "balanced")
    assert all(STEP.match(line).group(4) == "balanced baseline" for line in lines[:3])
    assert _losses(lines) == _losses(baseline)


_VIT = (
    "num_layers: 2, hidden_size: 32, num_attention_heads: 4, ffn_hidden_size: 64, seq_length: 16, "
    "patch_size: 4"
)


def test_a_baseline_faster_than_every_optimus_schedule_is_what_the_job_trains(tmp_path):
    """The scheduler's result is the best of its schedules and the baseline placements: here the
    balanced
    baseline, which optimus-train then runs (and says so), with the Megatron-style baseline's
    losses."""
    config = balanced_wins(tmp_path)
    lines = torchrun("--config", str(config), nproc=2)
    assert lines[0].startswith(
        "the Megatron-LM balanced baseline (0.0011 s per iteration predicted) is no slower than "
        "every Optimus schedule within the step noise of 0.0% (best 0.0011 s): running it, as "
        "--baseline balanced would"
    ), lines
    assert [STEP.match(line).group(4) for line in lines[1:3]] == ["balanced baseline"] * 2
    assert step_losses(lines) == step_losses(
        torchrun("--config", str(config), "--baseline", nproc=2)
    )


TWO_ENCODERS = f"model.encoders=[{{name: a, {_VIT}}}, {{name: b, {_VIT}}}]"


@pytest.mark.parametrize(
    "flags, error",
    [
        (
            [
                "--override",
                "model.llm.untie_embeddings_and_output_weights=false",
                "model.encoders.0.num_layers=1",
            ],
            r"^--baseline balanced: the balanced split puts the tied word embedding \(virtual "
            r"stage 1\) and the output "
            r"layer \(virtual stage 3\) in two chunks of pipeline rank 1, whose copies this "
            r"runtime does not sync; set "
            r"model.llm.untie_embeddings_and_output_weights: true or another parallel.llm$",
        ),
        (
            ["--override", TWO_ENCODERS],
            r"^--baseline balanced: the balanced baseline splits one encoder's layers",
        ),
    ],
)
def test_what_the_balanced_baseline_cannot_run_is_refused_before_training(flags, error):
    from optimus_mllm.errors import OptimusError
    from optimus_mllm.train import build_parser, prepare

    args = build_parser().parse_args(["--config", TINY, "--baseline", "balanced", *flags])
    with pytest.raises(OptimusError, match=error):
        prepare(args, 4)


ODD_TOKENS = (
    "training.sequence_parallel=true",
    "model.encoders=[{name: vit, num_layers: 2, hidden_size: 32, "
    "num_attention_heads: 4, ffn_hidden_size: 64, seq_length: 9, patch_size: 4, in_channels: 3}]",
)


def test_an_encoder_the_llms_tp_cannot_split_is_refused_for_the_baseline_only():
    """9 image tokens under sequence parallelism: the encoder cannot run at the LLM's TP 2, which
    the Megatron-style baseline needs; Optimus plans it at TP 1."""
    from optimus_mllm.config import load_config
    from optimus_mllm.errors import OptimusError
    from optimus_mllm.planner import plan
    from optimus_mllm.train import build_parser, prepare

    args = build_parser().parse_args(["--config", TINY, "--baseline", "--override", *ODD_TOKENS])
    with pytest.raises(
        OptimusError,
        match=r"^--baseline runs model.encoders\[0\] at the LLM's tp=2, but its "
        r"seq_length=9 is not divisible by tp=2",
    ):
        prepare(args, 4)
    job = prepare(build_parser().parse_args(["--config", TINY, "--override", *ODD_TOKENS]), 4)
    assert job.artifact.encoder_plan.tp == 1
    pruned = plan(load_config(TINY, list(ODD_TOKENS))).pruned
    assert {p.plan.tp for p in pruned if "seq_length=9 is not divisible by tp=2" in p.reason} == {2}


def test_moved_ops_on_the_step_line_say_why():
    """Issue 39: "ops moved from their hook" above 0 is a warning naming each cause."""
    from optimus_mllm.train import _StepTotals

    assert _StepTotals(5.5, 10, 20, 0, 0, 0).moved_text() == "ops moved from their hook 0"
    text = _StepTotals(5.5, 10, 20, 7, 4, 3).moved_text()
    assert text.startswith("ops moved from their hook 7 (warning: 4 to before/after the LLM, as ")
    assert "would have waited in a cycle" in text
    assert "3 to their LLM op's end, as a TP collective the schedule planned there did not run" in (
        text
    )
