"""``runtime.same_job``: ranks that read different jobs (a node launched with another override or
another copy of a file), or of which one could not read its job, stop together, with one message
naming the rank, its host and the setting or problem."""

from __future__ import annotations

import socket
from typing import Any

import pytest
import torch.distributed as dist

from optimus_mllm.errors import AgreedError
from optimus_mllm.runtime.same_job import check_same_job

from support.distributed_utils import run_distributed

pytestmark = pytest.mark.distributed

SETTINGS = {"training.lr": 1e-4, "parallel.llm": {"dp": 1, "pp": 2, "tp": 2}, "--save": None}
HOST = socket.gethostname()
LAUNCH = "launch every node with the same command and the same files"


def _check(
    settings_by_rank: list[dict[str, Any] | None], problems: list[str | None] | None = None
) -> str | None:
    rank = dist.get_rank()
    try:
        check_same_job(settings_by_rank[rank], None if problems is None else problems[rank])
    except AgreedError as exc:
        return str(exc)
    return None


def test_ranks_that_read_the_same_job_go_on():
    assert run_distributed(_check, 3, [SETTINGS] * 3) == [None] * 3


def test_a_rank_with_another_setting_stops_every_rank_naming_it():
    other = {**SETTINGS, "training.lr": 5e-4}
    expected = (
        f"rank 2 (host {HOST}) runs another job than rank 0 (host {HOST}): training.lr is 0.0005 "
        f"there, 0.0001 on rank 0; {LAUNCH}"
    )
    assert run_distributed(_check, 3, [SETTINGS, SETTINGS, other]) == [expected] * 3


def test_the_first_rank_that_differs_is_named_with_a_setting_only_one_side_has():
    other = {**SETTINGS, "--save": "ckpt"}
    extra = {**SETTINGS, "data.path": "/data"}
    expected = (
        f'rank 1 (host {HOST}) runs another job than rank 0 (host {HOST}): data.path is "/data" '
        f"there, null on rank 0; {LAUNCH}"
    )
    assert run_distributed(_check, 3, [SETTINGS, extra, other]) == [expected] * 3


def test_a_rank_that_could_not_read_its_job_is_named_with_its_problem():
    problem = "data.path: /data does not exist"
    messages = run_distributed(_check, 3, [SETTINGS, None, SETTINGS], [None, problem, None])
    assert messages == [f"rank 1 (host {HOST}): {problem}"] * 3


def test_the_same_problem_on_every_rank_is_said_as_it_is():
    problem = "cluster.num_gpus: 4 is not a multiple of gpus_per_node=3"
    assert run_distributed(_check, 2, [None, None], [problem, problem]) == [problem] * 2
