"""Training checkpoints in megatron-core's distributed format: written atomically, resumed onto any
plan.

Layout under the ``--save`` folder (Megatron-LM's)::

    latest_checkpointed_iteration.txt    the newest complete checkpoint; replaced last, atomically
    iter_0000003/                        a megatron-core dist_checkpointing folder (metadata.json,
                                         common.pt, *.distcp) ...
    iter_0000003/meta.json               ... plus what the launcher reads before ranks connect
                                         (``checkpoint_meta``)
    iter_0000003/schedule.json           the schedule artifact the job ran (Optimus mode)

The state dict is Megatron-LM's: ``model`` (``model0``, ``model1``... per virtual stage) holds the
model under the LLaVA layout's keys (``runtime.sharded_state``; the encoder in the first entry),
``optimizer`` megatron-core's sharded optimizer state, ``opt_param_scheduler`` the LR schedule and
``iteration`` the step. Every tensor is saved once, by its main replica, as this rank's shard of the
tensor it belongs to; nothing is gathered whole. The distributed optimizer's state takes
megatron-core's ``fully_reshardable`` form (its buffers gathered over the data-parallel group, one
(TP, PP) shard at a time, onto DP rank 0, over gloo), so that it too is keyed by the model's
tensors.

So a checkpoint resumes onto another LLM TP / PP / VP / DP, another encoder plan, and across the two
runtimes: every tensor is addressed by its place in the whole model. The optimizer's state is saved
as megatron-core's flat ``optimizer.state.<exp_avg|exp_avg_sq|fp32_param>.<model key>`` tensors
only; what megatron-core keeps beside them per optimizer part (hyper-parameters, the step count, the
loss scale) depends on how the parts fall on a rank, so a loading job rebuilds that from its own
optimizer, the saved step count and the saved loss scale (``_optimus_state``).

Every rank writes into ``iter_0000003.tmp``; only when all ranks succeeded does rank 0 add
meta.json, rename the folder and then replace the ``latest`` file, so a writer killed or failing
midway leaves the previous checkpoint as the latest and loadable. No generator state carries from
one step to the next (data and dropout masks are seeded by iteration and microbatch,
``runtime.dropout``), so with these the resumed steps are the uninterrupted ones.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedBase, ShardedObject, ShardedStateDict
from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from torch.distributed.checkpoint.api import CheckpointException

from megatron_patches.checkpoint import synchronous_writer
from megatron_patches.optimizer import load_state, parts, prepare_state, set_step, step_count
from optimus_mllm.config.files import atomic_write_text, fsync_dir, fsync_tree
from optimus_mllm.errors import AgreedError, OptimusError
from optimus_mllm.runtime.checkpoint_meta import (
    CHECKPOINT_FORMAT,
    CHECKPOINT_VERSION,
    LATEST,
    CheckpointInfo,
    iteration_dir,
    model_json,
    optimizer_layout,
)
from optimus_mllm.runtime.sharded_state import (
    encoder_sharded_state_dict,
    part_layout,
)
from optimus_mllm.runtime.trainer import Trainer
from optimus_mllm.runtime.user_model import vision_sharded_state_dict
from optimus_mllm.scheduler.artifact_format import artifact_to_json

CHECKPOINT_VERSION_MEGATRON = 3.0  # Megatron-LM's checkpoint_version of its dist checkpoints
# megatron-core's optimizer format keyed by the model's tensors; gathered over gloo onto DP rank 0
# only
OPTIMIZER_SHARDING = {
    "distrib_optim_sharding_type": "fully_reshardable",
    "distrib_optim_fully_reshardable_mem_efficient": True,
}


def model_sharded_state_dict(trainer: Trainer) -> dict[str, ShardedStateDict]:
    """This rank's LLM chunks and encoder stage as Megatron-LM's ``model`` / ``model<i>`` entries
    (the placement's), the encoder stage and the user's vision model in the first."""
    state = trainer.placement.model_state(trainer.config, trainer.modules, trainer.chunks)
    if trainer.encoder is not None:
        dp_group = (
            trainer.groups.dp_group
            if trainer.placement.encoder_plan
            else parallel_state.get_data_parallel_group()
        )
        state[next(iter(state))].update(
            encoder_sharded_state_dict(trainer.config, trainer.encoder, dp_group)
        )
    # the user's vision model, in its first stage
    elif trainer.user_model is not None and trainer.stage == 0:
        state[next(iter(state))].update(vision_sharded_state_dict(trainer.modules[0]))
    return state


def _optimizer_requests(
    optimizer: Any, model_state: dict[str, ShardedStateDict], is_loading: bool
) -> list[ShardedStateDict]:
    """Each stateful optimizer part's own sharded state dict (megatron-core's)."""
    requests = []
    for part in parts(optimizer):
        prepare_state(part)
        requests.append(
            part.sharded_state_dict(model_state, is_loading, metadata=OPTIMIZER_SHARDING)
        )
    return requests


def _sharded_leaves(tree: Any, path: str = "") -> dict[str, ShardedBase]:
    """The sharded tensors of a nested state dict by their place in it ("0/param_state/3/exp_avg"):
    saved as one flat dict, so the checkpoint holds no trace of how the parts fell on a rank."""
    if isinstance(tree, ShardedBase):
        return {path: tree}
    items = (
        tree.items()
        if isinstance(tree, dict)
        else enumerate(tree)
        if isinstance(tree, (list, tuple))
        else ()
    )
    return {
        key: leaf
        for name, value in items
        for key, leaf in _sharded_leaves(value, f"{path}/{name}").items()
    }


def _filled(tree: Any, loaded: dict[str, Any], path: str = "") -> Any:
    """``tree`` with every sharded tensor replaced by what was loaded for its place
    (``_sharded_leaves``)."""
    if isinstance(tree, ShardedBase):
        return loaded[path]
    if isinstance(tree, dict):
        return {name: _filled(value, loaded, f"{path}/{name}") for name, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_filled(value, loaded, f"{path}/{i}") for i, value in enumerate(tree))
    return tree


def _optimus_state(optimizer: Any) -> dict[str, Any]:
    """What a loading job needs beside the tensors: the updates taken and the (fp16) loss scale."""
    steps = {step_count(part) for part in parts(optimizer)}
    if len(steps) > 1:
        raise ValueError(
            f"the optimizer's parts took different numbers of updates: {sorted(steps)}"
        )
    scaler = optimizer.loss_scaler
    return {
        "optimizer_step": steps.pop() if steps else 0,
        "loss_scaler": None if scaler is None else scaler.state_dict(),
    }


def _quietly(function: Callable[..., Any], *args: Any) -> Any:
    """megatron-core saves and loads through torch's ShardedTensor, which torch has deprecated: its
    FutureWarnings (one per rank and call) tell a user nothing they can act on."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", category=FutureWarning, module=r"torch\.distributed\.checkpoint"
        )
        warnings.filterwarnings(
            "ignore", category=FutureWarning, module=r"megatron\.core\.dist_checkpointing"
        )
        return function(*args)


