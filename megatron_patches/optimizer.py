"""megatron-core's optimizer checkpoint state where torch's own optimizers stand in for apex / TE.

Without apex or transformer-engine (the CPU, and any GPU job without them) megatron-core steps
torch's ``AdamW`` / ``SGD``, which keep the step count per parameter and create their state lazily
at the first update. Its checkpoint code assumes otherwise in three places, handled here:

- ``DistributedOptimizer.state_dict`` (which ``sharded_state_dict`` calls, for saving and for
  loading) asserts that it finds exactly one step count in the state: before the first update (a
  fresh job about to load, or fp16 skipping its first updates on overflow) there is none.
  ``prepare_state`` gives every parameter the state torch's optimizer starts from (step 0, zero
  moments), which its next update treats exactly as no state;
- ``DistributedOptimizer.load_state_dict`` puts a ``step`` into every parameter's state and then, in
  the fully reshardable format, copies into each state entry from the loaded tensors, which have no
  ``step`` (``load_state`` lets the step keep its value); the step tensor it puts there is one
  shared by all parameters, which torch's Adam then increments once per parameter: ``set_step``
  gives each its own;
- the fully reshardable format gathers a distributed part's state over a gloo data-parallel group,
  which megatron-core does not create for a part built on groups of its own (the encoder's): the
  caller hands one to ``use_gloo_group``;
- Megatron-LM's ``--ckpt-format torch`` resume of the distributed optimizer
  (``checkpointing.load_checkpoint``: ``load_state_dict``, then ``load_parameter_state``) reaches
  ``DistributedOptimizer.load_parameter_state_from_dp_zero``, which fails on every rank with torch's
  optimizers: ``dp_zero_load_patches`` (see ``_dp_zero_load``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from torch.distributed import ProcessGroup

from megatron_patches.lookup import Patch, require


def parts(optimizer: Any) -> list[Any]:
    """The parts of a megatron-core (chained) optimizer that hold state: stubs (a frozen encoder
    stage, nothing to train on this rank) left out."""
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    return [part for part in chained if not getattr(part, "is_stub_optimizer", False)]


def prepare_state(part: Any) -> None:
    """Give every parameter of ``part`` without state the one torch's optimizer starts from."""
    inner = part.optimizer
    adam = isinstance(inner, (torch.optim.Adam, torch.optim.AdamW))
    for group in inner.param_groups:
        for param in group["params"]:
            state = inner.state[param]
            if "step" not in state:
                state["step"] = torch.tensor(0.0)
            if adam and "exp_avg" not in state:
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)


def step_count(part: Any) -> int:
    """The number of updates ``part`` took (every parameter took the same)."""
    steps = {int(state["step"]) for state in part.optimizer.state.values() if "step" in state}
    if len(steps) > 1:
        raise ValueError(
            f"the optimizer's parameters took different numbers of updates: {sorted(steps)}"
        )
    return steps.pop() if steps else 0


def set_step(part: Any, step: int) -> None:
    """Every parameter of ``part`` has taken ``step`` updates, each with a step tensor of its
    own."""
    for state in part.optimizer.state.values():
        state["step"] = torch.tensor(float(step))


@contextlib.contextmanager
def _step_kept(part: DistributedOptimizer) -> Iterator[None]:
    """Within the block, ``part._set_main_param_and_optimizer_states`` leaves a parameter's step as
    it is when the loaded tensors have none (megatron-core copies into every entry of the state,
    ``step`` included, from tensors that hold only the parameter and the moments)."""
    original = part._set_main_param_and_optimizer_states

    def set_states(model_param: torch.nn.Parameter, tensors: dict[str, torch.Tensor]) -> None:
        current = part._get_main_param_and_optimizer_states(model_param)
        if "step" in current and "step" not in tensors:
            tensors = {**tensors, "step": current["step"].clone()}
        original(model_param, tensors)

    part._set_main_param_and_optimizer_states = set_states  # this object only, for the block
    try:
        yield
    finally:
        del part._set_main_param_and_optimizer_states


def load_state(part: Any, state_dict: dict[str, Any]) -> None:
    """``part.load_state_dict(state_dict)``, the step of each parameter's state left to
    ``set_step``."""
    if not isinstance(part, DistributedOptimizer):
        part.load_state_dict(state_dict)
        return
    with _step_kept(part):
        part.load_state_dict(state_dict)


def _dp_zero_load(original: Callable[..., None]) -> Callable[..., None]:
    """``DistributedOptimizer.load_parameter_state_from_dp_zero`` as its siblings
    ``load_parameter_state_from_fully_reshardable`` / ``_fs_model_space`` would run it.

    Works around megatron-core 0.16.1 (``megatron/core/optimizer/distrib_optimizer.py``, unchanged
    on Megatron-LM's main as of 2026-08-22), where the loader of Megatron-LM's ``--ckpt-format
    torch`` checkpoints (``distrib_optim.pt``, through ``checkpointing.load_checkpoint``) fails on
    every rank: in fp32 with any optimizer, in bf16 whenever torch's ``Adam`` stands in for apex /
    transformer-engine (``HAVE_APEX_OR_TE`` false: the CPU, a GPU without them):

    - it lacks the ``@torch.no_grad()`` of its siblings (l. 1806, 2069), so
      ``_set_main_param_and_optimizer_states`` copies in grad mode (l. 940); in fp32 a main
      parameter is a slice of the model parameter itself (l. 421), a view of a leaf that requires
      grad: "a view of a leaf Variable that requires grad is being used in an in-place operation".
      Run under ``torch.no_grad()`` here;
    - ``load_state_dict``, which Megatron-LM calls first, put a ``step`` into every parameter's
      state (l. 818-825), and ``_set_main_param_and_optimizer_states`` copies every entry of that
      state from the loaded tensors, which hold only the parameter and the moments: ``KeyError:
      'step'`` (bf16; fp32 fails on the first point before). ``_step_kept`` leaves the step as
      loaded;
    - that step is one tensor shared by every parameter's state, which torch's ``Adam`` increments
      once per parameter at each update, so the bias corrections after the resume are not the
      uninterrupted run's: each parameter gets a copy of its own afterwards.
    """

    @functools.wraps(original)
    def load(self: DistributedOptimizer, *args: Any, **kwargs: Any) -> None:
        with torch.no_grad(), _step_kept(self):
            original(self, *args, **kwargs)
        for state in self.optimizer.state.values():
            if "step" in state:
                state["step"] = state["step"].clone()

    return load


def dp_zero_load_patches() -> list[Patch]:
    """The distributed optimizer's ``--ckpt-format torch`` load fixed for torch's optimizers
    (``_dp_zero_load``)."""
    name = "load_parameter_state_from_dp_zero"
    return [Patch(DistributedOptimizer, name, _dp_zero_load(require(DistributedOptimizer, name)))]


def use_gloo_group(part: Any, group: ProcessGroup) -> None:
    """The gloo group a distributed part gathers its state over when checkpointing."""
    if isinstance(part, DistributedOptimizer):
        part.data_parallel_group_gloo = group
