"""Megatron-LM's own ``pretrain_vlm.py`` trained on gloo ranks through the CPU patches for
``megatron.training`` (``megatron_patches.cpu.training``, ``optimus_mllm.megatron.cpu``),
unmodified and with the one-line opt-in (``optimus_mllm.megatron.pretrain``).

The tests that run Megatron-LM need a checkout at tag ``core_v0.16.1`` named by
``MEGATRON_LM_DIR`` and are skipped without; the rest need none.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from optimus_mllm.megatron import entry as megatron
from optimus_mllm.megatron import lm as megatron_lm

from support.paths import REPO, load_script

_compare = load_script("megatron_lm_compare")
TINY_VLM_ARGS, Run = _compare.TINY_VLM_ARGS, _compare.Run
megatron_lm_dir, run_megatron_script = _compare.megatron_lm_dir, _compare.run_megatron_script
with_one_line = _compare.with_one_line

CHECKOUT = megatron_lm_dir()
needs_megatron_lm = pytest.mark.skipif(
    CHECKOUT is None, reason="MEGATRON_LM_DIR (a Megatron-LM checkout at core_v0.16.1) is unset"
)


def _train(
    nproc: int,
    tp: int,
    pp: int,
    script: Path | None = None,
    more: tuple[str, ...] = (),
    iterations: tuple[int, ...] = (1, 2, 3),
) -> Run:
    assert CHECKOUT is not None
    parallel = ("--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp))
    script = CHECKOUT / "pretrain_vlm.py" if script is None else script
    run = run_megatron_script(script, nproc, [*TINY_VLM_ARGS, *parallel, *more])
    assert run.returncode == 0, run.output[-4000:]
    assert tuple(iteration.number for iteration in run.iterations) == iterations, run.output[-4000:]
    return run


@pytest.fixture(scope="module")
def plain_tp2_pp2() -> Run:
    """The unmodified script, 4 ranks at TP2 PP2."""
    return _train(4, tp=2, pp=2)


@pytest.mark.distributed
@needs_megatron_lm
def test_pretrain_vlm_tp2_pp2_trains_as_tp1_pp2(plain_tp2_pp2: Run) -> None:
    # Megatron seeds each pipeline stage apart (seed + 100 * pp rank), so only runs with the same
    # PP draw the same weights; --use-cpu-initialization makes them independent of TP. Megatron
    # prints the loss to 7 digits and the grad norm to 3 decimals.
    tp2 = plain_tp2_pp2
    tp1 = _train(2, tp=1, pp=2)
    for sharded, whole in zip(tp2.iterations, tp1.iterations):
        assert math.isfinite(sharded.lm_loss) and math.isfinite(sharded.grad_norm)
        assert sharded.lm_loss == pytest.approx(whole.lm_loss, rel=1e-5), (sharded, whole)
        assert sharded.grad_norm == pytest.approx(whole.grad_norm, abs=2e-3), (sharded, whole)
    # the model trains: three different losses, not one printed thrice
    assert len({iteration.lm_loss for iteration in tp2.iterations}) == 3


_RESTORE_CHECK = """
import sys
import megatron.core
import megatron.core.tensor_parallel as tensor_parallel
import megatron.training.initialize as initialize
import megatron.training.training as training
import megatron_patches
import megatron_patches.cpu.training as training_cpu

watched = [(training, "initialize_megatron"), (training, "get_model"), (training, "torch"),
           (initialize, "_warmup_jit_function"), (tensor_parallel, "broadcast_data")]
