"""The multi-rank test helper: results in rank order, child failures and hangs fail the test."""

from __future__ import annotations

import multiprocessing
import os
import socket
import time

import pytest
import torch
import torch.distributed as dist

from support import distributed_utils
from support.distributed_utils import run_distributed

pytestmark = pytest.mark.distributed


def _rank_and_sum() -> tuple[int, int]:
    value = torch.tensor([dist.get_rank() + 1])
    dist.all_reduce(value)
    return dist.get_rank(), int(value)


def _fail_on_rank_one() -> None:
    if dist.get_rank() == 1:
        raise ValueError("rank one refuses")
    dist.barrier()  # rank 0 would wait here for ever


def _exit_on_rank_one() -> None:
    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()


def _sleep() -> None:
    time.sleep(600)


def test_results_come_back_in_rank_order() -> None:
    assert run_distributed(_rank_and_sum, 2) == [(0, 3), (1, 3)]


def test_a_rank_exception_fails_with_its_traceback_and_no_rank_is_left() -> None:
    with pytest.raises(RuntimeError, match="(?s)rank 1 failed.*ValueError: rank one refuses"):
        run_distributed(_fail_on_rank_one, 2)

    assert not multiprocessing.active_children()


def test_a_rank_that_dies_fails_the_run() -> None:
    with pytest.raises(RuntimeError, match=r"rank 1 died \(exit code 3\) without a result"):
        run_distributed(_exit_on_rank_one, 2)

    assert not multiprocessing.active_children()


def test_a_hang_is_killed_at_the_timeout() -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] did not finish within 3 s"):
        run_distributed(_sleep, 2, timeout=3)

    assert time.monotonic() - start < 30
    assert not multiprocessing.active_children()


def test_a_port_taken_before_the_ranks_start_is_replaced(monkeypatch) -> None:
    """Another job listens on the port free_port returned: the ranks start again on a new port."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        taken_port = taken.getsockname()[1]
        ports = [taken_port]
        real_free_port = distributed_utils.free_port

        def taken_first() -> int:
            port = ports.pop(0) if ports else real_free_port()
            calls.append(port)
            return port

        calls: list[int] = []
        monkeypatch.setattr(distributed_utils, "free_port", taken_first)
        assert run_distributed(_rank_and_sum, 2) == [(0, 3), (1, 3)]

    assert len(calls) == 2 and calls[0] == taken_port
    assert not multiprocessing.active_children()
