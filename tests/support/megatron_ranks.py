"""What a test rank sets up of megatron-core around the layers it builds: its global state and a
one-rank group (the causal mask its local attention takes is ``runtime.llm.causal_mask``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

import megatron_patches


@contextlib.contextmanager
def megatron_state(tensor_model_parallel_size: int = 1) -> Iterator[None]:
    """megatron-core's ``parallel_state`` and RNG tracker (seed 0), under ``megatron_patches``:
    its local attention reads them (a memory buffer) even when every group is passed in."""
    with megatron_patches.patched():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size)
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()


def group_of_this_rank() -> dist.ProcessGroup:
    """A group of this rank alone (every rank creates every rank's: ``new_group`` is collective)."""
    return [dist.new_group([rank]) for rank in range(dist.get_world_size())][dist.get_rank()]
