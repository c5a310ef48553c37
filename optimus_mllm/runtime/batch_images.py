"""Where a user's batches hold the images: the batch entry their forward gives ``vision_model``.

Under the flag the encoder reads a step's images from the batches the data iterator yields, ahead
of the user's ``forward_step``, so it must know under which key they are. Megatron-LM's multimodal
datasets use ``"image"``, but a user's dataset may not; rather than a second flag, the first step
runs the user's forward on the first stage's microbatches (eval mode, no gradients, the generators'
states restored) with a hook on ``vision_model``, one at a time until the model calls it (a
text-only microbatch does not), and takes the batch entry equal to what the hook saw. A forward
that transforms the images before ``vision_model`` has no such entry and is refused: the encoder
could not apply that transformation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from megatron.core import parallel_state
from torch import nn

from optimus_mllm.runtime.verdicts import heard_by_every_rank


def find_image_key(
    first_chunk: nn.Module | None,
    in_place: Callable[[], Any],
    forward: Callable[[Iterator[Any]], Any] | None,
    batches: list[Any],
) -> str:
    """The key under which every rank's batches hold the images; ``OptimusError`` on every rank
    where the first stage's forward gives ``vision_model`` no batch entry as it is, or calls it on
    none of the step's microbatches.

    Args:
        first_chunk: the first stage's first chunk (its vision modules put back by ``in_place``);
            None elsewhere.
        in_place: a context manager putting the user's vision modules back in ``first_chunk``.
        forward: the user's ``forward_step`` on the first stage's first chunk (as megatron-core's
            schedule passes it), given a data iterator; None off the first stage.
        batches: the step's microbatches as the data iterator yields them, tried in order (Nones
            on a rank that reads no data: Megatron's ``get_batch`` broadcasts each from TP rank 0,
            so every rank of the TP group stops at the same one).
    """
    found: tuple[str | None, str | None] | None = None  # (key, problem)
    if first_chunk is not None and forward is not None:
        found = _key_on_first_stage(first_chunk, in_place, forward, batches)
    no_images = (
        "the model's forward step called vision_model on none of the first step's microbatches, "
        "so the Optimus encoder cannot tell which batch entry holds the images; run the job "
        "without --optimus-schedule"
    )
    keys = sorted(set(heard_by_every_rank(found, no_images)))
    assert len(keys) == 1, f"the first stage's TP rank 0 decides the image key, got {keys}"
    return keys[0]


def _key_on_first_stage(
    first_chunk: nn.Module,
    in_place: Callable[[], Any],
    forward: Callable[[Iterator[Any]], Any],
    batches: list[Any],
) -> tuple[str | None, str | None] | None:
    """(key, None) on the rank that read the batch, (None, problem) where no entry is what
    ``vision_model`` got; None on its TP peers, and where no microbatch called it (another
    data-parallel rank's may have)."""
    given: list[torch.Tensor] = []

    def record(_: nn.Module, inputs: tuple[Any, ...]) -> None:
        given.append(inputs[0].detach())

    was_training = first_chunk.training
    first_chunk.eval()
    batch = None
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]), in_place():
            hook = first_chunk.vision_model.register_forward_pre_hook(record)
            try:
                for batch in batches:
                    forward(iter([batch]))
                    if given:
                        break
            finally:
                hook.remove()
    finally:
        first_chunk.train(was_training)
    if not given or parallel_state.get_tensor_model_parallel_rank() != 0:
        return None  # Megatron's get_batch reads the data on TP rank 0 only
    if not isinstance(batch, dict):
        return None, (
            f"the data iterator's batches are {type(batch).__name__}s; the Optimus encoder reads "
            "the images from a batch that is a dict (as Megatron-LM's multimodal datasets give "
            "it); run the job without --optimus-schedule"
        )
    tensors = {key: value for key, value in batch.items() if isinstance(value, torch.Tensor)}
    images = given[0]
    keys = [key for key, value in tensors.items() if _same(value, images)]
    if not keys:
        return None, (
            f"the model's forward step gives vision_model a tensor that is none of the batch's "
            f"entries ({sorted(tensors)}) as the data iterator yields them; the Optimus encoder "
            "takes the images from the batch: make the dataset give them as vision_model takes "
            "them, or run the job without --optimus-schedule"
        )
    return keys[0], None


def _same(value: torch.Tensor, images: torch.Tensor) -> bool:
    """The batch entry is what ``vision_model`` got, up to the float cast and device move that
    Megatron's ``get_batch`` applies."""
    if value.shape != images.shape or not (value.is_floating_point() or images.is_floating_point()):
        return False
    return torch.equal(value.to(images.device, images.dtype), images)
