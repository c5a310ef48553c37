"""Pipeline P2P with the message semantics the scheduler's LLM timeline assumes, for any warm-up.

megatron-core's ``P2PCommunicator`` waits, inside each combined send/receive call, for every message
of the call, and sends both directions over one process group (plus WORLD at PP 2). Its pairing of
those calls holds for its own warm-up counts only: with the adjusted warm-up of the paper's Fig. 12
the PP 4 interleaved schedule hangs, and at PP 2 a forward activation can match a backward
gradient's receive (same peer, shape and tag), which trains silently wrong.

``ChannelP2PCommunicator`` keeps megatron-core's schedule and its bookkeeping of which tensor feeds
which op, and changes only how messages move:

- one two-rank process group per channel, a channel being one sender stage and one kind (forward
  activations to the next stage, gradients to the previous one), so every group carries messages
  in one direction only and matches them by order -- NCCL's rule; no tags;
- sends are posted and never waited for inside the schedule (``finish`` waits for them);
- receives are posted when megatron-core asks and waited for by ``wait_for_input`` right before
  the op that consumes them (the caller knows which op that is).

An op therefore starts once its rank has finished the previous op and its input has arrived,
which is ``llm_timeline.simulate``'s model; a warm-up that simulate accepts cannot hang here.
Used with ``overlap_p2p_comm`` on the interleaved schedule, so that sends leave right after the
op that produced them, as the timeline assumes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

Direction = Literal["prev", "next"]  # a consumed input comes from the previous or the next stage


@dataclass(frozen=True)
class PipelineChannels:
    """This rank's four channels: the groups it sends on and receives on, one kind each."""

    to_next: dist.ProcessGroup  # our forward activations
    to_prev: dist.ProcessGroup  # our gradients
    from_prev: dist.ProcessGroup  # the previous stage's forward activations
    from_next: dist.ProcessGroup  # the next stage's gradients


def build_pipeline_channels(pipelines: list[list[int]], rank: int) -> PipelineChannels:
    """Create every pipeline's channel groups (every rank, in the same order) and return this
    rank's.

    ``pipelines`` lists the global ranks of each pipeline-parallel group by stage, the same list on
    every rank; ``rank`` must be in one of them.
    """
    to_next: dict[int, dist.ProcessGroup] = {}  # by sender rank
    to_prev: dict[int, dist.ProcessGroup] = {}
    for ranks in pipelines:
        pp = len(ranks)
        for s, sender in enumerate(ranks):
            to_next[sender] = dist.new_group([sender, ranks[(s + 1) % pp]])
            to_prev[sender] = dist.new_group([sender, ranks[(s - 1) % pp]])
    ranks = next(r for r in pipelines if rank in r)
    s, pp = ranks.index(rank), len(ranks)
    return PipelineChannels(
        to_next=to_next[rank],
        to_prev=to_prev[rank],
        from_prev=to_next[ranks[(s - 1) % pp]],
        from_next=to_prev[ranks[(s + 1) % pp]],
    )


class _WaitedElsewhere:
    """The handle megatron-core gets for a message: ``wait_for_input`` or ``finish`` waits for
    it."""

    def wait(self) -> None:
        return None


class ChannelP2PCommunicator(P2PCommunicator):
    """megatron-core's communicator with every message on its own channel and no wait inside its
    calls."""

    def __init__(self, pp_group: dist.ProcessGroup, config: object, channels: PipelineChannels):
        super().__init__(pp_group, config)
        if getattr(config, "variable_seq_lengths", False):
            raise ValueError(
                "ChannelP2PCommunicator: variable_seq_lengths needs shape messages; not supported"
            )
        self.channels = channels
        self._posted: dict[Direction, deque[tuple[torch.Tensor, dist.Work]]] = {
            "prev": deque(),
            "next": deque(),
        }
        self._sends: list[dist.Work] = []

    def _communicate(
        self,
        *,
        tensor_send_next: torch.Tensor | None,
        tensor_send_prev: torch.Tensor | None,
        recv_prev: bool,
        recv_next: bool,
        tensor_shape: object,
        wait_on_reqs: bool = True,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, dict | None]:
        self._sends = [work for work in self._sends if not work.is_completed()]
        handles: dict[str, _WaitedElsewhere] = {}
        # A send is still in flight when this returns, and megatron-core then frees a sent output
        # (``deallocate_pipeline_outputs``, Megatron-LM's default) by swapping its ``.data`` for a
        # one-element tensor: a detached view keeps the sent storage for the send.
        if tensor_send_next is not None:
            self._sends.append(
                dist.isend(tensor_send_next.detach(), self.next_rank, group=self.channels.to_next)
            )
            handles["send_next"] = _WaitedElsewhere()
        if tensor_send_prev is not None:
            self._sends.append(
                dist.isend(tensor_send_prev.detach(), self.prev_rank, group=self.channels.to_prev)
            )
            handles["send_prev"] = _WaitedElsewhere()
        received_prev = self._post("prev", tensor_shape) if recv_prev else None
        received_next = self._post("next", tensor_shape) if recv_next else None
        if received_prev is not None:
            handles["recv_prev"] = _WaitedElsewhere()
        if received_next is not None:
            handles["recv_next"] = _WaitedElsewhere()
        return received_prev, received_next, (None if wait_on_reqs else handles)

    def _post(self, direction: Direction, shape: object) -> torch.Tensor:
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        buffer = torch.empty(
            tuple(shape), requires_grad=True, device=device, dtype=self.config.pipeline_dtype
        )
        peer, group = (
            (self.prev_rank, self.channels.from_prev)
            if direction == "prev"
            else (self.next_rank, self.channels.from_next)
        )
        self._posted[direction].append((buffer, dist.irecv(buffer, peer, group=group)))
        return buffer

    def wait_for_input(self, direction: Direction) -> torch.Tensor:
        """Wait for the oldest posted receive from ``direction``: the input of the op about to run.

        Each channel delivers in order and megatron-core hands its buffers to the ops in that order,
        so the oldest receive is this op's input.
        """
        if not self._posted[direction]:
            raise RuntimeError(
                f"pipeline op expects an input from the {direction} stage but megatron-core "
                "posted no receive for it: the op order and the schedule disagree"
            )
        buffer, work = self._posted[direction].popleft()
        work.wait()
        return buffer

    def finish(self) -> None:
        """End of the step: every send delivered, every received input consumed."""
        for work in self._sends:
            work.wait()
        self._sends.clear()
        left = {d: len(q) for d, q in self._posted.items() if q}
        if left:
            raise RuntimeError(f"pipeline inputs received but never consumed: {left}")
