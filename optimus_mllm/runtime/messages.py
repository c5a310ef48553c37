"""The encoder plan's rank-to-rank messages: activations between encoder stages, A_i and G_i.

Each message travels on its ``Channel``'s own two-rank group (``process_groups``), so it matches
its receive by order alone, as NCCL does; no tags. Sends are posted and waited for at the end of
the step (``finish``): a send never blocks the encoder ops or the LLM. Receives block where the
data is needed; the hook plan's deadlock check models exactly these waits.

A channel delivers in its sender's order, which need not be the order the receiver consumes in
(the hook plan may run microbatch 7's chain before microbatch 1's). Every rank knows each sender's
order from the hook plan, so a receive takes the channel's messages in that order up to the one it
needs and keeps the others for later: no message is taken for another, and since the sender sent
every earlier message before the wanted one, this waits for nothing more than the wanted message.

Every message is preceded by a header naming what it carries (microbatch, tensor index), built
on the host and copied to the GPU asynchronously (``streams.to_device``). The receiver records
the header next to what it expected and ``finish`` compares them, before the step's gradients are
used: a mis-routed tensor is an error, never a wrong loss. The comparison is deferred to the end
of the step so that a GPU never syncs with the host per message.
"""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist

from optimus_mllm.runtime.process_groups import Channel
from optimus_mllm.runtime.streams import to_device

Identity = tuple[int, int]  # (microbatch, tensor index) of a message
# per channel: what arrives, in order, and its shape
Incoming = dict[Channel, list[tuple[Identity, tuple[int, ...]]]]


class MisroutedMessage(RuntimeError):
    """A message arrived where another was expected: the two ends disagree on the schedule."""


class Messenger:
    """This rank's channels: identity-carrying sends and receives, checked at ``finish``."""

    def __init__(
        self,
        rank: int,
        channels: dict[Channel, dist.ProcessGroup],
        incoming: Incoming,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.rank, self.channels, self.incoming, self.dtype, self.device = (
            rank,
            channels,
            incoming,
            dtype,
            device,
        )
        self._sends: list[dist.Work] = []
        self._received: list[tuple[Channel, Identity, torch.Tensor]] = []
        self._start_step()

    def _start_step(self) -> None:
        self._arriving = {channel: deque(messages) for channel, messages in self.incoming.items()}
        self._kept: dict[Channel, dict[Identity, torch.Tensor]] = {
            channel: {} for channel in self.incoming
        }

    def expect(self, incoming: Incoming) -> None:
        """What arrives this step, where message shapes change from step to step (the images per
        microbatch); the same channels as before."""
        assert incoming.keys() == self.incoming.keys()
        self.incoming = incoming
        self._start_step()

    def send(self, kind: str, receiver: int, tensor: torch.Tensor, identity: Identity) -> None:
        channel = Channel(kind, self.rank, receiver)
        group = self.channels[channel]
        # made on the host, copied from pinned memory without waiting: a plain host-to-GPU copy
        # would hold the host until the stream's queued work (the encoder ops on the side stream,
        # the LLM's backward at a gradient hand-back) had run
        header = to_device(torch.tensor(identity, dtype=torch.int64), self.device)
        self._sends.append(dist.isend(header, receiver, group=group))
        self._sends.append(dist.isend(tensor.detach().contiguous(), receiver, group=group))

    def recv(self, kind: str, sender: int, identity: Identity) -> torch.Tensor:
        """The message ``identity`` from ``sender``; earlier ones on its channel are kept for their
        turn."""
        channel = Channel(kind, sender, self.rank)
        kept = self._kept[channel]
        if identity in kept:
            return kept.pop(identity)
        arriving = self._arriving[channel]
        while arriving:
            next_identity, shape = arriving.popleft()
            header = torch.empty(2, dtype=torch.int64, device=self.device)
            buffer = torch.empty(shape, dtype=self.dtype, device=self.device)
            dist.recv(header, sender, group=self.channels[channel])
            dist.recv(buffer, sender, group=self.channels[channel])
            self._received.append((channel, next_identity, header))
            if next_identity == identity:
                return buffer
            kept[next_identity] = buffer
        raise MisroutedMessage(
            f"{kind} message {identity} from rank {sender} is not among those its channel "
            "delivers this step: the schedule's two ends disagree"
        )

    def finish(self) -> None:
        """Wait for this step's sends, then check every received message was the one expected."""
        for work in self._sends:
            work.wait()
        self._sends.clear()
        received, self._received = self._received, []
        left = {
            f"{c.kind} from rank {c.sender}": len(q) + len(self._kept[c])
            for c, q in self._arriving.items()
            if q or self._kept[c]
        }
        self._start_step()
        if left:
            raise MisroutedMessage(f"messages not consumed this step: {left}")
        for channel, expected, header in received:
            got = tuple(header.tolist())
            if got != expected:
                raise MisroutedMessage(
                    f"{channel.kind} message from rank {channel.sender} to rank {channel.receiver} "
                    "carried "
                    f"(microbatch, tensor) {got} where {expected} was expected: the schedule's two "
                    "ends disagree"
                )
