"""What a checkpoint folder says about the job that wrote it, and whether this job can resume from
it.

Plain files and JSON (``meta.json``, ``latest_checkpointed_iteration.txt``; the layout is in
``runtime.checkpoint``): the launcher decides a resume with these before any rank imports
megatron-core, so a refused job exits at once on every rank.
"""

from __future__ import annotations

import dataclasses
import json
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from optimus_mllm.config import ModelConfig, OptimusConfig, model_config_from_dict
from optimus_mllm.config.files import read_regular_file, read_versioned_json, special_entries
from optimus_mllm.errors import ConfigError, OptimusError
from optimus_mllm.planner.plans import ParallelPlan
from optimus_mllm.runtime.mode import MODES

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
    passed_over: str | None = None  # why the checkpoint the tracker names was not this one

    @property
    def schedule_path(self) -> Path:
        return self.path / "schedule.json"


class _Incomplete(Exception):
    """A checkpoint folder that a writer did not finish, or that was damaged since."""


def latest_checkpoint(root: str | Path) -> CheckpointInfo:
    """The checkpoint to resume from under ``root`` (the ``--save`` folder): the one
    ``latest_checkpointed_iteration.txt`` names when it is complete, else the newest complete one
    (``passed_over`` says why). Complete: meta.json (written last, before the folder is renamed into
    place) is whole, and every file megatron-core's metadata lists holds the bytes it lists."""
    root = Path(root)
    named, why = _tracked_iteration(root)
    if named is not None:
        try:
            return _read_complete(iteration_dir(root, named))
        except _Incomplete as exc:
            why = f"{LATEST} names iter_{named:07d}, which {exc}"
    others = sorted((it for it in _iterations(root) if it != named), reverse=True)
    for iteration in others:
        try:
            info = _read_complete(iteration_dir(root, iteration))
        except _Incomplete:
            continue
        return dataclasses.replace(
            info,
            passed_over=f"{why}: resumed from {info.path.name}, the newest complete checkpoint",
        )
    if named is None and not others:
        raise OptimusError(
            f"--resume: no checkpoint in {root} ({why}); drop --resume to start from scratch or "
            "point --save at the folder of an earlier run"
        )
    raise OptimusError(
        f"--resume: no complete checkpoint in {root} ({why}); drop --resume to start from scratch"
    )


def _tracked_iteration(root: Path) -> tuple[int | None, str]:
    """The iteration the tracker names, or None and why not."""
    marker = root / LATEST
    try:
        raw = read_regular_file(marker)
    except FileNotFoundError:
        return None, f"{LATEST} is missing"
    except OSError as exc:
        return None, f"{LATEST} cannot be read ({exc.strerror})"
    text = raw.decode("ascii", errors="replace").strip()
    if not (text.isascii() and text.isdigit()) or len(text) > 12:
        return None, f"{LATEST} holds {text[:20]!r}, not an iteration number"
    return int(text), ""


def _iterations(root: Path) -> list[int]:
    """The iterations of the ``iter_NNNNNNN`` folders under ``root`` (not ``.tmp`` leftovers)."""
    if not root.is_dir():
        return []
    names = (path.name.removeprefix("iter_") for path in root.glob("iter_*"))
    return [int(name) for name in names if name.isascii() and name.isdigit()]


_META_FIELDS = {
    "iteration": int,
    "world_size": int,
    "llm_plan": dict,
    "mode": str,
    "model": dict,
    "optimizer_layout": dict,
}


def _read_complete(path: Path) -> CheckpointInfo:
    if not path.is_dir():
        raise _Incomplete("does not exist")
    try:
        meta = read_versioned_json(
            path / "meta.json",
            "checkpoint",
            CHECKPOINT_FORMAT,
            CHECKPOINT_VERSION,
            "resume from a checkpoint written by this release",
        )
    except OptimusError as exc:
        raise _Incomplete(f"has no usable meta.json ({str(exc).split(': ', 1)[-1]})") from None
    for field, kind in _META_FIELDS.items():
        if not isinstance(meta.get(field), kind):
            raise _Incomplete(f"has an incomplete meta.json (no {kind.__name__} {field!r})")
    plan_fields = meta["llm_plan"]
    if sorted(plan_fields) != ["dp", "pp", "tp", "vp"] or not all(
        type(value) is int and value > 0 for value in plan_fields.values()
    ):
        raise _Incomplete(f"has an incomplete meta.json (llm_plan {str(plan_fields)[:60]})")
    plan = ParallelPlan(**plan_fields)
    if meta["world_size"] != plan.world_size:
        raise _Incomplete(
            f"has a meta.json whose world_size {meta['world_size']} is not its llm_plan's"
        )
    if meta["mode"] not in MODES:
        raise _Incomplete(
            f"has a meta.json with mode {meta['mode'][:20]!r}, not one of {', '.join(MODES)}"
        )
    if meta["iteration"] != int(path.name.removeprefix("iter_")):
        raise _Incomplete(f"has the meta.json of iteration {meta['iteration']}")
    missing = _missing_bytes(path)
    if missing:
        raise _Incomplete(missing)
    return CheckpointInfo(
        path,
        meta["iteration"],
        meta["world_size"],
        plan,
        meta["mode"],
        meta["model"],
        meta["optimizer_layout"],
    )


