"""Where the encoder's kernel-level ops run relative to the LLM: inline, or on a CUDA side stream.

``InlineStream`` runs every op at once on the current stream (CPU; and CUDA with the side stream
off): its events are no-ops, so execution is exactly the plain sequential program.

``SideStream`` runs them on a dedicated ``torch.cuda.Stream``, ordered against the LLM's (main)
stream by CUDA events only, never by the host:
- ``launch()``: before the ops of a hook point, the side stream waits on the main stream as it is
  at that moment, so whatever the LLM or a P2P receive produced before the hook is ready;
- ``publish(tensor)``: an encoder output the LLM will consume (A_i) gets an event on the side
  stream, and ``consume(ready)`` makes the main stream wait on it where the LLM actually uses it;
- ``adopt(tensor)``: a main-stream tensor used by encoder ops (G_i) is ``record_stream``-ed onto
  the side stream, so the caching allocator cannot hand its memory to the main stream while the
  side stream still reads it; published tensors are likewise recorded onto the main stream;
- ``finish()``: the main stream waits on the side stream's work (before gradients are reduced).

Memory freed from the side stream's pool while the main stream still reads it cannot be reused
early either: the side stream only allocates inside ``launch()``, after waiting on the main stream.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any, Protocol

import torch

from optimus_mllm.runtime.gpu_status import warn_unverified


class EncoderStream(Protocol):
    """The executor's view of where encoder ops run (see the module docstring)."""

    device: torch.device

    def launch(self) -> contextlib.AbstractContextManager[None]: ...

    def publish(self, tensor: torch.Tensor) -> Any: ...

    def consume(self, ready: Any) -> None: ...

    def adopt(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def finish(self) -> None: ...


class InlineStream:
    """Ops run at once, in call order, on the current stream; every event is a no-op."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)

    def launch(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def publish(self, tensor: torch.Tensor) -> None:
        return None

    def consume(self, ready: None) -> None:
        return None

    def adopt(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def finish(self) -> None:
        return None


class SideStream:
    """Encoder ops on a dedicated CUDA stream, ordered against the main stream by events only."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        warn_unverified("the CUDA side stream for encoder ops")
        self.side = torch.cuda.Stream(self.device)
        self.main = torch.cuda.current_stream(self.device)

    @contextlib.contextmanager
    def launch(self) -> Iterator[None]:
        self.main = torch.cuda.current_stream(self.device)  # the LLM's stream at this hook point
        self.side.wait_stream(self.main)  # an event recorded on main; no host wait
        with torch.cuda.stream(self.side):
            yield

    def publish(self, tensor: torch.Tensor) -> torch.cuda.Event:
        tensor.record_stream(self.main)
        ready = torch.cuda.Event()
        ready.record(self.side)
        return ready

    def consume(self, ready: torch.cuda.Event) -> None:
        torch.cuda.current_stream(self.device).wait_event(ready)

    def adopt(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor.record_stream(self.side)
        return tensor

    def finish(self) -> None:
        torch.cuda.current_stream(self.device).wait_stream(self.side)


def make_encoder_stream(device: torch.device | str, side_stream: bool = True) -> EncoderStream:
    """A ``SideStream`` on a CUDA device (unless ``side_stream`` is False), else an
    ``InlineStream``."""
    device = torch.device(device)
    if device.type == "cuda" and side_stream:
        return SideStream(device)
    return InlineStream(device)


def training_device() -> torch.device:
    """This process's device: its CUDA GPU (``LOCAL_RANK`` under torchrun) when one is visible, else
    the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    # NCCL runs kernels of different communicators (the LLM's, the encoder's on the side stream) in
    # the order the host enqueued them, which is the same on every rank (hook_plan's docstring).
    # NCCL reads it once: a job that ran NCCL collectives before the trainer sets it itself
    os.environ.setdefault("NCCL_LAUNCH_ORDER_IMPLICIT", "1")
    index = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    torch.cuda.set_device(index)
    several = int(os.environ.get("WORLD_SIZE", "1")) > 1
    warn_unverified("training on several GPUs" if several else "training on one GPU")
    return torch.device("cuda", index)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``: the same tensor on the CPU; pinned and asynchronous to a GPU."""
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
