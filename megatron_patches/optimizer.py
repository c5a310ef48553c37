"""A rank's state of a megatron-core ``ChainedOptimizer``, taken and restored exactly.

megatron-core's ``state_dict`` of a ``DistributedOptimizer`` leaves out the parameter state (main
parameters and Adam moments), which its legacy checkpoints write separately;
``get_parameter_state_dp_reshardable`` / ``load_parameter_state_from_dp_reshardable`` are the per-rank
form of it. Used as they stand, four things go wrong, handled here:

- the getter returns views of the live state, so it is cloned;
- the loader skips entries marked ``padding`` (as its sharded checkpoints mark them), and the getter
  marks none, so every entry is marked unpadded;
- with torch's Adam (no apex / transformer-engine), ``DistributedOptimizer.load_state_dict`` gives
  every parameter's state one shared ``step`` tensor, which torch's Adam then increments once per
  parameter on the next step: every parameter gets its own copy before the loaded state goes in;
- before its first update (fp16 skips the updates whose gradients overflow, as the first steps from
  Megatron's initial loss scale of 2**32 do) torch's Adam has no state, and
  ``DistributedOptimizer.state_dict`` asserts that it finds one step count: such a part's state is its
  loss scale alone, and its main parameters are the model's (the caller reloads them from the weights).
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.optimizer import ChainedOptimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer


def optimizer_state(optimizer: ChainedOptimizer) -> dict[str, Any]:
    """This rank's whole optimizer state: megatron's ``state_dict`` and each distributed part's shard."""
    common, parameters = zip(*map(_part_state, optimizer.chained_optimizers), strict=True)
    return {"common": _cloned(list(common)), "parameters": _cloned(list(parameters))}


def _part_state(part: Any) -> tuple[dict[str, Any] | None, dict[Any, Any] | None]:
    """A part's ``state_dict`` and, for a distributed part, its parameter shard (None where it has none)."""
    if _is_stub(part):
        return None, None
    if not isinstance(part, DistributedOptimizer):
        return part.state_dict(), None
    if not part.optimizer.state:  # before the first update: the loss scale is all it has
        return {BEFORE_FIRST_UPDATE: None if part.grad_scaler is None else part.grad_scaler.state_dict()}, None
    return part.state_dict(), part.get_parameter_state_dp_reshardable()


def load_optimizer_state(optimizer: ChainedOptimizer, state: dict[str, Any]) -> None:
    """Restore what ``optimizer_state`` took, into an optimizer built for the same model and plan."""
    parts = optimizer.chained_optimizers
    if len(parts) != len(state["common"]):
        raise ValueError(f"the saved optimizer has {len(state['common'])} parts, this one {len(parts)}")
    for part, common, parameters in zip(parts, state["common"], state["parameters"]):
        if common is None:
            continue
        if BEFORE_FIRST_UPDATE in common:
            if part.grad_scaler is not None:
                part.grad_scaler.load_state_dict(common[BEFORE_FIRST_UPDATE])
            continue
        part.load_state_dict(common)
        if parameters is None:
            continue
        for param_state in part.optimizer.state.values():
            if "step" in param_state:
                param_state["step"] = param_state["step"].clone()
        _mark_unpadded(parameters)
        with torch.no_grad():  # the loader copies into views of leaf parameters
            part.load_parameter_state_from_dp_reshardable(parameters)


BEFORE_FIRST_UPDATE = "before_first_update"  # marks a part saved before its first update: its loss-scale state


def _is_stub(part: Any) -> bool:
    """A part with nothing to train on this rank (a frozen encoder stage): no state of its own."""
    return getattr(part, "is_stub_optimizer", False)


def _mark_unpadded(parameters: dict[Any, Any]) -> None:
    for key, by_dtype in parameters.items():
        if isinstance(key, int):  # a gradient buffer's index; the other keys are bucket sizes
            for buckets in by_dtype.values():
                for bucket in buckets:
                    for entry in bucket:
                        entry["padding"] = False


def _cloned(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {key: _cloned(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_cloned(value) for value in tree)
    return tree