def _missing_bytes(path: Path) -> str | None:
    """What is missing of the tensor files torch's distributed-checkpoint metadata lists, or
    None."""
    # the launcher has torch; not megatron-core
    from torch.distributed.checkpoint import (
        FileSystemReader,
    )

    special = special_entries(path)
    if special:
        return f"holds {special[0]}, which cannot be read without blocking"
    try:
        if not isinstance(json.loads(read_regular_file(path / "metadata.json")), dict):
            return "has a metadata.json that is not megatron-core's"
    except FileNotFoundError:
        return "has no metadata.json"
    except (OSError, ValueError):
        return "has an unreadable metadata.json"
    # megatron-core's common state: a torch.save zip, checked member by member without unpickling it
    try:
        with zipfile.ZipFile(path / "common.pt") as common:
            broken = common.testzip()
    except FileNotFoundError:
        return "has no common.pt"
    except (OSError, zipfile.BadZipFile):
        return "has an unreadable common.pt"
    if broken is not None:
        return f"has common.pt damaged ({broken})"
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as exc:  # missing, truncated or foreign: unreadable either way
        return f"has an unreadable .metadata ({type(exc).__name__})"
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(
            needed.get(info.relative_path, 0), info.offset + info.length
        )
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            return f"lacks {name}"
        if file.stat().st_size < size:
            return f"has {name} cut short ({file.stat().st_size} of {size} bytes)"
    return None


def dist_checkpoint_folder(path: str | Path, flag: str) -> Path:
    """The megatron-core dist checkpoint ``path`` names: the folder itself, or the newest in a
    ``--save``
    folder (Megatron-LM's, with ``latest_checkpointed_iteration.txt``)."""
    path = Path(path)
    if (path / LATEST).is_file():
        text = (path / LATEST).read_text().strip()
        if not text.isdigit():
            raise OptimusError(f"{flag} {path}: {LATEST} holds {text!r}, not an iteration number")
        path = iteration_dir(path, int(text))
    if not (path / "metadata.json").is_file():
        raise OptimusError(
            f"{flag} {path}: not a megatron-core dist checkpoint (no metadata.json); point it at a "
            f"checkpoint folder (iter_NNNNNNN) or the folder holding {LATEST}"
        )
    special = special_entries(path)
    if special:
        raise OptimusError(
            f"{flag} {path}: holds {special[0]}, not a regular file; a checkpoint folder holds "
            "files and folders only"
        )
    return path


def check_resumable(info: CheckpointInfo, config: OptimusConfig) -> None:
    """Refuse a checkpoint whose weights cannot load into this job (same answer on every rank); its
    plans and runtime may differ from this job's."""
    changed = _first_difference(_saved_model(info.model), model_json(config), "model")
    if changed:
        raise OptimusError(
            f"--resume: {changed} differs from the checkpoint in {info.path}; resume with the "
            "model config it was written with"
        )


def optimizer_layout(config: OptimusConfig) -> dict[str, Any]:
    """What the saved optimizer state is made of: the optimizer (its moments), whether the
    distributed optimizer saved fp32 main weights beside the model's, and the precision (whether
    there are any)."""
    t = config.training
    return {
        "optimizer": t.optimizer,
        "distributed_optimizer": t.distributed_optimizer,
        "precision": t.precision,
    }


def optimizer_layout_change(info: CheckpointInfo, layout: dict[str, Any]) -> str | None:
    """The first difference that keeps the checkpoint's optimizer state out of this job, or None."""
    return _first_difference(
        info.optimizer_layout, json.loads(json.dumps(layout)), "optimizer layout"
    )


def model_json(config: OptimusConfig) -> dict[str, Any]:
    """The model config as meta.json stores it (tuples become lists), so saved and current compare
    equal;
    without dropout, which a resumed job may change (the weights are the same model's)."""
    return _model_json(config.model)


def _model_json(model_config: ModelConfig) -> dict[str, Any]:
    model = json.loads(json.dumps(dataclasses.asdict(model_config)))
    for spec in (model["llm"], *model["encoders"]):
        for name in ("hidden_dropout", "attention_dropout"):
            del spec[name]
    return model


def _saved_model(saved: dict[str, Any]) -> Any:
    """The saved model config with the fields added to the schema since it was written at their
    defaults
    (e.g. ``projector.spatial_merge``: 1 is the model that had none); as saved if this schema cannot
    read it, so that the comparison names what differs."""
    try:
        return _model_json(model_config_from_dict(saved))
    except ConfigError:
        return saved


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
