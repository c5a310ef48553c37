"""Checkpoints under faults: a rank killed at any point of a write, and damaged checkpoint folders,
leave a job that resumes from a complete checkpoint with the uninterrupted run's numbers, or stops
with one line; never a traceback or a half-loaded model."""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
from pathlib import Path

import pytest

from support.distributed_utils import run_distributed
from support.train_utils import TINY, assert_one_error_everywhere, ranks

pytestmark = pytest.mark.distributed

TWO_RANKS = [
    "cluster.num_gpus=2",
    "cluster.gpus_per_node=2",
    "parallel.llm={dp: 1, pp: 2, tp: 1, vp: 2}",
    "training.train_iters=3",
]


def _trainer():
    from optimus_mllm.config import load_config
    from optimus_mllm.planner import plan
    from optimus_mllm.runtime.trainer import Trainer
    from optimus_mllm.scheduler.artifact import schedule_job_artifact

    config = load_config(TINY, TWO_RANKS)
    planned = plan(config)
    return Trainer(config, planned.llm_plan, "optimus", schedule_job_artifact(config, planned))


def _die():
    os._exit(9)  # as kill -9: no clean-up, no exception


def _save_then_die(save: str, point: str) -> None:
    """Save after step 1; during the save after step 2 one rank dies at ``point``."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from optimus_mllm.runtime import checkpoint

    trainer = _trainer()
    trainer.train_step(0)
    checkpoint.save_checkpoint(trainer, save, 1)
    trainer.train_step(1)
    rank = dist.get_rank()
    if point == "before shards" and rank == 1:
        dist_checkpointing.save = lambda *args, **kwargs: _die()
    if point == "between shards" and rank == 1:  # one tensor on disk, the rest not
        real_write = filesystem_async._write_item
        written = []

        def write_then_kill_the_rank(*args, **kwargs):
            result = real_write(*args, **kwargs)
            written.append(result)
            # in megatron-core's writer process: kill the rank that started it
            if len(written) == 1:
                os.kill(os.getppid(), signal.SIGKILL)
                _die()
            return result

        filesystem_async._write_item = functools.wraps(real_write)(write_then_kill_the_rank)
    if point == "before publish" and rank == 0:
        checkpoint._publish = lambda *args, **kwargs: _die()
    if point == "between rename and tracker" and rank == 0:
        real = checkpoint.atomic_write_text
        checkpoint.atomic_write_text = lambda path, text: (
            _die() if path.name.startswith("latest") else real(path, text)
        )
    checkpoint.save_checkpoint(trainer, save, 2)


def _uninterrupted_then_resumed(saves: list[str]) -> dict:
    """Three steps from scratch; then, one folder after the other, the resume from it to step 3."""
    from optimus_mllm.runtime import checkpoint, checkpoint_meta

    trainer = _trainer()
    uninterrupted = [(r.loss, r.grad_norm) for r in map(trainer.train_step, range(3))]
    resumed = {}
    for save in saves:
        info = checkpoint_meta.latest_checkpoint(save)
        checkpoint.load_checkpoint(trainer, info)
        resumed[save] = (
            info.iteration,
            [(r.loss, r.grad_norm) for r in map(trainer.train_step, range(info.iteration, 3))],
        )
    trainer.close()
    return {"uninterrupted": uninterrupted, "resumed": resumed}


POINTS = ("before shards", "between shards", "before publish", "between rename and tracker")


def test_a_rank_killed_while_saving_leaves_a_checkpoint_that_resumes_exactly(tmp_path):
    saves = {point: str(tmp_path / point.replace(" ", "-")) for point in POINTS}
    for point, save in saves.items():
        with pytest.raises(RuntimeError, match="rank [01] (died|failed)"):
            run_distributed(_save_then_die, 2, save, point, timeout=180)
    latest = {
        point: (Path(save) / "latest_checkpointed_iteration.txt").read_text()
        for point, save in saves.items()
    }
    assert latest == dict.fromkeys(POINTS, "1\n"), "the tracker is replaced last"
    assert (Path(saves["between rename and tracker"]) / "iter_0000002" / "meta.json").is_file()
    results = run_distributed(_uninterrupted_then_resumed, 2, list(saves.values()), timeout=240)
    for result in results:
        for point, save in saves.items():
            iteration, numbers = result["resumed"][save]
            assert iteration == 1, point
            assert numbers == result["uninterrupted"][iteration:], point


# -- damaged folders: found before any rank connects -----------------------------------------------


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory) -> Path:
    """iter_0000001 and iter_0000002 of the 2-rank job."""
    save = tmp_path_factory.mktemp("faults") / "run"
    run_distributed(_save_twice, 2, str(save), timeout=180)
    assert (save / "iter_0000002" / "meta.json").is_file() and (
        save / "iter_0000001" / "meta.json"
    ).is_file()
    return save


def _save_twice(save: str) -> None:
    from optimus_mllm.runtime import checkpoint

    trainer = _trainer()
    for i in (0, 1):
        trainer.train_step(i)
        checkpoint.save_checkpoint(trainer, save, i + 1)
    trainer.close()


def _largest_shard(folder: Path) -> Path:
    return max(folder.glob("*.distcp"), key=lambda f: f.stat().st_size)


DAMAGES = {
    "truncated shard": (
        lambda f: _largest_shard(f).write_bytes(_largest_shard(f).read_bytes()[:100]),
        "cut short",
    ),
    "missing shard": (lambda f: _largest_shard(f).unlink(), "lacks __"),
    "binary meta.json": (
        lambda f: (f / "meta.json").write_bytes(b"\xff\xfe\x00garbage"),
        "no usable meta.json",
    ),
    "incomplete meta.json": (
        lambda f: (f / "meta.json").write_text(
            json.dumps(
                {
                    k: v
                    for k, v in json.loads((f / "meta.json").read_text()).items()
                    if k != "llm_plan"
                }
            )
        ),
        "incomplete meta.json (no dict 'llm_plan')",
    ),
    "missing folder": (lambda f: shutil.rmtree(f), "does not exist"),
    "meta.json mode": (
        lambda f: _edit_meta(f, mode="text"),
        "mode 'text', not one of optimus, baseline",
    ),
    "meta.json world_size": (
        lambda f: _edit_meta(f, world_size=-1),
        "world_size -1 is not its llm_plan's",
    ),
    "meta.json llm_plan": (
        lambda f: _edit_meta(f, llm_plan={"dp": 1, "pp": 1, "tp": "1", "vp": 1}),
        "incomplete meta.json (llm_plan",
    ),
    "cut common.pt": (
        lambda f: (f / "common.pt").write_bytes((f / "common.pt").read_bytes()[:-30]),
        "unreadable common.pt",
    ),
    "bad metadata.json": (
        lambda f: (f / "metadata.json").write_text("[]"),
        "metadata.json that is not",
    ),
}


def _edit_meta(folder: Path, **fields) -> None:
    meta = json.loads((folder / "meta.json").read_text())
    (folder / "meta.json").write_text(json.dumps({**meta, **fields}))


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_latest_checkpoint_falls_back_to_the_one_before(
    two_checkpoints, tmp_path, damage
):
    from optimus_mllm.runtime.checkpoint_meta import latest_checkpoint

    save = tmp_path / "run"
    shutil.copytree(two_checkpoints, save)
    harm, why = DAMAGES[damage]
    harm(save / "iter_0000002")
    info = latest_checkpoint(save)
    assert info.iteration == 1
    assert info.passed_over.startswith(
        "latest_checkpointed_iteration.txt names iter_0000002, which "
    )
    assert why in info.passed_over and info.passed_over.endswith(
        ": resumed from iter_0000001, the newest complete checkpoint"
    )


@pytest.mark.parametrize("tracker", [b"\xb2\n", "²\n".encode(), b"\x00\x01binary", b"", b"-1\n"])
def test_a_damaged_tracker_falls_back_to_the_newest_complete_checkpoint(
    two_checkpoints, tmp_path, tracker
):
    from optimus_mllm.runtime.checkpoint_meta import latest_checkpoint

    save = tmp_path / "run"
    shutil.copytree(two_checkpoints, save)
    (save / "latest_checkpointed_iteration.txt").write_bytes(tracker)
    info = latest_checkpoint(save)
    assert info.iteration == 2 and "not an iteration number" in info.passed_over


def test_no_complete_checkpoint_is_one_error(two_checkpoints, tmp_path):
    from optimus_mllm.errors import OptimusError
    from optimus_mllm.runtime.checkpoint_meta import latest_checkpoint

    save = tmp_path / "run"
    shutil.copytree(two_checkpoints, save)
    for folder in ("iter_0000001", "iter_0000002"):
        (save / folder / "meta.json").unlink()
    with pytest.raises(
        OptimusError,
        match=r"--resume: no complete checkpoint in .*names iter_0000002, which has no "
        r"usable meta.json",
    ):
        latest_checkpoint(save)


def test_files_are_written_with_the_users_mode(two_checkpoints):
    for name in (
        "latest_checkpointed_iteration.txt",
        "iter_0000002/meta.json",
        "iter_0000002/schedule.json",
    ):
        assert (two_checkpoints / name).stat().st_mode & 0o777 == 0o666 & ~_umask(), name


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_bytes_damaged_in_place_stop_every_rank_with_one_line(
    two_checkpoints, tmp_path, monkeypatch
):
    """A shard of the right length but wrong bytes passes the launcher's check; loading then fails
    on the
    ranks that read it, and every rank stops with the same line (exit 2), before any step. CUDA_HOME
    set on a machine without a GPU (a CUDA toolkit, no driver) adds no line of torch's."""
    monkeypatch.setenv("CUDA_HOME", "/usr/local/cuda")
    save = tmp_path / "run"
    shutil.copytree(two_checkpoints, save)
    shard = _largest_shard(save / "iter_0000002")
    shard.write_bytes(b"\x00" * shard.stat().st_size)
    results = ranks(2, "--override", *TWO_RANKS, "--save", str(save), "--resume")
    assert_one_error_everywhere(results, f"loading {save / 'iter_0000002'} failed on rank")
    assert "the checkpoint is damaged: move it away" in results[0].stderr
    assert not any("resumed from" in r.stdout or "step " in r.stdout for r in results)


def test_a_checkpoint_written_before_a_model_field_existed_resumes_at_its_default():
    """meta.json from before projector.spatial_merge existed is the model with merge 1; a different
    saved value, or a field this version does not know, is still refused by name."""
    import copy

    from optimus_mllm.config import load_config
    from optimus_mllm.errors import OptimusError
    from optimus_mllm.planner import ParallelPlan
    from optimus_mllm.runtime.checkpoint_meta import CheckpointInfo, check_resumable, model_json

    config = load_config(TINY)
    older = model_json(config)
    del older["encoders"][0]["projector"]["spatial_merge"]

    def info(model: dict) -> CheckpointInfo:
        return CheckpointInfo(Path("ckpt"), 1, 4, ParallelPlan(1, 2, 2, 2), "optimus", model, {})

    check_resumable(info(older), config)
    for field, value in (("projector", {"type": "mlp", "spatial_merge": 2}), ("a_later_field", 3)):
        saved = copy.deepcopy(older)
        saved["encoders"][0][field] = value
        with pytest.raises(OptimusError, match=rf"--resume: model.encoders\[0\].{field}"):
            check_resumable(info(saved), config)