before = [getattr(owner, name) for owner, name in watched]
training_cpu.apply()
assert megatron_patches.is_applied()
assert all(getattr(o, n) is not b for (o, n), b in zip(watched, before))
training_cpu.remove()
assert not megatron_patches.is_applied() and not training_cpu.is_applied()
assert all(getattr(o, n) is b for (o, n), b in zip(watched, before))
print("restored")
"""


@pytest.mark.distributed
@needs_megatron_lm
def test_the_one_line_opt_in_trains_as_the_unmodified_script(
    plain_tp2_pp2: Run, tmp_path: Path
) -> None:
    assert CHECKOUT is not None
    opted_in = _train(4, tp=2, pp=2, script=with_one_line(CHECKOUT, tmp_path))
    printed = [(i.lm_loss, i.grad_norm) for i in plain_tp2_pp2.iterations]
    assert [(i.lm_loss, i.grad_norm) for i in opted_in.iterations] == printed


@pytest.mark.distributed
@needs_megatron_lm
def test_save_at_2_resumes_to_3_with_the_uninterrupted_numbers_and_evaluates(
    plain_tp2_pp2: Run, tmp_path: Path
) -> None:
    # Megatron's own --save/--load (torch format, as pretrain_vlm.py requires) and evaluation,
    # through the checkpointing and evaluate patches
    save = ("--save", str(tmp_path), "--save-interval", "2", "--exit-interval", "2")
    evaluation = ("--eval-interval", "2", "--eval-iters", "1")
    first = _train(4, tp=2, pp=2, more=(*save, *evaluation), iterations=(1, 2))
    validation = re.findall(
        r"validation loss at iteration 2 \| lm loss value: ([0-9.E+-]+)", first.output
    )
    assert len(validation) == 1 and math.isfinite(float(validation[0])), first.output[-3000:]
    resumed = _train(4, tp=2, pp=2, more=("--load", str(tmp_path)), iterations=(3,))
    printed = [(i.lm_loss, i.grad_norm) for i in plain_tp2_pp2.iterations]
    assert [(i.lm_loss, i.grad_norm) for i in first.iterations] == printed[:2]
    assert [(i.lm_loss, i.grad_norm) for i in resumed.iterations] == printed[2:]


@pytest.mark.distributed
@needs_megatron_lm
def test_the_distributed_optimizer_resumes_at_4_with_the_uninterrupted_numbers(
    tmp_path: Path,
) -> None:
    # --use-distributed-optimizer at DP2 (TP1 PP2), fp32: megatron-core's load of the optimizer's
    # distrib_optim.pt fails without megatron_patches.optimizer.dp_zero_load_patches, and without
    # the step tensors it unshares iteration 6 differs. One run of 6 iterations saves at 4 (and at
    # 6, as Megatron-LM saves at the end): the tracker pointed back at 4, it is resumed to 6.
    layout = ("--use-distributed-optimizer", "--train-iters", "6")
    save = ("--save", str(tmp_path), "--save-interval", "4")
    uninterrupted = _train(4, tp=1, pp=2, more=(*layout, *save), iterations=(1, 2, 3, 4, 5, 6))
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("4")
    resumed = _train(4, tp=1, pp=2, more=(*layout, "--load", str(tmp_path)), iterations=(5, 6))
    fifth, sixth = uninterrupted.iterations[4:]
    assert resumed.iterations[0].lm_loss == pytest.approx(fifth.lm_loss, rel=1e-5), resumed
    assert [i.grad_norm for i in resumed.iterations] == [fifth.grad_norm, sixth.grad_norm]
    # Megatron-LM logs a job's first iteration without resetting its loss sums
    # (training_log's should_reset), so the resumed job's second line is the mean of 5 and 6
    mean = (fifth.lm_loss + sixth.lm_loss) / 2
    assert resumed.iterations[1].lm_loss == pytest.approx(mean, rel=1e-5), (resumed, mean)


def _one_process(script: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``script`` through the CPU launcher, one process without torchrun."""
    environment = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "optimus_mllm.megatron.cpu", str(script), *args],
        cwd=REPO,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.distributed
