"""Hook points inside megatron-core's forward: around the tensor-parallel reductions of RowParallelLinear.

megatron-core has no hook API there; ``RowParallelLinear.forward`` calls the module-level functions
``reduce_from_tensor_model_parallel_region`` (all-reduce) and ``reduce_scatter_to_sequence_parallel_region``
(sequence parallel) of ``megatron.core.tensor_parallel.layers``. ``tp_collective_hook`` wraps those two
names for the duration of a ``with`` block, calling ``callback("before")`` and ``callback("after")``
around each reduction, and puts the originals back on exit. Unlike the CPU patches it applies on GPU too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from megatron_patches._cpu import MegatronPatchError

_REDUCTIONS = ("reduce_from_tensor_model_parallel_region", "reduce_scatter_to_sequence_parallel_region")


@contextlib.contextmanager
def tp_collective_hook(callback: Callable[[str], None]) -> Iterator[None]:
    from megatron.core.tensor_parallel import layers

    originals = {}
    for name in _REDUCTIONS:
        if not hasattr(layers, name):
            raise MegatronPatchError(f"megatron_patches: megatron.core.tensor_parallel.layers has no {name!r}; "
                                     "update megatron_patches.hooks for this megatron-core")
        originals[name] = getattr(layers, name)
    try:
        for name, original in originals.items():
            setattr(layers, name, _wrapped(original, callback))
        yield
    finally:
        for name, original in originals.items():
            setattr(layers, name, original)


def _wrapped(original: Callable[..., Any], callback: Callable[[str], None]) -> Callable[..., Any]:
    def reduction(*args: Any, **kwargs: Any) -> Any:
        callback("before")
        out = original(*args, **kwargs)
        callback("after")
        return out

    return reduction


@contextlib.contextmanager
def warmup_override(warmup_of_stage: Callable[[int], int]) -> Iterator[None]:
    """Run the interleaved 1F1B schedule with our warm-up count per pipeline stage (paper Fig. 12).

    megatron-core computes it in ``schedules.get_pp_rank_microbatches``; we keep its other results and
    replace the number of warm-up forwards. The non-interleaved schedule computes it inline and is not
    affected.
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import schedules

    original = getattr(schedules, "get_pp_rank_microbatches", None)
    if original is None:
        raise MegatronPatchError("megatron_patches: megatron.core.pipeline_parallel.schedules has no "
                                 "'get_pp_rank_microbatches'; update megatron_patches.hooks for this megatron-core")

    def adjusted(num_microbatches: int, num_model_chunks: int, *args: Any, **kwargs: Any) -> tuple:
        total, _, _, _ = original(num_microbatches, num_model_chunks, *args, **kwargs)
        communicator = kwargs.get("p2p_communicator")
        stage = communicator.pp_group.rank() if communicator is not None else \
            parallel_state.get_pipeline_model_parallel_rank()
        warmup = min(warmup_of_stage(stage), total)
        return total, warmup == total, warmup, total - warmup

    schedules.get_pp_rank_microbatches = adjusted
    try:
        yield
    finally:
        schedules.get_pp_rank_microbatches = original
