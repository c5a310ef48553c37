"""Every communicator the runtime uses, created at start-up, in one order on every rank.

NCCL creates a group's communicator at the group's first collective, and a separate one for a
pair's first send or receive, and blocks the host there until every member has arrived. Left to
first use, that wait falls inside the schedule -- at an encoder op's first message, or at the first
TP collective of a hook -- where the hook plan's deadlock argument does not model it. So the
trainer gives every group its first operation before the first step: an all-reduce of one number
on each collective group, a one-number send from sender to receiver on each two-rank channel (the
kind of call ``messages`` and ``megatron_patches.p2p`` make there). On gloo this costs a few
milliseconds and changes nothing.

Order. Every rank walks one global list -- the group kinds in a fixed order; within a kind that
partitions the ranks (TP, PP, DP, ...) its one group, and within a kind of two-rank channels the
channels in the order every rank created them -- and acts on the groups it belongs to. A rank waits
only on the first group of its list not yet done; the earliest group of the global list not yet
done has every member waiting on it (their earlier groups are done), so it completes, and by
induction every group does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_patches.p2p import PipelineChannels
from optimus_mllm.runtime.process_groups import EncoderProcessGroups


@dataclass(frozen=True)
class FirstUse:
    """A group's first operation: an all-reduce, or on a two-rank channel a send from ``sender``
    to ``receiver`` (global ranks)."""

    group: dist.ProcessGroup
    sender: int | None = None
    receiver: int | None = None


def llm_uses(embedding_group: dist.ProcessGroup | None = None) -> list[FirstUse]:
    """megatron-core's groups that the schedule, DDP and the optimizer use (each kind partitions the
    ranks, or leaves this rank out), then ``embedding_group`` (the balanced baseline's)."""
    groups = [
        dist.group.WORLD,
        parallel_state.get_tensor_model_parallel_group(),
        parallel_state.get_pipeline_model_parallel_group(),
        parallel_state.get_data_parallel_group(),
        parallel_state.get_data_parallel_group(with_context_parallel=True),
        parallel_state.get_model_parallel_group(),
        parallel_state.get_embedding_group(check_initialized=False),
        parallel_state.get_position_embedding_group(check_initialized=False),
        parallel_state.get_intra_distributed_optimizer_instance_group(check_initialized=False),
        embedding_group,
    ]
    unique = {id(g): g for g in groups if g is not None}  # one object may serve two kinds
    return [FirstUse(g) for g in unique.values()]


def pipeline_channel_uses(
    pipelines: Sequence[Sequence[int]], rank: int, channels: PipelineChannels
) -> list[FirstUse]:
    """This rank's LLM pipeline channels (``megatron_patches.p2p``), in the order
    ``build_pipeline_channels`` creates them: by sender stage, to the next stage, then the
    previous."""
    ranks = list(next(r for r in pipelines if rank in r))
    s, pp = ranks.index(rank), len(ranks)
    mine = {
        (rank, "next"): channels.to_next,
        (rank, "prev"): channels.to_prev,
        (ranks[(s - 1) % pp], "next"): channels.from_prev,
        (ranks[(s + 1) % pp], "prev"): channels.from_next,
    }
    uses = []
    for k, sender in enumerate(ranks):
        for direction, receiver in (("next", ranks[(k + 1) % pp]), ("prev", ranks[(k - 1) % pp])):
            group = mine.get((sender, direction))
            if group is not None:
                uses.append(FirstUse(group, sender, receiver))
    return uses


def encoder_uses(groups: EncoderProcessGroups) -> list[FirstUse]:
    """The encoder plan's groups, then its message channels in creation order (``groups.channels``
    keeps the layout's order)."""
    collective = [groups.tp_group, groups.pp_group, groups.dp_group, groups.mp_group]
    return [FirstUse(g) for g in collective] + [
        FirstUse(group, channel.sender, channel.receiver)
        for channel, group in groups.channels.items()
    ]


def create_communicators(uses: Sequence[FirstUse], rank: int, device: torch.device) -> None:
    """Give each group its first operation, in ``uses``' order (see the module docstring)."""
    on_device, on_host = torch.zeros(1, device=device), torch.zeros(1)
    for use in uses:
        # gloo connects when a group is made and sends host tensors only; the use is NCCL's
        one = on_host if dist.get_backend(use.group) == "gloo" else on_device
        if use.sender is None:
            dist.all_reduce(one, group=use.group)
        elif use.sender == rank:
            dist.send(one, use.receiver, group=use.group)
        else:
            dist.recv(one, use.sender, group=use.group)
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # each communicator made and used once before the step