@needs_megatron_lm
def test_the_flag_reaches_only_the_opted_in_script(tmp_path: Path) -> None:
    # the opted-in script's parser has --optimus-schedule (a schedule file that is not there is one
    # line); the unmodified script's Megatron parser does not know it
    assert CHECKOUT is not None
    flag = ("--optimus-schedule", str(tmp_path / "missing.json"))
    opted_in = _one_process(with_one_line(CHECKOUT, tmp_path), *TINY_VLM_ARGS, *flag)
    assert opted_in.returncode == 2, opted_in.stderr[-3000:]
    last = opted_in.stderr.strip().splitlines()[-1]
    assert last.startswith("pretrain_vlm.py: error: ") and "missing.json" in last, last
    unmodified = _one_process(CHECKOUT / "pretrain_vlm.py", *TINY_VLM_ARGS, *flag)
    assert unmodified.returncode == 2
    assert "unrecognized arguments: --optimus-schedule" in unmodified.stderr


@pytest.mark.distributed
@needs_megatron_lm
def test_a_profile_of_another_device_is_refused_before_megatron_starts(tmp_path: Path) -> None:
    # a GPU's profile for a CPU job: one line, exit 2, before the ranks connect
    assert CHECKOUT is not None
    gpu = REPO / "profiles" / "h100_strong.json"
    flags = ("--optimus-schedule", "auto", "--optimus-profile", str(gpu))
    refused = _one_process(with_one_line(CHECKOUT, tmp_path), *TINY_VLM_ARGS, *flags)
    assert refused.returncode == 2, refused.stderr[-3000:]
    last = refused.stderr.strip().splitlines()[-1]
    assert last == (
        f"pretrain_vlm.py: error: --optimus-profile: {gpu} was measured on a cuda device, this "
        "job runs on cpu; profile this machine with optimus-profile, or drop --optimus-profile"
    ), last


def test_the_readme_s_one_line_is_the_one_the_comparison_applies() -> None:
    # the diff for pretrain_vlm.py in docs/megatron-lm.md, and its copy in the README, is the edit
    # megatron_lm_compare.with_one_line makes
    for page, heading in [
        ("docs/megatron-lm.md", "## One flag on an existing Megatron job"),
        ("README.md", "### 2. One flag in an existing Megatron-LM job"),
    ]:
        section = (REPO / page).read_text().split(heading, 1)[1]
        block = section.split("```diff\n", 1)[1].split("```", 1)[0]
        assert block == f" {_compare._LAST_IMPORT}+{_compare.ONE_LINE}\n", page


def test_the_script_s_extra_args_come_after_the_flag() -> None:
    def script_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        parser.add_argument("--freeze-LM", action="store_true")
        return parser

    parser = megatron_lm._with_optimus_args(script_args)(argparse.ArgumentParser())
    args = parser.parse_args(["--optimus-schedule", "plan.json", "--freeze-LM"])
    assert (args.optimus_schedule, args.freeze_LM) == ("plan.json", True)
    given = megatron_lm._optimus_args_given(["--lr", "1", "--optimus-schedule", "auto"])
    assert (given.optimus_schedule, given.optimus_profile) == ("auto", None)
    abbreviated = megatron_lm._optimus_args_given(["--optimus-sched", "auto"])
    assert abbreviated.optimus_schedule is None  # no abbreviations


@pytest.mark.skipif(
    megatron_lm.megatron_training_importable(), reason="megatron.training is importable here"
)
def test_megatron_lm_arguments_without_megatron_training_are_one_line(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        megatron.pretrain(
            None, None, None, None, args_defaults={"tokenizer_type": "GPT2BPETokenizer"}
        )
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "megatron.training cannot be imported" in lines[0], lines


@needs_megatron_lm
def test_training_patches_install_and_restore() -> None:
    # the checkout's megatron.training beside the installed megatron-core, as the launcher runs it
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(CHECKOUT)])}
    result = subprocess.run(
        [sys.executable, "-c", _RESTORE_CHECK],
        cwd=REPO,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0 and "restored" in result.stdout, result.stderr[-3000:]
