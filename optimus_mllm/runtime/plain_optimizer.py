"""The Optimus optimizer's state in the layout of Megatron's own optimizer over the user's model.

Without ``--optimus-schedule`` Megatron-LM builds one optimizer over its chunks, the first chunk
holding the vision model and projector, and a checkpoint stores that optimizer's state by position
(its parameter groups in the order of ``named_parameters``). With the flag the vision parameters
are not in the chunks: the encoder stage holds them under its own plan, and the chained optimizer
(``runtime.optimizer.chain_encoder_optimizer``) has an LLM part and an encoder part. So that a
checkpoint reads the same either way, the flag saves and loads through a *plain* optimizer, built
only for the save or the load by Megatron's own ``get_megatron_optimizer`` over the chunks with
the user's vision modules in place, and moves the state between the two:

- the LLM's parameters are the same tensors in both: their state (and fp32 main parameters under
  --bf16/--fp16) goes across by identity;
- the vision model's and projector's state goes between the encoder stage's parameters and the
  user's modules' as their weights do (``sharded_state.copy_sharded_state``): each state entry
  (``exp_avg``, ``exp_avg_sq``, the main parameters...) is copied with the parameters' sharded
  state dicts, each piece pointed at the same slice of the entry as it holds of its weight (the
  weights themselves are left alone: giving a bf16 weight fp32 data, even for a moment, would drop
  the gradient hooks of megatron-core's DDP with its autograd accumulator);
- ``step``: the optimizer steps every parameter together, so the vision parameters take the step
  of this rank's LLM parameters.

The non-distributed optimizer's state moves here; the distributed one's goes through whole tensors
into the same move (``plain_distributed_optimizer``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.mapping import ShardedStateDict
from megatron.core.optimizer import (
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    MegatronOptimizer,
)
from torch import Tensor, nn

from optimus_mllm.errors import OptimusError
from optimus_mllm.runtime.optimizer import optimizer_parts
from optimus_mllm.runtime.sharded_state import copy_sharded_state, sharded_tensors

MAIN = "main parameters"  # the fp32 copies of --bf16/--fp16 weights, moved like a state entry
STEP = "step"

StateDicts = Callable[[], ShardedStateDict]  # a part's sharded state dict, built when called


@dataclass(frozen=True)
class OptimizerView:
    """An optimizer's state as ``move_state`` reads and writes it."""

    params: dict[Tensor, Tensor]  # each weight it steps -> the tensor its state is kept under
    states: dict[Tensor, dict[str, Any]]  # that tensor -> its state entries (``step``, moments)


def optimizer_view(optimizer: MegatronOptimizer) -> OptimizerView:
    """A non-distributed megatron-core optimizer's own tensors and state (writes go into it)."""
    return OptimizerView(_optimizer_params(optimizer), _torch_states(optimizer))


def plain_optimizer(
    build: Callable[[list[nn.Module]], MegatronOptimizer], chunks: list[nn.Module]
) -> MegatronOptimizer:
    """Megatron's optimizer over ``chunks`` (``build(chunks)``), leaving the job's optimizer as it
    was: megatron-core's mixed-precision optimizer links each weight to its main parameter
    (``param.main_param``, read by attention's QK clipping), and those links stay the job's."""
    params = [p for chunk in chunks for p in chunk.parameters()]
    links = [getattr(p, "main_param", None) for p in params]
    try:
        return build(chunks)
    finally:
        for param, link in zip(params, links):
            if link is None:
                param.__dict__.pop("main_param", None)
            else:
                param.main_param = link


def chained_into_plain(
    chained: MegatronOptimizer,
    plain: MegatronOptimizer,
    encoder: StateDicts,
    vision: StateDicts,
) -> None:
    """Fill ``plain``'s state (Megatron's layout) from the chained optimizer's. Collective over the
    world.

    Args:
        chained: the job's optimizer (the LLM's part and the encoder stage's).
        plain: Megatron's optimizer over the chunks with the user's vision modules, just built.
        encoder: builds the encoder stage's sharded state dict
            (``sharded_state.encoder_sharded_state_dict``).
        vision: builds the user's vision modules' (``user_model.vision_sharded_state_dict``; ``{}``
            off the first stage).
    """
    move_state(
        optimizer_view(chained),
        optimizer_view(plain),
        encoder,
        vision,
        "the Optimus encoder -> the vision model",
    )
    copy_loss_scale(chained, plain)
    _copy_hyperparameters(chained, plain)


