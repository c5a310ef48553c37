"""What a checkpoint folder says about the job that wrote it, and whether this job can resume from it.

Plain files and JSON (``meta.json``, ``latest_checkpointed_iteration.txt``; the layout is in
``runtime.checkpoint``): the launcher decides a resume with these before any rank imports
megatron-core, so a refused job exits at once on every rank.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from optimus_mllm.config import OptimusConfig
from optimus_mllm.errors import OptimusError
from optimus_mllm.io_utils import read_versioned_json
from optimus_mllm.planner.plans import ParallelPlan

CHECKPOINT_FORMAT = "optimus-checkpoint"
CHECKPOINT_VERSION = 3  # 3: megatron-core dist_checkpointing (2: per-rank torch.save shards)
LATEST = "latest_checkpointed_iteration.txt"


def iteration_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


@dataclass(frozen=True)
class CheckpointInfo:
    """What a checkpoint says about the job that wrote it (meta.json)."""

    path: Path
    iteration: int
    world_size: int
    llm_plan: ParallelPlan
    mode: str
    model: dict[str, Any]
    optimizer_layout: dict[str, Any]  # the optimizer settings its saved state belongs to

    @property
    def schedule_path(self) -> Path:
        return self.path / "schedule.json"


def latest_checkpoint(root: str | Path) -> CheckpointInfo:
    """The newest complete checkpoint under ``root`` (the ``--save`` folder)."""
    marker = Path(root) / LATEST
    if not marker.is_file():
        raise OptimusError(f"--resume: no checkpoint in {root} ({LATEST} is missing); drop --resume to start "
                           "from scratch or point --save at the folder of an earlier run")
    text = marker.read_text().strip()
    if not text.isdigit():
        raise OptimusError(f"--resume: {marker} holds {text!r}, not an iteration number")
    path = iteration_dir(root, int(text))
    meta = read_versioned_json(path / "meta.json", "checkpoint", CHECKPOINT_FORMAT, CHECKPOINT_VERSION,
                               "resume from a checkpoint written by this release")
    return CheckpointInfo(path, meta["iteration"], meta["world_size"], ParallelPlan(**meta["llm_plan"]),
                          meta["mode"], meta["model"], meta["optimizer_layout"])


def dist_checkpoint_folder(path: str | Path, flag: str) -> Path:
    """The megatron-core dist checkpoint ``path`` names: the folder itself, or the newest in a ``--save``
    folder (Megatron-LM's, with ``latest_checkpointed_iteration.txt``)."""
    path = Path(path)
    if (path / LATEST).is_file():
        text = (path / LATEST).read_text().strip()
        if not text.isdigit():
            raise OptimusError(f"{flag} {path}: {LATEST} holds {text!r}, not an iteration number")
        path = iteration_dir(path, int(text))
    if not (path / "metadata.json").is_file():
        raise OptimusError(f"{flag} {path}: not a megatron-core dist checkpoint (no metadata.json); point it at a "
                           f"checkpoint folder (iter_NNNNNNN) or the folder holding {LATEST}")
    return path


def check_resumable(info: CheckpointInfo, config: OptimusConfig) -> None:
    """Refuse a checkpoint whose weights cannot load into this job (same answer on every rank); its
    plans and runtime may differ from this job's."""
    changed = _first_difference(info.model, model_json(config), "model")
    if changed:
        raise OptimusError(f"--resume: {changed} differs from the checkpoint in {info.path}; resume with the "
                           "model config it was written with")


def optimizer_layout(config: OptimusConfig) -> dict[str, Any]:
    """What the saved optimizer state is made of: the optimizer (its moments), whether the distributed
    optimizer saved fp32 main weights beside the model's, and the precision (whether there are any)."""
    t = config.training
    return {"optimizer": t.optimizer, "distributed_optimizer": t.distributed_optimizer, "precision": t.precision}


def optimizer_layout_change(info: CheckpointInfo, layout: dict[str, Any]) -> str | None:
    """The first difference that keeps the checkpoint's optimizer state out of this job, or None."""
    return _first_difference(info.optimizer_layout, json.loads(json.dumps(layout)), "optimizer layout")


def model_json(config: OptimusConfig) -> dict[str, Any]:
    """The model config as meta.json stores it (tuples become lists), so saved and current compare equal;
    without dropout, which a resumed job may change (the weights are the same model's)."""
    model = json.loads(json.dumps(dataclasses.asdict(config.model)))
    for spec in (model["llm"], *model["encoders"]):
        for name in ("hidden_dropout", "attention_dropout"):
            del spec[name]
    return model


def _first_difference(saved: Any, current: Any, where: str) -> str | None:
    if isinstance(saved, dict) and isinstance(current, dict):
        for key in sorted(set(saved) | set(current)):
            found = _first_difference(saved.get(key), current.get(key), f"{where}.{key}")
            if found:
                return found
        return None
    if isinstance(saved, list) and isinstance(current, list) and len(saved) == len(current):
        for i, (a, b) in enumerate(zip(saved, current)):
            found = _first_difference(a, b, f"{where}[{i}]")
            if found:
                return found
        return None
    return None if saved == current else where
