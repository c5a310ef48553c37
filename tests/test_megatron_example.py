"""``scripts/pretrain_vlm_megatron.py``: a Megatron-style script where one flag switches Optimus on.

With ``--optimus-schedule`` it runs the schedule (the encoder under its own plan, kernels at the
artifact's hook points) and prints the same losses as without it, where it runs plain Megatron-style.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.train_utils import TIMEOUT_S, TINY, assert_one_error_everywhere, ranks

SCRIPT = str(REPO / "scripts" / "pretrain_vlm_megatron.py")
LINE = re.compile(r"^iteration (\d)/3 \| lm loss (\d+\.\d{4}) \| (.+)$")
# configs/tiny.yaml in Megatron's flags (its untied embeddings are the one non-default)
TINY_ARGS = ["--untie-embeddings-and-output-weights", "--use-distributed-optimizer"]


def _run(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", SCRIPT,
               *TINY_ARGS, *args]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)


def _lines(done: subprocess.CompletedProcess) -> list[re.Match]:
    assert done.returncode == 0, done.stderr[-3000:]
    matches = [LINE.match(line) for line in done.stdout.splitlines()]
    assert all(matches) and [m.group(1) for m in matches] == ["1", "2", "3"], done.stdout
    return matches


@pytest.fixture(scope="module")
def plan_json(tmp_path_factory) -> str:
    from optimus_mllm.cli.plan import main as optimus_plan

    path = tmp_path_factory.mktemp("plan") / "plan.json"
    assert optimus_plan(["--config", TINY, "--artifact", str(path)]) == 0
    return str(path)


def test_the_flag_switches_the_optimus_runtime_on(plan_json):
    plain = _lines(_run())
    optimus = _lines(_run("--optimus-schedule", plan_json))
    assert {m.group(3) for m in plain} == {"plain"}
    assert len({m.group(3) for m in optimus}) == 1 and optimus[0].group(3).startswith("optimus, encoder plan DP")
    assert [m.group(2) for m in optimus] == [m.group(2) for m in plain]


def test_a_schedule_for_another_job_is_refused_on_every_rank(plan_json):
    results = ranks(4, *TINY_ARGS, "--optimus-schedule", plan_json, "--tensor-model-parallel-size", "1",
                    program=(SCRIPT,))
    assert_one_error_everywhere(results, "re-run optimus-plan", prog="pretrain_vlm_megatron.py")


def test_megatron_args_give_the_tiny_config():
    """The script's defaults with the flags above and without dropout describe the same model and plan as
    configs/tiny.yaml; dropout is Megatron-LM's 0.1 by default, for the LLM and the vision model."""
    from optimus_mllm.config import load_config
    from optimus_mllm.megatron import add_optimus_args, config_from_megatron_args

    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from pretrain_vlm_megatron import parse_args
    finally:
        sys.path.pop(0)
    args = parse_args(add_optimus_args, TINY_ARGS)
    assert isinstance(args, argparse.Namespace) and args.optimus_schedule is None
    defaults = config_from_megatron_args(args, 4, 4).model
    assert {(spec.hidden_dropout, spec.attention_dropout) for spec in (defaults.llm, *defaults.encoders)} == {(0.1, 0.1)}
    args = parse_args(add_optimus_args, [*TINY_ARGS, "--hidden-dropout", "0", "--attention-dropout", "0"])
    ours, tiny = config_from_megatron_args(args, 4, 4), load_config(TINY)
    assert ours.model == tiny.model
    assert ours.parallel.llm == tiny.parallel.llm
    assert ours.training == tiny.training  # optimizer, LR schedule and clipping included
