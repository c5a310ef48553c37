"""Checkpoints: resuming gives the uninterrupted run's losses, gradient norms and learning rates (AdamW
moments, step counts and the LR schedule restored); a failed or killed write keeps the previous one.

The launcher tests train the tiny config on 4 CPU processes (torchrun); the write-failure test drives
``save_checkpoint`` on 4 gloo ranks in-process and makes one rank's ``torch.save`` raise midway.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.distributed_utils import run_distributed
from tests.train_utils import TINY, assert_one_error_everywhere, ranks, step_numbers, torchrun

SIX = "training.train_iters=6"
# warm-up, then cosine decay: the resumed steps' learning rates come from the restored schedule; dropout:
# its masks come from the iteration and microbatch alone, so no generator state needs restoring
RUN = ["training.lr_warmup_iters=2", "training.lr_decay_style=cosine", "training.lr=1e-3", "training.min_lr=1e-4",
       *(f"model.{part}.{name}=0.1" for part in ("llm", "encoders.0")
         for name in ("hidden_dropout", "attention_dropout"))]
EIGHT_RANKS = ["cluster.num_gpus=8", "cluster.gpus_per_node=8", "parallel.llm={dp: 2, pp: 2, tp: 2, vp: 2}"]


@pytest.fixture(scope="module")
def uninterrupted() -> dict[int, str]:
    return step_numbers(torchrun("--override", SIX, *RUN))


@pytest.fixture(scope="module")
def first_half(tmp_path_factory) -> Path:
    """Steps 1-3 of the 6-step run, checkpointed after each step."""
    save = tmp_path_factory.mktemp("ckpt") / "run"
    lines = torchrun("--override", SIX, *RUN, "training.train_iters=3", "training.lr_decay_iters=6",
                     "--save", str(save), "--save-interval", "1")
    assert [line for line in lines if line.startswith("saved checkpoint")] == [
        f"saved checkpoint {save / f'iter_000000{i}'}" for i in (1, 2, 3)]
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "3\n"
    assert not list(save.glob("*.tmp"))
    return save


def test_resume_gives_the_uninterrupted_losses(uninterrupted, first_half, tmp_path):
    save = tmp_path / "run"
    shutil.copytree(first_half, save)
    lines = torchrun("--override", SIX, *RUN, "training.lr_decay_iters=6", "--save", str(save), "--resume")
    assert lines[0] == f"resumed from {save / 'iter_0000003'} at step 3"
    assert lines[1] == "schedule: the one saved with the checkpoint"
    resumed = step_numbers(lines)
    assert sorted(resumed) == [4, 5, 6]
    assert resumed == {step: uninterrupted[step] for step in (4, 5, 6)}
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "6\n"


def test_resume_without_the_optimizer_state(uninterrupted, first_half, tmp_path):
    """Another optimizer or another world size: the saved per-rank optimizer state cannot load; with
    --no-load-optim the weights and the LR schedule do, the encoder schedule is re-planned."""
    save = tmp_path / "run"
    shutil.copytree(first_half, save)
    resume = ("--save", str(save), "--resume")
    assert_one_error_everywhere(ranks(4, "--override", SIX, *RUN, "training.lr_decay_iters=6",
                                      "training.optimizer=sgd", *resume),
                                "optimizer layout.optimizer differs from this job's")
    assert_one_error_everywhere(ranks(4, "--override", SIX, *RUN, "--no-load-optim"),
                                "--no-load-optim applies to --resume")
    lines = torchrun("--override", SIX, *RUN, "training.lr_decay_iters=6", *EIGHT_RANKS, *resume,
                     "--no-load-optim", nproc=8)
    assert lines[1] == "the checkpoint was written by 4 ranks, this job has 8: re-planned the encoder schedule"
    resumed = step_numbers(lines)
    assert sorted(resumed) == [4, 5, 6]
    # the schedule's position came back: the same learning rates; a fresh Adam state gives other numbers
    assert [resumed[s].split("| lr ")[1] for s in (4, 5, 6)] == [uninterrupted[s].split("| lr ")[1] for s in (4, 5, 6)]
    assert resumed[5] != uninterrupted[5]


def test_resume_errors_on_every_rank(first_half, tmp_path):
    assert_one_error_everywhere(ranks(4, "--resume"), "--resume needs --save DIR")
    assert_one_error_everywhere(ranks(4, "--save", str(tmp_path / "empty"), "--resume"),
                                "no checkpoint in")
    other_tp = "parallel.llm={dp: 2, pp: 2, tp: 1, vp: 2}"
    assert_one_error_everywhere(ranks(4, "--override", SIX, other_tp, "--save", str(first_half), "--resume"),
                                "resume with parallel.llm tp=2 pp=2 vp=2")
    assert_one_error_everywhere(ranks(4, "--override", SIX, "model.llm.num_layers=8", "--save", str(first_half),
                                      "--resume"), "model.llm.num_layers differs from the checkpoint")
    assert_one_error_everywhere(ranks(4, "--save", str(first_half), "--resume"),
                                "raise training.train_iters to train further")


# -- an interrupted write ------------------------------------------------------------------------


def _interrupted(save: str) -> dict:
    """Save after step 1; make rank 1's writer fail while saving after step 2; reload and redo step 2."""
    import torch

    from optimus_mllm.config import load_config
    from optimus_mllm.errors import OptimusError
    from optimus_mllm.planner import plan
    from optimus_mllm.runtime import checkpoint, checkpoint_meta
    from optimus_mllm.runtime.trainer import Trainer
    from optimus_mllm.scheduler.artifact import schedule_job_artifact

    config = load_config(TINY)
    planned = plan(config)
    artifact = schedule_job_artifact(config, planned)
    trainer = Trainer(config, planned.llm_plan, "optimus", artifact)
    trainer.train_step(0)
    checkpoint.save_checkpoint(trainer, save, 1)
    second = trainer.train_step(1).loss

    real_save, rank = torch.save, torch.distributed.get_rank()

    def failing_save(obj, path, *args, **kwargs):
        real_save(obj, path, *args, **kwargs)
        if rank == 1:  # a file is already on disk when the writer dies
            raise OSError("disk full")

    checkpoint.torch.save = failing_save
    try:
        checkpoint.save_checkpoint(trainer, save, 2)
        error = None
    except OptimusError as exc:
        error = str(exc)
    finally:
        checkpoint.torch.save = real_save
    trainer.close()

    info = checkpoint_meta.latest_checkpoint(save)
    fresh = Trainer(config, planned.llm_plan, "optimus", artifact)
    checkpoint.load_checkpoint(fresh, info)
    redo = fresh.train_step(1).loss
    fresh.close()
    return {"error": error, "latest": info.iteration, "second": second, "redo": redo}


