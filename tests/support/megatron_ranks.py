"""What a test rank (``distributed_utils.run_distributed``) sets up of megatron-core around the
layers it builds: its global state, a one-rank group, the causal mask its local attention takes.

megatron-core's local attention reads ``parallel_state`` (its memory buffer) and the RNG tracker
even when every group a layer uses is passed in, so ``megatron_state`` initialises both at one rank
of TP, under the CPU patches, and destroys them after.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

import megatron_patches


@contextlib.contextmanager
def megatron_state() -> Iterator[None]:
    """megatron-core's ``parallel_state`` at one rank of TP and its RNG tracker seeded (0), under
    ``megatron_patches``; destroyed on leaving."""
    with megatron_patches.patched():
        parallel_state.initialize_model_parallel()
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()


def group_of_this_rank() -> dist.ProcessGroup:
    """A group of this rank alone (every rank creates every rank's: ``new_group`` is collective)."""
    return [dist.new_group([rank]) for rank in range(dist.get_world_size())][dist.get_rank()]


def causal_mask(seq: int) -> torch.Tensor:
    """megatron-core's attention mask for causal attention, ``[1, 1, seq, seq]``, True masked out
    (its default one is made on the GPU)."""
    return torch.ones(seq, seq, dtype=torch.bool).triu(1)[None, None]
