"""Hook points inside megatron-core's forward: around the tensor-parallel reductions of its layers.

megatron-core has no hook API there; ``RowParallelLinear.forward`` and
``VocabParallelEmbedding.forward`` call the module-level functions
``reduce_from_tensor_model_parallel_region`` (all-reduce) and
``reduce_scatter_to_sequence_parallel_region`` (sequence parallel) of
``megatron.core.tensor_parallel.layers``. ``tp_collective_hook`` wraps those two names for the
duration of a ``with`` block and calls ``callback(edge, collective)`` with ``edge`` "before" /
"after" around each reduction. ``collective`` names what the reduction is, from the module running
it (forward pre/post hooks on the given modules): ``tp_ar_embed`` / ``tp_rs_embed`` for the
vocabulary-parallel embedding, ``tp_ar_attn`` / ``tp_rs_attn`` for the attention's output
projection, ``tp_ar_mlp`` / ``tp_rs_mlp`` for the MLP's second linear -- the cost model's kernel
names -- and None for a reduction outside those modules. Everything is put back on exit. Unlike the
CPU patches it applies on GPU too.

A row-parallel layer that does not reduce through those functions (transformer-engine's
``TERowParallelLinear`` reduces inside its own forward) is hooked by module instead: "before" when
its forward starts and "after" when it returns, so its hook points survive a transformer-engine
layer spec; encoder work hooked "before" such a reduction is then launched before the layer's GEMM
rather than between the GEMM and the reduction. ``by_module=True`` hooks every layer that way (tests
compare it with the function hooks on megatron-core's local spec).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch

from megatron_patches.lookup import MegatronPatchError

_REDUCTIONS = {
    "reduce_from_tensor_model_parallel_region": "ar",
    "reduce_scatter_to_sequence_parallel_region": "rs",
}


def _role(name: str, module: torch.nn.Module) -> str | None:
    """Which collective of the cost model a module's reduction is, by megatron-core's submodule
    names (the same in the local and the transformer-engine layer specs)."""
    from megatron.core.tensor_parallel.layers import VocabParallelEmbedding

    if isinstance(module, VocabParallelEmbedding):
        return "embed"
    leaf = name.rsplit(".", 1)[-1]
    # the layer itself, not a wrapper of the same name: it holds the weight
    if (
        leaf in ("linear_proj", "linear_fc2")
        and next(module.parameters(recurse=False), None) is not None
    ):
        return {"linear_proj": "attn", "linear_fc2": "mlp"}[leaf]
    return None


def _reduces_through_functions(module: torch.nn.Module) -> bool:
    from megatron.core.tensor_parallel.layers import RowParallelLinear, VocabParallelEmbedding

    return isinstance(module, (RowParallelLinear, VocabParallelEmbedding))


@contextlib.contextmanager
def tp_collective_hook(
    callback: Callable[[str, str | None], None],
    modules: list[torch.nn.Module] = (),
    by_module: bool = False,
) -> Iterator[None]:
    from megatron.core.tensor_parallel import layers

    originals = {}
    for name in _REDUCTIONS:
        if not hasattr(layers, name):
            raise MegatronPatchError(
                f"megatron_patches: megatron.core.tensor_parallel.layers has no {name!r}; "
                "update megatron_patches.hooks for this megatron-core"
            )
        originals[name] = getattr(layers, name)
    running: list[
        str | None
    ] = []  # roles of the hooked modules whose forward is running, innermost last
    handles = []
    for root in modules:
        for name, module in root.named_modules():
            role = _role(name, module)
            if role is None:
                continue
            if by_module or not _reduces_through_functions(module):
                collective = f"tp_{'rs' if _sequence_parallel(module) else 'ar'}_{role}"
                handles.append(
                    module.register_forward_pre_hook(partial(_edge, callback, "before", collective))
                )
                handles.append(
                    module.register_forward_hook(partial(_edge, callback, "after", collective))
                )
            else:
                handles.append(module.register_forward_pre_hook(partial(_enter, running, role)))
                handles.append(module.register_forward_hook(partial(_leave, running)))
    try:
        if not by_module:
            for name, original in originals.items():
                setattr(layers, name, _wrapped(original, _REDUCTIONS[name], running, callback))
        yield
    finally:
        for name, original in originals.items():
            setattr(layers, name, original)
        for handle in handles:
            handle.remove()


def _sequence_parallel(module: torch.nn.Module) -> bool:
    """Whether the layer reduce-scatters (sequence parallelism) rather than all-reduces its output:
    the attributes megatron-core's and transformer-engine's layers decide it by."""
    if hasattr(module, "reduce_scatter_embeddings"):  # VocabParallelEmbedding
        return bool(module.reduce_scatter_embeddings)
    return bool(getattr(module, "sequence_parallel", False))


def _edge(callback: Callable[[str, str | None], None], edge: str, collective: str, *_: Any) -> None:
    # returns None: a forward hook's return value would replace the output
    callback(edge, collective)


def _enter(running: list[str], role: str, *_: Any) -> None:
    running.append(role)


def _leave(running: list[str], *_: Any) -> None:
    running.pop()  # a forward hook's return value would replace the module's output


def _wrapped(
    original: Callable[..., Any],
    kind: str,
    running: list[str | None],
    callback: Callable[[str, str | None], None],
) -> Callable[..., Any]:
    def reduction(*args: Any, **kwargs: Any) -> Any:
        collective = f"tp_{kind}_{running[-1]}" if running else None
        callback("before", collective)
        out = original(*args, **kwargs)
        callback("after", collective)
        return out

    return reduction


@contextlib.contextmanager
def warmup_override(warmup_of_stage: Callable[[int], int]) -> Iterator[None]:
    """Run the interleaved 1F1B schedule with our warm-up count per pipeline stage (paper Fig. 12).

    megatron-core computes it in ``schedules.get_pp_rank_microbatches``; we keep its other results
    and replace the number of warm-up forwards. The non-interleaved schedule computes it inline and
    is not affected.
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import schedules

    original = getattr(schedules, "get_pp_rank_microbatches", None)
    if original is None:
        raise MegatronPatchError(
            "megatron_patches: megatron.core.pipeline_parallel.schedules has no "
            "'get_pp_rank_microbatches'; update megatron_patches.hooks for this megatron-core"
        )

    def adjusted(num_microbatches: int, num_model_chunks: int, *args: Any, **kwargs: Any) -> tuple:
        total, _, _, _ = original(num_microbatches, num_model_chunks, *args, **kwargs)
        communicator = kwargs.get("p2p_communicator")
        stage = (
            communicator.pp_group.rank()
            if communicator is not None
            else parallel_state.get_pipeline_model_parallel_rank()
        )
        warmup = min(warmup_of_stage(stage), total)
        return total, warmup == total, warmup, total - warmup

    schedules.get_pp_rank_microbatches = adjusted
    try:
        yield
    finally:
        schedules.get_pp_rank_microbatches = original