def test_failed_write_keeps_the_previous_checkpoint_loadable(tmp_path):
    save = tmp_path / "run"
    results = run_distributed(_interrupted, 4, str(save), timeout=240)
    assert [r["error"] for r in results] == [
        "checkpoint writing failed on rank 1 (OSError: disk full); the previous checkpoint is still the latest"] * 4
    assert [r["latest"] for r in results] == [1] * 4
    assert (save / "iter_0000002.tmp").is_dir() and not (save / "iter_0000002").exists()
    losses = [(r["second"], r["redo"]) for r in results if r["second"] is not None]
    assert losses and all(second == redo for second, redo in losses)


def test_killed_writer_leftovers_do_not_count(first_half, tmp_path):
    """A writer killed before publishing leaves only an ``.tmp`` folder: the latest stays, and resuming works."""
    save = tmp_path / "run"
    shutil.copytree(first_half, save)
    shutil.rmtree(save / "iter_0000003")
    (save / "latest_checkpointed_iteration.txt").write_text("2\n")
    shutil.copytree(first_half / "iter_0000003", save / "iter_0000003.tmp")
    (save / "iter_0000003.tmp" / "meta.json").unlink()
    lines = torchrun("--override", "training.train_iters=3", "--save", str(save), "--resume")
    assert lines[0] == f"resumed from {save / 'iter_0000002'} at step 2"
    assert not (save / "iter_0000003.tmp").exists() and (save / "iter_0000003" / "meta.json").is_file()


def _weights_after_an_update_with_a_fresh_optimizer(save: str) -> dict:
    """bf16 on one rank: train 2 steps and save; a fresh job loads the weights with a fresh optimizer
    (``--no-load-optim``) and takes an update from zero gradients (no weight decay), which leaves the
    optimizer's fp32 main weights as they are and writes them into the model's."""
    from optimus_mllm.config import load_config
    from optimus_mllm.planner import plan
    from optimus_mllm.runtime import checkpoint, checkpoint_meta
    from optimus_mllm.runtime.trainer import Trainer
    from optimus_mllm.scheduler.artifact import schedule_job_artifact

    config = load_config(TINY, ["cluster.num_gpus=1", "cluster.gpus_per_node=1", "training.precision=bf16",
                                "parallel.llm={dp: 1, pp: 1, tp: 1, vp: 1}", "training.lr=1e-2",
                                "training.weight_decay=0"])
    planned = plan(config)
    artifact = schedule_job_artifact(config, planned)

    def weights(trainer: Trainer) -> dict:
        modules = [*trainer.chunks, trainer.encoder]
        return {f"{i}.{name}": p.detach().float().numpy().copy() for i, module in enumerate(modules)
                for name, p in module.named_parameters()}

    trained = Trainer(config, planned.llm_plan, "optimus", artifact)
    trained.train_step(0)
    trained.train_step(1)
    checkpoint.save_checkpoint(trained, save, 2)
    saved = weights(trained)
    trained.close()
    fresh = Trainer(config, planned.llm_plan, "optimus", artifact)
    initial = weights(fresh)
    checkpoint.load_checkpoint(fresh, checkpoint_meta.latest_checkpoint(save), load_optimizer=False)
    for model in fresh.ddp_models:
        model.zero_grad_buffer()
    fresh.optimizer.step()
    after = weights(fresh)
    fresh.close()
    return {"saved": saved, "initial": initial, "after": after}


def test_no_load_optim_updates_the_loaded_weights(tmp_path):
    """The optimizer's fp32 main weights are reloaded from the loaded bf16 ones, as Megatron-LM does; they
    used to keep the initial weights, which the first update then wrote back over the loaded ones."""
    [result] = run_distributed(_weights_after_an_update_with_a_fresh_optimizer, 1, str(tmp_path / "run"),
                               timeout=180)
    assert all((result["saved"][name] != result["initial"][name]).any() for name in result["saved"])
    for name, weight in result["saved"].items():
        assert (result["after"][name] == weight).all(), name