# -- saving ------------------------------------------------------------------------------------


def save_checkpoint(trainer: Trainer, root: str | Path, iteration: int) -> Path:
    """Every rank calls this after step ``iteration``; returns the checkpoint folder.

    A failure on any rank is raised as the same OptimusError on every rank; the half-written folder
    is removed and the previous checkpoint stays the latest."""
    root, rank = Path(root), dist.get_rank()
    final = iteration_dir(root, iteration)
    tmp = final.with_name(final.name + ".tmp")
    _agree_saving(_attempt(lambda: _fresh_dir(tmp)) if rank == 0 else None, "preparing", root)
    # a collective (the distributed optimizer gathers its state): outside the I/O, so that a failed
    # write cannot strand it
    state = _state_dict(trainer, iteration)
    try:
        with synchronous_writer():
            _agree_saving(
                _attempt(lambda: _quietly(dist_checkpointing.save, state, str(tmp))),
                "writing",
                root,
            )
        _agree_saving(
            _attempt(lambda: _publish(trainer, root, tmp, final, iteration)) if rank == 0 else None,
            "publishing",
            root,
        )
    except OptimusError:
        if rank == 0:  # a half-written folder would only hold the disk
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _state_dict(trainer: Trainer, iteration: int) -> dict[str, Any]:
    model_state = model_sharded_state_dict(trainer)
    optimizer_state = _sharded_leaves(
        _optimizer_requests(trainer.optimizer, model_state, is_loading=False)
    )
    state = {
        **model_state,
        "opt_param_scheduler": trainer.opt_param_scheduler.state_dict(),
        "iteration": iteration,
        "checkpoint_version": CHECKPOINT_VERSION_MEGATRON,
        "optimus": _optimus_state(trainer.optimizer),
    }
    if optimizer_state:  # none off DP rank 0: the distributed optimizer's state is gathered there
        state["optimizer"] = optimizer_state
    return state


