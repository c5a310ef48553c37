"""``python -m optimus_mllm.train`` under torchrun on 4 CPU processes, and its errors on every rank.

The Optimus runs (scheduled in the job, or from an ``optimus-plan --artifact`` file) print the same
losses as the Megatron-style baseline; a bad job makes every rank exit 2, with one error line from
rank 0 and no traceback, instead of hanging.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import CONFIGS, REPO
from tests.distributed_utils import free_port

TINY = str(CONFIGS / "tiny.yaml")
TIMEOUT_S = 60
STEP = re.compile(r"^step (\d+)/3 \| loss (\d+\.\d{4}) \| [\d.]+ ms \| \d+ tokens/s \| (.+)$")
SUMMARY = re.compile(r"^done: 3 steps \| mean step [\d.]+ ms \| final loss (\d+\.\d{4})$")


def _torchrun(*args: str) -> list[str]:
    """Train on 4 processes; the stdout lines, after checking exit 0, 3 step lines and the summary."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
               "-m", "optimus_mllm.train", "--config", TINY, *args]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 4, done.stdout
    assert [STEP.match(line).group(1) for line in lines[:3]] == ["1", "2", "3"], done.stdout
    assert SUMMARY.match(lines[3]).group(1) == STEP.match(lines[2]).group(2)
    return lines


def _losses(lines: list[str]) -> list[str]:
    return [STEP.match(line).group(2) for line in lines[:3]]


@pytest.fixture(scope="module")
def baseline() -> list[str]:
    lines = _torchrun("--baseline")
    assert all(STEP.match(line).group(3) == "baseline" for line in lines[:3])
    return lines


def _bubble_shares(lines: list[str]) -> list[float]:
    shares = [re.fullmatch(r"encoder ops inside LLM span ([\d.]+)%", STEP.match(line).group(3)) for line in lines[:3]]
    return [float(s.group(1)) for s in shares]


def test_scheduled_in_the_job_trains_like_the_baseline(baseline):
    lines = _torchrun()
    assert _losses(lines) == _losses(baseline)
    assert all(0 < share <= 100 for share in _bubble_shares(lines))


def _write_artifact(path: Path, *overrides: str) -> None:
    from optimus_mllm.cli.plan import main as optimus_plan

    args = ["--config", TINY, "--artifact", str(path)] + [f"--override={o}" for o in overrides]
    assert optimus_plan(args) == 0


def test_schedule_artifact_trains_like_the_baseline(baseline, tmp_path):
    artifact = tmp_path / "schedule.json"
    _write_artifact(artifact, "parallel.encoder={pp: 2, tp: 1}")
    lines = _torchrun("--schedule", str(artifact), "--override", "parallel.encoder={pp: 2, tp: 1}")
    assert _losses(lines) == _losses(baseline)


def _ranks(world: int, *args: str) -> list[subprocess.CompletedProcess]:
    """Start ``world`` ranks the way torchrun does (its environment variables) and wait for each."""
    port = str(free_port())
    ranks = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
               "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        ranks.append(subprocess.Popen([sys.executable, "-m", "optimus_mllm.train", "--config", TINY, *args],
                                      cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        outputs = [p.communicate(timeout=TIMEOUT_S) for p in ranks]
        return [subprocess.CompletedProcess(p.args, p.returncode, *out) for p, out in zip(ranks, outputs)]
    finally:
        for p in ranks:
            p.kill()


def _assert_one_error_everywhere(ranks: list[subprocess.CompletedProcess], expected: str) -> None:
    assert [r.returncode for r in ranks] == [2] * len(ranks), [r.stderr for r in ranks]
    errors = [line for r in ranks for line in r.stderr.splitlines() if line.startswith("optimus-train: error:")]
    assert len(errors) == 1 and expected in errors[0], errors
    assert ranks[0].stderr.splitlines()[-1] == errors[0]
    assert not any("Traceback" in r.stderr for r in ranks)


def test_wrong_world_size_exits_2_on_every_rank():
    _assert_one_error_everywhere(_ranks(2), "2 processes but cluster.num_gpus=4")


def test_artifact_for_another_plan_exits_2_on_every_rank(tmp_path):
    artifact = tmp_path / "schedule.json"
    _write_artifact(artifact, "parallel.llm={dp: 1, pp: 4, tp: 1, vp: 1}")
    _assert_one_error_everywhere(_ranks(4, "--schedule", str(artifact)), "re-run optimus-plan")
