"""Run a function on N ranks in forked-server processes, with a hard timeout, for tests.

``run_distributed(fn, world_size, *args)`` calls ``fn(*args)`` on every rank after
``torch.distributed`` is initialised (gloo; NCCL where each rank has a GPU), and returns the ranks'
results in rank order.
``fn`` and ``args`` must be picklable (a module-level function). If a rank raises, dies or the
timeout passes, every rank is killed and the failure (with the rank's traceback) is raised.
The rendezvous port is one the OS called free a moment before; when another job takes it first
(tests run beside each other), the ranks are started again on a new one, up to ``PORT_ATTEMPTS``.

Without a GPU, ranks fork from one server that imported torch, megatron-core and the runtime once
per test session: a spawned rank spends about 9 s of CPU on those imports, which on two cores was a
third of the multi-rank tests' time. Where CUDA is visible they are spawned (``start_context``).
Each rank still starts with the caller's current environment.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import time
import traceback
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_JOIN_SECONDS = 5.0
PORT_ATTEMPTS = 3
# what every rank imports anyway; the fork server imports it once
_PRELOAD = [
    "optimus_mllm.runtime.trainer",
    "optimus_mllm.megatron.core_training",
    "optimus_mllm.train",
]


class _PortTaken(RuntimeError):
    """The rendezvous port was taken between ``free_port`` and the ranks' ``init_process_group``."""


def free_port() -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_context() -> Any:
    """Forked from the preloaded fork server on a host without a GPU; spawned where CUDA is visible:
    on an H100, torch refused CUDA in ranks forked from the server ("Cannot re-initialize CUDA in
    forked subprocess"), as it does in any child of a process that has queried CUDA."""
    if torch.cuda.is_available():
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    return context


def become_rank(environment: dict[str, str]) -> None:
    """First thing in a rank forked from the fork server: the caller's environment (the server's
    is the one it started with) and a process group of the rank's own, which ``stop_ranks`` ends
    with whatever the rank started."""
    os.environ.clear()
    os.environ.update(environment)
    os.setpgrp()


def _backend(world_size: int) -> str:
    """gloo, or NCCL where every rank has a GPU of its own, as the launcher chooses: on an H100,
    gloo died with SIGSEGV in the distributed optimizer's coalesced all-gather of CUDA tensors."""
    if torch.cuda.is_available() and world_size <= torch.cuda.device_count():
        return "nccl"
    return "gloo"


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
    environment: dict[str, str],
) -> None:
    become_rank(environment)
    try:
        torch.set_num_threads(1)  # N ranks share few cores: avoid oversubscription
        backend = _backend(world_size)
        if backend == "nccl":
            os.environ["LOCAL_RANK"] = str(rank)  # training_device's GPU, as torchrun sets it
        try:
            dist.init_process_group(
                backend,
                init_method=f"tcp://127.0.0.1:{port}",
                rank=rank,
                world_size=world_size,
            )
        except Exception as error:  # noqa: BLE001 - re-raised unless it is the port race
            if "address already in use" not in str(error).lower():
                raise
            results.put((rank, None, str(error)))
            return
        results.put((rank, True, fn(*args)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _died(processes: list[BaseProcess], accounted: set[int]) -> str:
    """Ranks outside ``accounted`` that exited without success, as text (a rank that dies reports
    nothing; one that exits 0 has queued its result)."""
    return "".join(
        f"\nrank {rank} died (exit code {process.exitcode}) without a result"
        for rank, process in enumerate(processes)
        if rank not in accounted and not process.is_alive() and process.exitcode != 0
    )


def _collect(processes: list[BaseProcess], results: Any, timeout: float) -> dict[int, Any]:
    outputs: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(outputs) < len(processes):
        try:
            rank, ok, payload = results.get(timeout=0.5)
        except queue.Empty:
            died = _died(processes, set(outputs))
            if died and results.empty():
                raise RuntimeError(died.lstrip()) from None
            if time.monotonic() > deadline:
                missing = sorted(set(range(len(processes))) - set(outputs))
                message = f"ranks {missing} did not finish within {timeout:.0f} s"
                raise TimeoutError(message) from None
            continue
        if ok is None:
            raise _PortTaken(payload)
        if not ok:
            # a peer that died is often why this rank failed (its sockets closed as it exited):
            # give it a moment to be seen dead, so the message names it
            settle = time.monotonic() + 2.0
            for other, process in enumerate(processes):
                if other not in {rank, *outputs}:
                    process.join(max(0.0, settle - time.monotonic()))
            others = _died(processes, {rank, *outputs})
            raise RuntimeError(f"rank {rank} failed:\n{payload}{others}")
        outputs[rank] = payload
    return outputs


def stop_ranks(processes: list[BaseProcess], join_s: float = _JOIN_SECONDS) -> None:
    """Wait up to ``join_s`` for each rank, kill it if still running, then kill what it left in
    its process group: a rank a test kills mid-save leaves megatron-core's forked checkpoint
    writer waiting forever on a queue its parent held."""
    for process in processes:
        process.join(join_s)
        if process.is_alive():
            process.kill()
            process.join()
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:  # nothing of the rank's is left
            pass


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 60.0
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` gloo ranks; return each rank's result, rank order."""
    for attempt in range(PORT_ATTEMPTS):
        try:
            return _launch(fn, world_size, args, timeout)
        except _PortTaken:
            if attempt == PORT_ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")


def _launch(
    fn: Callable[..., Any], world_size: int, args: tuple[Any, ...], timeout: float
) -> list[Any]:
    context = start_context()
    results = context.Queue()
    port = free_port()
    environment = dict(os.environ)
    processes = [
        context.Process(
            # not daemonic: megatron-core's checkpoint writer starts processes of its own
            target=_rank_main,
            args=(rank, world_size, port, fn, args, results, environment),
            daemon=False,
        )
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    try:
        outputs = _collect(processes, results, timeout)
    except BaseException:
        for process in processes:
            process.kill()
        raise
    finally:
        stop_ranks(processes)
        results.close()
    return [outputs[rank] for rank in range(world_size)]
