"""Training checkpoints: written atomically, resumed so that the following steps are unchanged.

Layout under the ``--save`` folder (Megatron-LM's names where it has one)::

    latest_checkpointed_iteration.txt          the newest complete checkpoint; replaced last, atomically
    iter_0000003/meta.json                     iteration, world size, plans, model config
    iter_0000003/schedule.json                 the schedule artifact the job ran (Optimus mode)
    iter_0000003/llm/mp_rank_TT_PPP.pt         LLM chunks of (TP rank, PP rank), from DP rank 0
    iter_0000003/encoder/stage_S.pt            encoder stage S as whole tensors by global name
    iter_0000003/optimizer/rank_00005.pt       rank 5's optimizer state: Adam moments, main parameters,
                                               step counts, loss scaler (megatron_patches.optimizer)

Every rank writes its files under ``iter_0000003.tmp``; only when all ranks succeeded does rank 0
rename the folder and then replace the ``latest`` file, so a writer killed or failing midway leaves
the previous checkpoint as the latest and loadable.

The encoder is saved whole (gathered over its TP group) under plan-independent names, so it loads
into any encoder plan: a resumed job may re-plan. The LLM is saved per (TP, PP) shard, as Megatron's
legacy checkpoints are, so its TP, PP and virtual stages must stay (DP may change). The optimizer's
state is saved per rank, so it loads only into the same ranks, plans and optimizer settings
(``optimizer_layout`` in meta.json, read by ``checkpoint_meta``); a job that differs must say
``--no-load-optim`` (Megatron-LM's flag) and resumes the weights and the LR schedule with a fresh
optimizer state. The LR schedule's state is in meta.json. No generator state carries from one step to
the next (data and dropout masks are seeded by iteration and microbatch, ``runtime.dropout``), so with
these the resumed steps are the uninterrupted ones.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_patches.optimizer import load_optimizer_state, optimizer_state
from optimus_mllm.errors import OptimusError
from optimus_mllm.io_utils import atomic_write_text
from optimus_mllm.runtime.checkpoint_meta import (
    CHECKPOINT_FORMAT,
    CHECKPOINT_VERSION,
    LATEST,
    CheckpointInfo,
    iteration_dir,
    model_json,
    optimizer_layout,
)
from optimus_mllm.runtime.weights import global_parameter_names, shard, whole

# -- saving ------------------------------------------------------------------------------------


def save_checkpoint(trainer: Any, root: str | Path, iteration: int) -> Path:
    """Every rank calls this after step ``iteration``; returns the checkpoint folder.

    A failure on any rank is raised as the same OptimusError on every rank, and the previous
    checkpoint stays the latest."""
    root, rank = Path(root), dist.get_rank()
    final = iteration_dir(root, iteration)
    tmp = final.with_name(final.name + ".tmp")
    _agree(_attempt(lambda: _fresh_dir(tmp)) if rank == 0 else None, "preparing")
    encoder = _whole_encoder(trainer)  # a collective: outside the I/O, so a failed write cannot strand it
    _agree(_attempt(lambda: _write_rank_files(trainer, tmp, encoder)), "writing")
    _agree(_attempt(lambda: _publish(trainer, root, tmp, final, iteration)) if rank == 0 else None, "publishing")
    return final


def _attempt(action: Callable[[], None]) -> str | None:
    try:
        action()
        return None
    except Exception as exc:  # any rank's failure must reach every rank, or the others would wait forever
        return f"{type(exc).__name__}: {exc}"


def _agree(error: str | None, what: str) -> None:
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failed = [(r, e) for r, e in enumerate(errors) if e]
    if failed:
        rank, message = failed[0]
        raise OptimusError(f"checkpoint {what} failed on rank {rank} ({message.splitlines()[0]}); the previous "
                           "checkpoint is still the latest")


def _fresh_dir(path: Path) -> None:
    if path.exists():  # left by a writer that was killed
        shutil.rmtree(path)
    (path / "llm").mkdir(parents=True)
    (path / "encoder").mkdir()
    (path / "optimizer").mkdir()


def _whole_encoder(trainer: Any) -> tuple[str, dict[str, torch.Tensor]] | None:
    """(file name, whole tensors) of this rank's encoder stage, on the rank that writes it (None elsewhere)."""
    encoder = trainer.encoder
    if encoder is None:
        return None
    with torch.no_grad():  # whole() is a collective over the encoder's TP group: all its ranks take part
        tensors = {name: whole(p.detach(), p, encoder.tp_group) for name, p in global_parameter_names(encoder).items()}
    writes, stage = _encoder_writer(trainer)
    return (f"stage_{stage}.pt", tensors) if writes else None