def plain_into_chained(
    plain: MegatronOptimizer,
    chained: MegatronOptimizer,
    vision: StateDicts,
    encoder: StateDicts,
) -> None:
    """Fill the chained optimizer's state from ``plain``'s (loaded from a checkpoint, or left as
    built where nothing was loaded). Collective over the world; the arguments as
    ``chained_into_plain``'s."""
    move_state(
        optimizer_view(plain),
        optimizer_view(chained),
        vision,
        encoder,
        "the vision model -> the Optimus encoder",
    )
    copy_loss_scale(plain, chained)


def move_state(
    source: OptimizerView,
    target: OptimizerView,
    source_vision: StateDicts,
    target_vision: StateDicts,
    what: str,
) -> None:
    """``source``'s state into ``target``'s: the weights both step by identity, the vision
    weights' (the encoder's on one side, the user's vision modules' on the other) by their sharded
    state dicts. Collective over the world."""
    source_params, target_params = source.params, target.params
    source_state, target_state = source.states, target.states
    step = None
    with torch.no_grad():
        for weight, main in target_params.items():
            held = source_params.get(weight)
            if held is None:
                continue  # a vision parameter: below
            if held is not main:
                main.copy_(held)
            state = source_state.get(held)
            if state:
                target_state[main] = dict(state)
                step = state.get(STEP, step)
    source_vision_params = {w: m for w, m in source_params.items() if w not in target_params}
    target_vision_params = {w: m for w, m in target_params.items() if w not in source_params}
    entries = _agreed_entries(source_state, source_vision_params.values())
    if step is not None:
        for main in target_vision_params.values():
            target_state[main] = {STEP: step.clone() if isinstance(step, Tensor) else step}
    mixed = any(w is not m for w, m in source_params.items()) or any(
        w is not m for w, m in target_params.items()
    )
    for entry in ([MAIN] if _agreed(mixed) else []) + entries:
        source_tensors = _entry_tensors(entry, source_vision_params, source_state, create=False)
        target_tensors = _entry_tensors(entry, target_vision_params, target_state, create=True)
        copy_sharded_state(
            _pointed_at(source_vision(), source_tensors),
            _pointed_at(target_vision(), target_tensors),
            f"{what} ({entry})",
        )


def _optimizer_params(optimizer: MegatronOptimizer) -> dict[Tensor, Tensor]:
    """Each weight that ``optimizer`` steps, and the tensor its state is kept under: its fp32 main
    parameter under --bf16/--fp16, else itself."""
    params: dict[Tensor, Tensor] = {}
    for part in optimizer_parts(optimizer):
        if isinstance(part, Float16OptimizerWithFloat16Params):
            if part.optimizer is None:
                continue
            for weights, mains in zip(part.float16_groups, part.fp32_from_float16_groups):
                params.update(zip(weights, mains))
            params.update((p, p) for group in part.fp32_from_fp32_groups for p in group)
        elif isinstance(part, FP32Optimizer):
            if part.optimizer is not None:
                params.update((p, p) for g in part.optimizer.param_groups for p in g["params"])
        else:
            raise OptimusError(
                "--optimus-schedule saves and loads the optimizer state of megatron-core's "
                "FP32Optimizer and Float16OptimizerWithFloat16Params, not of "
                f"{type(part).__name__}; checkpoint this job with --no-save-optim"
            )
    return params


def _torch_states(optimizer: MegatronOptimizer) -> dict[Tensor, dict[str, Any]]:
    """The state of every part's torch optimizer, by the tensor it is kept under, as one dict
    that writes each entry into the part that steps its tensor."""
    owners = [
        p.optimizer for p in optimizer_parts(optimizer) if getattr(p, "optimizer", None) is not None
    ]
    return _States(owners)


