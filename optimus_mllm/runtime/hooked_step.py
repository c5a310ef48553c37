"""One training step of megatron-core's schedule under a hook plan, as both routes run it.

optimus-train's ``Trainer.train_step`` and the Megatron-LM seams' ``OptimusInMegatron._step`` each
hand megatron-core's ``forward_backward_func`` to a ``HookedStep``: the step's ``OptimusStep`` (the
encoder's ops at the hook points, A_i in and G_i out), the ``pre`` hook, the schedule under the
TP-collective hook (``megatron_patches.hooks``) and the LLM order's warm-up, the ``post`` hook, the
LLM P2P channels drained and the encoder's last messages settled. What differs between the routes
stays with them: where the images come from, the forward step, gradient finalisation and the
optimizer.

Without an encoder under the encoder plan (the Megatron-style baselines) the same step runs with
a ``HookDriver`` that only observes the LLM's ops, so ``unplanned`` still counts megatron-core's
collectives against the order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from megatron_patches.hooks import tp_collective_hook, warmup_override
from megatron_patches.p2p import ChannelP2PCommunicator
from optimus_mllm.runtime.executor import HookDriver, ImagesPerMicrobatch
from optimus_mllm.runtime.hook_plan import POST, PRE
from optimus_mllm.runtime.optimus_encoder import (
    ImageSource,
    OptimusEncoder,
    OptimusStep,
    schedule_groups,
)
from optimus_mllm.runtime.streams import EncoderStream
from optimus_mllm.scheduler.artifact_format import LLMOp


@dataclass(frozen=True)
class LLMOrder:
    """This LLM stage's order for one step: a schedule artifact's, or megatron-core's own."""

    op_order: tuple[LLMOp, ...]  # this stage's LLM ops, in the order megatron-core runs them
    warmup: Sequence[int]  # per pipeline stage: the forwards before its first backward
    collectives: dict[int, list[str]]  # LLM op -> the TP collectives its kernels plan


@dataclass(frozen=True)
class EncoderSide:
    """What the encoder's ops need for one step under Optimus."""

    optimus: OptimusEncoder
    iteration: int
    images: ImageSource
    stream: EncoderStream
    # the images of each LLM microbatch this step where they vary; None: one per sample
    images_per_microbatch: ImagesPerMicrobatch | None = None


class HookedStep:
    """One training step: megatron-core's schedule with this stage's LLM ops observed at the hook
    points and, given an ``EncoderSide``, the encoder's ops run there (``OptimusStep``)."""

    def __init__(
        self,
        order: LLMOrder,
        stage: int,
        wait_for_input: Callable[[LLMOp], None] | None,
        encoder: EncoderSide | None = None,
    ):
        self.order = order
        self.optimus: OptimusStep | None = None
        if encoder is None:
            self.driver = HookDriver(order.op_order, None, wait_for_input, order.collectives)
        else:
            self.optimus = OptimusStep(
                encoder.optimus,
                encoder.iteration,
                encoder.images,
                encoder.stream,
                order.op_order,
                stage,
                order.collectives,
                wait_for_input,
                encoder.images_per_microbatch,
            )
            self.driver = self.optimus.driver

    def run(
        self,
        schedule: Callable[..., Any],
        language_models: list[nn.Module],
        communicator: ChannelP2PCommunicator | None,
        **schedule_kwargs: Any,
    ) -> Any:
        """megatron-core's ``schedule`` (a ``forward_backward_func``) for one training step, given
        its arguments but ``forward_only``; returns what it returns. ``language_models``: the
        ``GPTModel`` chunks whose TP collectives the hook plan names."""
        warmup = self.order.warmup
        self.driver.fire(PRE)
        with (
            tp_collective_hook(self.driver.on_reduction, language_models),
            warmup_override(lambda s: warmup[s]),
        ):
            outputs = schedule(
                forward_only=False, **schedule_kwargs, **schedule_groups(communicator)
            )
        self.driver.fire(POST)
        if communicator is not None:
            communicator.finish()
        if self.optimus is not None:
            self.optimus.finish()
        return outputs
