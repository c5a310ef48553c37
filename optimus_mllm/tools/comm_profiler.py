"""Measure the job's communication on its own process groups, for the cost model's fits.

Run on every rank of the job (``optimus-profile`` under torchrun, the config's world size), after
megatron-core's ``initialize_model_parallel`` has made the LLM plan's groups: each collective the
cost model prices (TP and DP all-reduce / all-gather / reduce-scatter, the pipeline's send to the
next stage with the receive from the previous one, as megatron-core's ``batch_isend_irecv`` pairs
them) is timed on the group it runs on, at a few tensor sizes, while every other group of the job
does the same, and fitted to latency + bytes x rate (``costing.cost_model.fit_comm``). A
collective ends on its slowest rank, so each size keeps the largest of the ranks' medians.

A (collective, group size) is measured once, on the first group of that size in the order TP, DP,
pipeline: the cost model keys fits by the two, as groups of one size inside one node move bytes
alike. What a job of one rank cannot measure (every group of size 1) stays on the bandwidth
constants, and the profile says so.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from optimus_mllm.costing.cost_model import fit_comm

# whole-tensor sizes in bytes: a TP activation of a small layer up to a DP gradient bucket
SIZES_BYTES = (64 * 1024, 512 * 1024, 4 * 1024 * 1024, 16 * 1024 * 1024)
_ELEMENT_BYTES = 4  # fp32: gloo reduces every dtype alike per byte
_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")


def _collective_call(
    collective: str, group: Any, group_size: int, elements: int
) -> Callable[[], None]:
    """One call of ``collective`` over a whole tensor of ``elements`` on ``group``."""
    if collective == "all_reduce":
        tensor = torch.ones(elements)
        return lambda: dist.all_reduce(tensor, group=group)
    shard = torch.ones(elements // group_size)
    whole = torch.ones(shard.numel() * group_size)
    if collective == "all_gather":
        return lambda: dist.all_gather_into_tensor(whole, shard, group=group)
    if collective == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(shard, whole, group=group)
    raise ValueError(f"unknown collective {collective}")


def _p2p_call(next_rank: int, prev_rank: int, elements: int) -> Callable[[], None]:
    """Send a tensor to the next pipeline stage while receiving one from the previous stage."""
    send, recv = torch.ones(elements), torch.empty(elements)

    def exchange() -> None:
        ops = [dist.P2POp(dist.isend, send, next_rank), dist.P2POp(dist.irecv, recv, prev_rank)]
        for request in dist.batch_isend_irecv(ops):
            request.wait()

    return exchange


def _median_us(call: Callable[[], None], group: Any, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        call()
    times = []
    for _ in range(repeats):
        dist.barrier(group=group)  # start together: the time is the collective's, not a straggler's
        started = time.perf_counter()
        call()
        times.append((time.perf_counter() - started) * 1e6)
    return statistics.median(times)


def _slowest(value_us: float) -> float:
    """The largest of every rank's value: a collective ends on its slowest rank."""
    tensor = torch.tensor([value_us], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


def measure_communication(
    warmup: int, repeats: int, sizes: tuple[int, ...] = SIZES_BYTES
) -> tuple[list[dict[str, Any]], str]:
    """Fits of every collective the job's groups run, as profile entries, and what was not
    measured; the same on every rank (collective over the world)."""
    from megatron.core import parallel_state as ps

    groups = [
        ("tp", ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size()),
        ("dp", ps.get_data_parallel_group(), ps.get_data_parallel_world_size()),
    ]
    kinds = [(c, name, g, n) for name, g, n in groups for c in _COLLECTIVES if n > 1]
    pp = ps.get_pipeline_model_parallel_world_size()
    entries, seen = [], set()
    for collective, name, group, size in kinds:
        if (collective, size) in seen:
            continue
        seen.add((collective, size))
        times = [
            _slowest(
                _median_us(
                    _collective_call(collective, group, size, b // _ELEMENT_BYTES),
                    group,
                    warmup,
                    repeats,
                )
            )
            for b in sizes
        ]
        entries.append(_entry(collective, size, name, list(sizes), times))
    if pp > 1:
        group = ps.get_pipeline_model_parallel_group()
        call_of = lambda b: _p2p_call(  # noqa: E731
            ps.get_pipeline_model_parallel_next_rank(),
            ps.get_pipeline_model_parallel_prev_rank(),
            b // _ELEMENT_BYTES,
        )
        times = [_slowest(_median_us(call_of(b), group, warmup, repeats)) for b in sizes]
        entries.append(_entry("p2p", 2, "pp", list(sizes), times))
    not_measured = (
        "communication: every group of the job has one rank; the cost model keeps its bandwidth "
        "model for every collective"
        if not entries
        else "communication: measured on this job's groups ("
        + ", ".join(f"{e['collective']} over {e['group_size']} on {e['group']}" for e in entries)
        + "); any other collective or group size keeps the bandwidth model"
    )
    return entries, not_measured


def _entry(
    collective: str, group_size: int, group: str, sizes: list[int], times_us: list[float]
) -> dict[str, Any]:
    fit = fit_comm(collective, group_size, [float(s) for s in sizes], times_us)
    return {
        "collective": collective,
        "group_size": group_size,
        "group": group,
        "latency_us": fit.latency_us,
        "us_per_byte": fit.us_per_byte,
        "sizes_bytes": sizes,
        "time_us": times_us,
    }
