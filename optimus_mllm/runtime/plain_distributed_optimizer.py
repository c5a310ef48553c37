"""The Optimus optimizer's state in the layout of Megatron's *distributed* optimizer over the user's
model.

Megatron-LM's distributed optimizer (ZeRO-1) shards its state by the chunks' DDP buffers: each
data-parallel rank steps one contiguous range of each bucket, and ``--ckpt-format torch`` saves
that state bucket by bucket from data-parallel rank 0 (``distrib_optim.pt``, megatron-core's
``get_parameter_state_dp_zero``). Without ``--optimus-schedule`` the first chunk's buffers hold the
vision model and projector among the LLM's parameters; with it they do not (the encoder stage holds
them, under its own plan and DDP), so every range differs. The flag therefore saves and loads
through the plain run's distributed optimizer itself, built for one save or load
(``plain_distributed_optimizer``):

- megatron-core's DDP over each chunk with the user's vision modules in place, and Megatron's own
  ``get_megatron_optimizer`` over those: the buckets, ranges and parameter groups of the run
  without the flag. Built with the distributed optimizer, DDP points each parameter's data and
  gradient into its own buffers and hooks its gradient accumulator, so it is built over stand-ins
  of the chunks' parameters (their shapes, dtypes and attributes, in the chunks' modules only while
  it is built): the job's weights, gradients and hooks stay as they are;
- the state moves between the two through whole tensors: each optimizer's main parameters and Adam
  moments gathered over its data-parallel group into one fp32 tensor per parameter, moved as
  ``plain_optimizer.move_state`` moves a non-distributed optimizer's (the LLM's weights by
  identity, the vision model's by their sharded state dicts), then each rank keeps its range.

Memory: while it saves or loads, a rank holds the stand-ins and their DDP buffers, and three whole
fp32 tensors per parameter of its chunks on each side: a spike at checkpoints only, freed after.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from itertools import accumulate
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel
from megatron.core.optimizer import ChainedOptimizer, MegatronOptimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import param_group_identifier_keys
from torch import Tensor, nn

from megatron_patches.optimizer import parts, prepare_state, set_step, step_count
from optimus_mllm.errors import OptimusError
from optimus_mllm.runtime.optimizer import optimizer_parts
from optimus_mllm.runtime.plain_optimizer import (
    OptimizerView,
    StateDicts,
    copy_loss_scale,
    move_state,
)

KEYS = ("param", "exp_avg", "exp_avg_sq")  # a parameter's state in ``distrib_optim.pt``
STEP = "step"


class CheckpointOptimizer(ChainedOptimizer):
    """Megatron's distributed optimizer over the chunks with the user's vision modules, for one save
    or load. Megatron-LM saves and loads it as it does its own (a ``ChainedOptimizer`` of one part
    reads and writes that part's state alone); a ``distrib_optim.pt`` is checked before it is read,
    and ``loaded`` says whether one was."""

    def __init__(self, optimizer: MegatronOptimizer, stand_ins: dict[Tensor, Tensor]):
        super().__init__(optimizer_parts(optimizer))
        self.real = stand_ins  # each stand-in -> the chunks' parameter it stands for
        self.loaded = False

    def load_parameter_state(self, filename: str, *, update_legacy_format: bool = False) -> None:
        """Megatron-LM's ``--ckpt-format torch`` load of ``filename``, refused in one line on every
        rank where data-parallel rank 0 cannot read it or finds it of another layout."""
        states = self._read(filename)
        for part, state in zip(self.chained_optimizers, states):
            part.load_parameter_state_from_dp_zero(state, update_legacy_format=update_legacy_format)
        self.loaded = True

    def _read(self, filename: str) -> list[Any]:
        """Each part's state in ``filename``, on data-parallel rank 0 (Nones elsewhere)."""
        reader = self.chained_optimizers[0].data_parallel_group.rank() == 0
        states: list[Any] = [None] * len(self.chained_optimizers)
        problem = ""
        if reader:
            try:
                held = torch.load(filename)
                states = [held] if len(states) == 1 else list(held)
                problem = _layout_problem(self.chained_optimizers, states)
            except Exception as error:  # any unreadable file: one line below, on every rank
                said = str(error).split(". ")[0]  # torch's zip reader adds a paragraph
                problem = f"cannot be read ({type(error).__name__}: {said})"
            if problem:
                problem = f"{filename} {problem}".replace("\n", " ")
        said = _first_said(problem)
        if said:
            raise OptimusError(
                f"--optimus-schedule: the distributed optimizer's state {said}: resume from "
                "another checkpoint (--ckpt-step), or add --no-load-optim to start the optimizer "
                "afresh from the checkpoint's weights"
            )
        return states


def _layout_problem(optimizers: list[Any], states: list[Any]) -> str:
    """What in ``states`` (data-parallel rank 0's ``distrib_optim.pt``) does not fit the buckets
    of ``optimizers``, in a few words (empty where it fits)."""
    if len(states) != len(optimizers):
        return f"holds {len(states)} optimizers' state, this job {len(optimizers)}"
    for part, state in zip(optimizers, states):
        for index, buffer in enumerate(part.buffers):
            for dtype in part.gbuf_ranges[index]:
                held = state.get(index, {}).get(dtype) if isinstance(state, dict) else None
                if not isinstance(held, dict):
                    return f"has no state of buffer {index} {dtype}"
                numel = buffer.numel_unpadded
                if held.get("numel_unpadded") != numel or any(
                    not isinstance(held.get(key), Tensor) or held[key].numel() != numel
                    for key in KEYS
                ):
                    return (
                        f"holds buffer {index} {dtype} as {held.get('numel_unpadded')} elements, "
                        f"this job's as {numel} (another model or parallel layout)"
                    )
    return ""


def _first_said(line: str) -> str:
    """The first rank's non-empty ``line``, on every rank (empty where none said one)."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, line)
    return next((said for said in gathered if said), "")


def plain_distributed_optimizer(
    build: Callable[[list[DistributedDataParallel]], MegatronOptimizer],
    chunks: list[DistributedDataParallel],
) -> CheckpointOptimizer:
    """The run without the flag's distributed optimizer, built over stand-ins of ``chunks``'
    parameters (call it with the user's vision modules in place).

    Args:
        build: Megatron's ``get_megatron_optimizer`` with the job's arguments, over given chunks.
        chunks: the job's chunks under Megatron's DDP.
    """
    with _stand_ins([chunk.module for chunk in chunks]) as real:
        return CheckpointOptimizer(build([_plain_ddp(chunk) for chunk in chunks]), real)


def _plain_ddp(chunk: DistributedDataParallel) -> DistributedDataParallel:
    """megatron-core's DDP over ``chunk``'s module as Megatron-LM's ``get_model`` builds it: the
    chunk's configs, bucketing where the chunk's DDP buckets."""
    ddp = DistributedDataParallel(
        chunk.config, chunk.ddp_config, chunk.module, disable_bucketing=chunk.bucket_size is None
    )
    if ddp.use_forward_hook:  # --overlap-param-gather: the hooks would stay on the job's modules
        ddp.disable_forward_pre_hook(param_sync=False)
    return ddp


@contextlib.contextmanager
def _stand_ins(modules: list[nn.Module]) -> Iterator[dict[Tensor, Tensor]]:
    """Within the block, each parameter of ``modules`` replaced by a stand-in of its shape, dtype
    and attributes (one per parameter, shared where the parameter is); yields each stand-in's
    parameter."""
    real: dict[Tensor, Tensor] = {}
    by_id: dict[int, nn.Parameter] = {}
    swapped = []
    for module in modules:
        for owner in module.modules():
            for name, param in list(owner._parameters.items()):
                if param is None:
                    continue
                if id(param) not in by_id:
                    stand_in = nn.Parameter(torch.empty_like(param), param.requires_grad)
                    stand_in.__dict__.update(param.__dict__)  # tensor_model_parallel, shared, ...
                    by_id[id(param)] = stand_in
                    real[stand_in] = param
                swapped.append((owner, name, param))
                owner._parameters[name] = by_id[id(param)]
    try:
        yield real
    finally:
        for owner, name, param in swapped:
            owner._parameters[name] = param


def chained_into_plain_distributed(
    chained: MegatronOptimizer,
    plain: CheckpointOptimizer,
    encoder: StateDicts,
    vision: StateDicts,
) -> None:
    """Fill ``plain``'s state (Megatron's layout) from the chained optimizer's. Collective over the
    world; the arguments as ``plain_optimizer.chained_into_plain``'s."""
    target = _whole_view(plain, plain.real.__getitem__, gathered=False)
    move_state(
        _whole_view(chained, _itself, gathered=True),
        target,
        encoder,
        vision,
        "the Optimus encoder -> the vision model",
    )
    _scatter(target, plain, plain.real.__getitem__)
    copy_loss_scale(chained, plain)
    _copy_group_settings(chained, plain)


def plain_distributed_into_chained(
    plain: CheckpointOptimizer,
    chained: MegatronOptimizer,
    vision: StateDicts,
    encoder: StateDicts,
) -> None:
    """Fill the chained optimizer's state from ``plain``'s, just loaded. Collective over the
    world."""
    target = _whole_view(chained, _itself, gathered=False)
    move_state(
        _whole_view(plain, plain.real.__getitem__, gathered=True),
        target,
        vision,
        encoder,
        "the vision model -> the Optimus encoder",
    )
    _scatter(target, chained, _itself)
    copy_loss_scale(plain, chained)


def _itself(param: Tensor) -> Tensor:
    return param


def _distributed_parts(optimizer: MegatronOptimizer) -> list[DistributedOptimizer]:
    held = parts(optimizer)
    for part in held:
        if not isinstance(part, DistributedOptimizer):
            raise OptimusError(
                "--optimus-schedule saves and loads the distributed optimizer's state of "
                f"megatron-core's DistributedOptimizer, not of {type(part).__name__}; checkpoint "
                "this job with --no-save-optim"
            )
    return held


def _whole_view(
    optimizer: MegatronOptimizer, weight_of: Callable[[Tensor], Tensor], gathered: bool
) -> OptimizerView:
    """``optimizer``'s state as whole fp32 tensors, one per parameter, keyed by ``weight_of`` each
    model parameter: gathered over each part's data-parallel group, or zeros to be filled."""
    params: dict[Tensor, Tensor] = {}
    states: dict[Tensor, dict[str, Any]] = {}
    for part in _distributed_parts(optimizer):
        prepare_state(part)  # megatron-core's torch optimizers create their state lazily
        step = torch.tensor(float(step_count(part)))
        for param, whole in _whole_states(part, gathered).items():
            main = whole.pop("param")
            params[weight_of(param)] = main
            states[main] = {**whole, STEP: step.clone()} if gathered else {}
    return OptimizerView(params, states)


def _whole_states(part: DistributedOptimizer, gathered: bool) -> dict[Tensor, dict[str, Tensor]]:
    """Each model parameter of ``part``'s buffers and its whole main parameter and moments (each
    rank contributes its range; one all-reduce a state entry over the data-parallel group)."""
    params = [param for buffer in part.buffers for param in buffer.params]
    ends = list(accumulate(param.numel() for param in params))
    device = part.buffers[0].grad_data.device
    flat = {key: torch.zeros(ends[-1] if ends else 0, device=device) for key in KEYS}
    if gathered:
        for param, end in zip(params, ends):
            if param not in part.model_param_gbuf_map:
                continue  # no range of it on this rank
            span = part._get_model_param_range_map(param)["param"]
            held = part._get_main_param_and_optimizer_states(param)
            start = end - param.numel()
            for key in KEYS:
                flat[key][start + span.start : start + span.end] = held[key].detach().view(-1)
        for key in KEYS:
            dist.all_reduce(flat[key], group=part.data_parallel_group)
    return {
        param: {key: flat[key][end - param.numel() : end].view(param.shape) for key in KEYS}
        for param, end in zip(params, ends)
    }


def _scatter(
    view: OptimizerView, optimizer: MegatronOptimizer, weight_of: Callable[[Tensor], Tensor]
) -> None:
    """Each rank's range of ``view``'s whole tensors into ``optimizer``'s parts, and the step."""
    steps = {int(state[STEP]) for state in view.states.values() if STEP in state}
    if len(steps) > 1:
        raise OptimusError(f"--optimus-schedule: the optimizer's parts took {sorted(steps)} steps")
    with torch.no_grad():  # fp32: a main parameter is a view of its model parameter
        for part in _distributed_parts(optimizer):
            prepare_state(part)
            for param in part.model_param_gbuf_map:
                main = view.params[weight_of(param)]
                whole = {"param": main, **view.states[main]}
                span = part._get_model_param_range_map(param)["param"]
                held = part._get_main_param_and_optimizer_states(param)
                for key in KEYS:
                    if key in whole:  # a moment the source lacks stays zero, as a fresh one's
                        held[key].copy_(whole[key].reshape(-1)[span.start : span.end])
            set_step(part, next(iter(steps)) if steps else step_count(part))


def _copy_group_settings(source: MegatronOptimizer, target: MegatronOptimizer) -> None:
    """Each parameter group of ``target`` takes the learning rate, weight decay... of ``source``'s
    group of the same kind (megatron-core's ``param_group_identifier_keys``, by which its
    distributed optimizer matches groups on loading)."""
    settings: dict[tuple[Any, ...], dict[str, Any]] = {}
    for part in parts(source):
        for group in part.optimizer.param_groups:
            settings.setdefault(_group_kind(group), group)
    for part in parts(target):
        for group in part.optimizer.param_groups:
            held = settings.get(_group_kind(group))
            if held is not None:
                group.update({k: v for k, v in held.items() if k != "params"})


def _group_kind(group: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(group.get(key) for key in param_group_identifier_keys)