class _States(dict):
    """The torch optimizers' ``state`` dicts read and written as one, each entry in the optimizer
    that holds its tensor among its parameters."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        super().__init__()
        self.owner = {
            p: opt for opt in optimizers for group in opt.param_groups for p in group["params"]
        }
        for opt in optimizers:
            super().update(opt.state)

    def __setitem__(self, key: Tensor, value: dict[str, Any]) -> None:
        super().__setitem__(key, value)
        self.owner[key].state[key] = value


def _agreed_entries(states: dict[Tensor, dict[str, Any]], params: Iterable[Tensor]) -> list[str]:
    """The state entries, besides ``step``, that the source's vision parameters hold on any rank
    (each a tensor of its parameter's shape), in the same order on every rank."""
    names = set()
    for main in params:
        for name, value in states.get(main, {}).items():
            if name == STEP:
                continue
            if not isinstance(value, Tensor) or value.shape != main.shape:
                raise OptimusError(
                    f"--optimus-schedule cannot move the optimizer state entry '{name}' (not a "
                    "tensor of its parameter's shape) between the encoder and the vision model"
                )
            names.add(name)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sorted(names))
    return sorted({name for held in gathered for name in held})


def _agreed(flag: bool) -> bool:
    """``flag`` on any rank."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, flag)
    return any(gathered)


def _entry_tensors(
    entry: str,
    params: dict[Tensor, Tensor],
    states: dict[Tensor, dict[str, Any]],
    create: bool,
) -> dict[Tensor, Tensor]:
    """Each weight of ``params`` and its tensor of ``entry``: its main parameter, or its state
    entry (zeros where absent, stored in its state where ``create``)."""
    tensors = {}
    for weight, main in params.items():
        if entry == MAIN:
            tensors[weight] = main
        elif not create:  # a state the source lacks reads as zeros, as a fresh optimizer's
            tensors[weight] = states.get(main, {}).get(entry, torch.zeros_like(main))
        else:
            if main not in states:
                states[main] = {}
            tensors[weight] = states[main].setdefault(entry, torch.zeros_like(main))
    return tensors


def _pointed_at(state: ShardedStateDict, tensors: dict[Tensor, Tensor]) -> ShardedStateDict:
    """The pieces of ``state`` that hold (a slice of) a weight of ``tensors``, each pointed at the
    same slice of that weight's tensor; the other pieces (weights the optimizer does not step) are
    left out."""
    spans: dict[int, list[tuple[Tensor, Tensor]]] = {}
    for weight, tensor in tensors.items():
        if tensor.shape != weight.shape or tensor.stride() != weight.stride():
            raise OptimusError(
                "--optimus-schedule: an optimizer state of shape "
                f"{tuple(tensor.shape)}, strides {tensor.stride()}, is not laid out as its weight "
                f"({tuple(weight.shape)}, {weight.stride()})"
            )
        spans.setdefault(weight.untyped_storage().data_ptr(), []).append((weight, tensor))
    pointed: ShardedStateDict = {}
    for key, pieces in sharded_tensors(state).items():
        for i, piece in enumerate(pieces):
            data = piece.data
            offset = data.storage_offset()
            for weight, tensor in spans.get(data.untyped_storage().data_ptr(), []):
                start = offset - weight.storage_offset()
                if 0 <= start < max(weight.numel(), 1):
                    piece.data = tensor.as_strided(
                        data.shape, data.stride(), tensor.storage_offset() + start
                    )
                    pointed[f"{key}#{i}"] = piece
                    break
    return pointed


def copy_loss_scale(source: MegatronOptimizer, target: MegatronOptimizer) -> None:
    """The loss scale (fp16) of ``source``'s first part into ``target``'s."""
    scalers = [getattr(optimizer_parts(o)[0], "grad_scaler", None) for o in (source, target)]
    scalers = [getattr(s, "owner", s) for s in scalers]  # a OneLossScaleOptimizer part's owner
    if all(s is not None for s in scalers):
        scalers[1].load_state_dict(scalers[0].state_dict())


def _copy_hyperparameters(source: MegatronOptimizer, target: MegatronOptimizer) -> None:
    """Each of ``target``'s parameter groups takes the learning rate, weight decay... of the group
    of ``source`` that steps one of its weights (the LR schedule's current values)."""
    source_mains = _optimizer_params(source)
    weights = {main: weight for weight, main in _optimizer_params(target).items()}
    groups = {p: group for group in source.param_groups for p in group["params"]}
    for group in target.param_groups:
        held = (source_mains.get(weights.get(p)) for p in group["params"])
        source_group = next((groups[p] for p in held if p is not None), None)
        if source_group is not None:
            group.update({k: v for k, v in source_group.items() if k != "params"})
