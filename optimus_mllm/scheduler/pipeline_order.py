"""megatron-core's pipeline schedule as plain facts: the order a pipeline rank runs its forwards
and backwards in, its warm-up, and which op feeds which. Pure Python, no torch.

The scheduler simulates this order (``scheduler.llm_timeline``); the runtime follows it where no
schedule artifact says otherwise (the baselines) and checks megatron-core against it. The numbers
are megatron-core's own (``get_schedule_table``, ``get_pp_rank_microbatches``), which
``tests/test_scheduler.py`` compares with the installed version.
"""

from __future__ import annotations


def schedule_table(num_microbatches: int, vp: int, group_size: int) -> list[tuple[int, int]]:
    """megatron-core's (microbatch, chunk) order of forwards on every rank
    (``get_schedule_table``)."""
    table = []
    for lo in range(0, num_microbatches, group_size):
        hi = num_microbatches if lo + group_size >= num_microbatches else lo + group_size
        table += [(mb, chunk) for chunk in range(vp) for mb in range(lo, hi)]
    return table


def default_warmup(
    pp: int, vp: int, num_microbatches: int, stage: int, group_size: int | None = None
) -> int:
    """megatron-core's number of warm-up forwards (``get_pp_rank_microbatches``)."""
    total = num_microbatches * vp
    if pp == 1:
        return 0
    if vp == 1:
        warmup = pp - stage - 1
    else:
        warmup = (pp - stage - 1) * 2 + (vp - 1) * (group_size or pp)
    return min(warmup, total)


def rank_op_order(
    num_microbatches: int, vp: int, warmup: int, group_size: int
) -> list[tuple[int, int, str]]:
    """(microbatch, chunk, phase) in the order one pipeline rank runs them."""
    table = schedule_table(num_microbatches, vp, group_size)
    total = len(table)
    fwd = [(mb, chunk, "fwd") for mb, chunk in table]
    bwd = [(mb, vp - 1 - chunk, "bwd") for mb, chunk in table]
    order = fwd[:warmup]
    for i in range(total - warmup):
        order += [fwd[warmup + i], bwd[i]]
    order += bwd[total - warmup :]
    return order


def pipeline_producer(
    stage: int, chunk: int, phase: str, pp: int, vp: int
) -> tuple[int, int] | None:
    """(stage, chunk) whose op of the same microbatch and phase sends op (stage, chunk, phase) its
    input.

    None where the input is no pipeline message: chunk 0's forward on the first stage takes the data
    (and A_i), and the last chunk's backward on the last stage starts from its own loss.
    """
    if phase == "fwd":
        if stage > 0:
            return stage - 1, chunk
        return (pp - 1, chunk - 1) if chunk > 0 else None
    if stage < pp - 1:
        return stage + 1, chunk
    return (0, chunk + 1) if chunk < vp - 1 else None