def _write_rank_files(trainer: Any, folder: Path, encoder: tuple[str, dict[str, torch.Tensor]] | None) -> None:
    if parallel_state.get_data_parallel_rank() == 0:
        tp, pp = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
        torch.save({"chunks": [chunk.state_dict() for chunk in trainer.chunks]},
                   folder / "llm" / f"mp_rank_{tp:02d}_{pp:03d}.pt")
    if encoder is not None:
        name, tensors = encoder
        torch.save(tensors, folder / "encoder" / name)
    torch.save(optimizer_state(trainer.optimizer), _optimizer_file(folder, dist.get_rank()))


def _optimizer_file(folder: Path, rank: int) -> Path:
    return folder / "optimizer" / f"rank_{rank:05d}.pt"


def _encoder_writer(trainer: Any) -> tuple[bool, int]:
    """(whether this rank writes its encoder stage, the stage): TP rank 0 of the first encoder replica."""
    if trainer.mode == "optimus":
        coords = trainer.groups.coords
        return coords.dp == 0 and coords.tp == 0, coords.pp
    first = parallel_state.get_data_parallel_rank() == 0 and parallel_state.get_tensor_model_parallel_rank() == 0
    return first, 0


def _publish(trainer: Any, root: Path, tmp: Path, final: Path, iteration: int) -> None:
    meta = {"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, "iteration": iteration,
            "world_size": dist.get_world_size(), "mode": trainer.mode, "llm_plan": trainer.plan.as_dict(),
            "model": model_json(trainer.config),
            "optimizer_layout": optimizer_layout(trainer.config, dist.get_world_size(), trainer.plan, trainer.artifact),
            "scheduler": trainer.scheduler.state_dict()}
    atomic_write_text(tmp / "meta.json", json.dumps(meta, indent=1) + "\n")
    if trainer.artifact is not None:
        atomic_write_text(tmp / "schedule.json", json.dumps(trainer.artifact) + "\n")
    if final.exists():  # the same iteration saved again (e.g. a rerun): the new one replaces it
        shutil.rmtree(final)
    os.replace(tmp, final)
    atomic_write_text(root / LATEST, f"{iteration}\n")


# -- loading -----------------------------------------------------------------------------------


def load_checkpoint(trainer: Any, info: CheckpointInfo, load_optimizer: bool = True) -> None:
    """Load the weights of ``info`` into this rank's LLM chunks and encoder stage, the LR schedule's
    position and, with ``load_optimizer`` (the caller checked ``optimizer_layout_change``), this rank's
    optimizer state."""
    _load_weights(trainer, info)
    # the optimizer's fp32 main copies (bf16/fp16) follow the loaded weights, as in Megatron's
    # load_checkpoint; a loaded optimizer state then puts its own in their place
    trainer.optimizer.reload_model_params()
    try:
        trainer.scheduler.load_state_dict(info.scheduler)
    except AssertionError as exc:  # megatron-core asserts that the schedule's settings are unchanged
        raise OptimusError(f"--resume: {exc}; resume with the training settings the checkpoint was written "
                           "with") from None
    if load_optimizer:
        state = torch.load(_optimizer_file(info.path, dist.get_rank()), map_location="cpu", weights_only=False)
        load_optimizer_state(trainer.optimizer, state)


def _load_weights(trainer: Any, info: CheckpointInfo) -> None:
    tp, pp = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
    llm = torch.load(info.path / "llm" / f"mp_rank_{tp:02d}_{pp:03d}.pt", map_location="cpu",
                     weights_only=True)
    for chunk, state in zip(trainer.chunks, llm["chunks"], strict=True):
        chunk.load_state_dict(state)
    encoder = trainer.encoder
    if encoder is None:
        return
    saved: dict[str, torch.Tensor] = {}
    for path in sorted((info.path / "encoder").glob("stage_*.pt")):
        saved.update(torch.load(path, map_location="cpu", weights_only=True))
    group = encoder.tp_group
    with torch.no_grad():
        for name, param in global_parameter_names(encoder).items():
            param.copy_(shard(saved[name], param, group.rank(), group.size()))  # copy_ moves it to the param's device