def _attempt(action: Callable[[], Any]) -> tuple[int, str] | None:
    """None, or (the rank that failed, what failed there): any rank's failure must reach every rank,
    or the others would wait forever."""
    try:
        action()
        return None
    except (
        CheckpointException
    ) as exc:  # torch's (a BaseException): raised on every rank, the detail on one
        if not exc.failures:
            return dist.get_rank(), ""
        rank, (error, _) = min(exc.failures.items())
        return rank, f"{type(error).__name__}: {error}"
    except Exception as exc:
        return dist.get_rank(), f"{type(exc).__name__}: {exc}"


def _first_failure(outcome: tuple[int, str] | None) -> tuple[int, str] | None:
    """Every rank's ``_attempt`` outcome gathered: the first failure that says what failed, or
    None."""
    outcomes: list[tuple[int, str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, outcome)
    failed = [o for o in outcomes if o]
    return next((o for o in failed if o[1]), failed[0]) if failed else None


def _agree_saving(outcome: tuple[int, str] | None, what: str, root: Path) -> None:
    failure = _first_failure(outcome)
    if failure is None:
        return
    rank, message = failure
    if "No space left on device" in message:
        raise AgreedError(
            f"checkpoint {what} failed: no space left on {root}; free space there or point --save "
            "elsewhere; the previous checkpoint is still the latest"
        )
    detail = f" ({message.splitlines()[0]})" if message else ""
    raise AgreedError(
        f"checkpoint {what} failed on rank {rank}{detail}; the previous checkpoint is still the "
        "latest"
    )


def _fresh_dir(path: Path) -> None:
    if path.exists():  # left by a writer that was killed
        shutil.rmtree(path)
    path.mkdir(parents=True)


def _publish(trainer: Trainer, root: Path, tmp: Path, final: Path, iteration: int) -> None:
    """Make ``tmp`` the checkpoint of ``iteration``, in an order that a crash at any point leaves
    ``checkpoint_meta.latest_checkpoint`` a complete checkpoint to resume from (this one or the one
    before)."""
    if trainer.artifact is not None:
        atomic_write_text(
            tmp / "schedule.json", json.dumps(artifact_to_json(trainer.artifact)) + "\n"
        )
    meta = {
        "format": CHECKPOINT_FORMAT,
        "version": CHECKPOINT_VERSION,
        "iteration": iteration,
        "world_size": dist.get_world_size(),
        "mode": trainer.placement.mode,
        "llm_plan": trainer.plan.as_dict(),
        "model": model_json(trainer.config),
        "optimizer_layout": optimizer_layout(trainer.config),
    }
    # last: the folder is complete
    atomic_write_text(tmp / "meta.json", json.dumps(meta, indent=1) + "\n")
    fsync_tree(tmp)  # megatron-core syncs its tensor files, not its metadata
    replaced = None
    if final.exists():  # the same iteration saved again (e.g. a rerun): the new one replaces it
        replaced = final.with_name(final.name + ".old")
        shutil.rmtree(replaced, ignore_errors=True)
        os.replace(final, replaced)
    os.replace(tmp, final)
    fsync_dir(root)
    atomic_write_text(root / LATEST, f"{iteration}\n")
    if replaced is not None:
        shutil.rmtree(replaced)


def _load_agreed(request: dict[str, Any], folder: Path, failed: str) -> dict[str, Any]:
    """``dist_checkpointing.load`` on every rank; a failure on any rank is one OptimusError on all,
    ``failed`` (what to do about it) appended."""
    loaded: dict[str, Any] = {}
    failure = _first_failure(
        _attempt(lambda: loaded.update(_quietly(dist_checkpointing.load, request, str(folder))))
    )
    if failure is not None:
        rank, message = failure
        detail = f" ({message.splitlines()[0]})" if message else ""
        raise AgreedError(f"loading {folder} failed on rank {rank}{detail}; {failed}")
    return loaded


# -- loading -----------------------------------------------------------------------------------


def load_checkpoint(trainer: Trainer, info: CheckpointInfo, load_optimizer: bool = True) -> None:
    """Load the weights of ``info`` into this rank's LLM chunks and encoder stage, the LR schedule's
    position and, with ``load_optimizer`` (the caller checked ``optimizer_layout_change``), the
    optimizer's state; whatever plans and runtime wrote it."""
    model_state = model_sharded_state_dict(trainer)
    request: dict[str, Any] = dict(model_state)
    optimizer_requests: list[ShardedStateDict] = []
    if load_optimizer:
        optimizer_requests = _optimizer_requests(trainer.optimizer, model_state, is_loading=True)
        request["optimizer"] = _sharded_leaves(optimizer_requests)
    loaded = _load_agreed(
        request,
        info.path,
        "the checkpoint is damaged: move it away, and --resume takes the "
        "newest complete one before it",
    )
    _copy_into_model(model_state, loaded)
    # the optimizer's fp32 main copies (bf16/fp16) follow the loaded weights, as in Megatron's
    # load_checkpoint; a loaded optimizer state then puts its own in their place
    trainer.optimizer.reload_model_params()
    # megatron-core's load_state_dict counts the saved steps on from here
    trainer.opt_param_scheduler.num_steps = 0
    changed = lr_schedule_change(trainer.opt_param_scheduler, loaded["opt_param_scheduler"])
    if changed:  # the same on every rank: the schedule's state is replicated
        raise AgreedError(changed)
    trainer.opt_param_scheduler.load_state_dict(loaded["opt_param_scheduler"])
    if load_optimizer:
        _load_optimizer(
            trainer.optimizer, optimizer_requests, loaded["optimizer"], loaded["optimus"]
        )
    # the LR and weight decay of the loaded step: the optimizer's hyper-parameters are this job's
    # own
    trainer.opt_param_scheduler.step(increment=0)


# megatron-core's OptimizerParamScheduler settings, as its load_state_dict checks them
# (_check_and_set): the state-dict key, what it is and the config field that sets it
_LR_SCHEDULE_SETTINGS = {
    "max_lr": ("learning rate", "training.lr"),
    "min_lr": ("minimum learning rate", "training.min_lr"),
    "lr_warmup_steps": ("warm-up iterations", "training.lr_warmup_iters"),
    "lr_decay_steps": ("decay iterations", "training.lr_decay_iters, else train_iters"),
    "lr_decay_style": ("decay style", "training.lr_decay_style"),
    "start_wd": ("weight decay", "training.weight_decay"),
    "end_wd": ("weight decay", "training.weight_decay"),
    "wd_incr_steps": ("weight decay iterations", "training.lr_decay_iters, else train_iters"),
    "wd_incr_style": ("weight decay style", "training.weight_decay"),
}


def lr_schedule_change(scheduler: OptimizerParamScheduler, saved: dict[str, Any]) -> str | None:
    """Megatron-LM's rule for a resumed LR schedule whose settings differ from the checkpoint's:
    refused unless ``--override-opt_param-scheduler`` (this run's settings win) or
    ``--use-checkpoint-opt_param-scheduler`` (the checkpoint's win) says which; the message, or
    None."""
    if scheduler.override_opt_param_scheduler or scheduler.use_checkpoint_opt_param_scheduler:
        return None
    for key, (name, field) in _LR_SCHEDULE_SETTINGS.items():
        current = getattr(scheduler, key)
        if key in saved and saved[key] != current:
            return (
                f"--resume: the LR schedule's {name} ({field}) is {current} in this run and "
                f"{saved[key]} in the checkpoint; add --override-opt_param-scheduler to use this "
                "run's settings or --use-checkpoint-opt_param-scheduler to use the checkpoint's "
                "(training.override_opt_param_scheduler / use_checkpoint_opt_param_scheduler)"
            )
    return None


def _copy_into_model(model_state: dict[str, ShardedStateDict], loaded: dict[str, Any]) -> None:
    """Copy what ``dist_checkpointing.load`` returned for ``model_state`` into the parameters it
    names."""
    with torch.no_grad():
        for entry, tensors in model_state.items():
            for key, sharded in tensors.items():
                # ShardedObjects: megatron's empty _extra_state
                if not isinstance(sharded, ShardedObject):
                    # the loader may have filled the parameter in place, or a view of it: one tensor
                    # at a time
                    sharded.data.copy_(loaded[entry][key].clone())


def _load_optimizer(
    optimizer: Any, requests: list[ShardedStateDict], loaded: dict[str, Any], saved: dict[str, Any]
) -> None:
    """Each part's state from its own request (its hyper-parameters, its layout) with the loaded
    tensors."""
    for i, (part, request) in enumerate(zip(parts(optimizer), requests, strict=True)):
        with torch.no_grad():  # the loader copies into views of leaf parameters
            load_state(part, _filled(request, loaded, f"/{i}"))
        set_step(part, saved["optimizer_step"])
    if optimizer.loss_scaler is not None and saved["loss_scaler"] is not None:
        optimizer.loss_scaler.load_state_dict(saved["loss_scaler"])


# -- pretrained weights ------------------------------------------------------------------------


def load_pretrained(trainer: Trainer, part: str, folder: Path, flag: str) -> str:
    """Load the weights of one model part, ``"llm"`` or an encoder's name, from the dist checkpoint
    in ``folder`` (Megatron-LM's ``--pretrained-checkpoint``: weights only; the optimizer starts
    afresh, the run from step 0). Every rank calls this; returns what to tell the user.

    The part's keys are found under this project's (LLaVA's) prefix or under the one a checkpoint of
    the part alone has: a megatron-core ``GPTModel``'s bare keys for the LLM; for an encoder,
    ``vision_model.*`` (a single encoder's) or ``<name>.vision_model.*`` (one of several). An
    encoder's projector is loaded when the checkpoint has it and starts from scratch otherwise (a
    pretrained ViT and a new projector: LLaVA's first stage).
    """
    saved = set(_quietly(dist_checkpointing.load_tensors_metadata, str(folder)))
    prefix, roots, candidates = part_layout(trainer.config, part)
    found = next(
        (c for c in candidates if any(key.startswith(c + roots[0]) for key in saved)), None
    )
    if found is None:
        raise AgreedError(
            f"{flag} {folder}: the checkpoint holds no {part} tensors (no key starts with "
            f"{' or '.join(c + roots[0] for c in candidates)}); point it at a checkpoint of it"
        )
    request = {
        entry: {
            key: sharded
            for key, sharded in tensors.items()  # not megatron's empty _extra_state
            if key.startswith(tuple(prefix + root for root in roots))
            and not isinstance(sharded, ShardedObject)
        }
        for entry, tensors in model_sharded_state_dict(trainer).items()
    }
    if found != prefix:
        replace_prefix_for_sharding(request, prefix, found)
    optional = tuple(found + root for root in roots[1:]) if part != "llm" else ()
    absent = any(not any(key.startswith(root) for key in saved) for root in optional)
    if absent:  # the projector: not in this checkpoint, trained from its initialisation
        request = {
            entry: {
                key: sharded
                for key, sharded in tensors.items()
                if not sharded.key.startswith(optional)
            }
            for entry, tensors in request.items()
        }
    loaded = _load_agreed(request, folder, f"{flag} must name a checkpoint of this model's {part}")
    _copy_into_model(request, loaded)
    trainer.optimizer.reload_model_params()
    return f"{part}: pretrained weights from {folder}" + (
        " (no projector there: it starts from scratch)" if absent else ""
    )
