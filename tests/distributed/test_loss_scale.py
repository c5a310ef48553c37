"""fp16's dynamic loss scale under the Optimus runtime: one scale for the LLM's and the encoder's
optimizer
parts, and a checkpoint that resumes it exactly.

megatron-core's ``ChainedOptimizer`` scales the loss by its first part's scale but lets every part
back off its own: an overflow in the LLM's gradients alone would leave the encoder's gradients
unscaled by a scale the loss no longer carries (``runtime.optimizer.OneLossScaleOptimizer``).
"""

from __future__ import annotations

import shutil

import pytest

from optimus_mllm.scheduler.artifact_format import ScheduleArtifact

from support.artifact_utils import artifact_for
from support.distributed_utils import run_distributed
from support.train_utils import TINY, step_numbers, torchrun

pytestmark = pytest.mark.distributed

ONE_RANK = [
    "cluster.num_gpus=1",
    "cluster.gpus_per_node=1",
    "parallel.llm={dp: 1, pp: 1, tp: 1, vp: 1}",
    "training.precision=fp16",
    "training.initial_loss_scale=1024",
    "training.hysteresis=1",
]


def _overflow_in_the_llm_only(artifact: ScheduleArtifact) -> dict:
    """One Optimus step whose LLM gradients hold an inf and whose encoder gradients are all 1."""
    from optimus_mllm.config import load_config
    from optimus_mllm.planner import plan
    from optimus_mllm.runtime.trainer import Trainer

    config = load_config(TINY, ONE_RANK)
    trainer = Trainer(config, plan(config).llm_plan, "optimus", artifact)
    try:
        optimizer = trainer.optimizer
        before = optimizer.get_loss_scale().item()
        for model in trainer.ddp_models:
            model.zero_grad_buffer()
            for param in model.module.parameters():
                param.main_grad.fill_(1.0)
        next(trainer.models[0].module.parameters()).main_grad[0] = float("inf")
        updated = optimizer.step()[0]
        after = [part.get_loss_scale().item() for part in optimizer.chained_optimizers]
        # a finite step next: the encoder's main gradients are its model gradients over the one
        # scale
        for model in trainer.ddp_models:
            for param in model.module.parameters():
                param.main_grad.fill_(1.0)
        optimizer.prepare_grads()
        encoder_part = optimizer.chained_optimizers[-1]
        unscaled = {float(g.max()) for g in encoder_part.get_main_grads_for_grad_norm()}
        return {
            "before": before,
            "updated": updated,
            "after": after,
            "unscaled": sorted(unscaled),
            "parts": len(optimizer.chained_optimizers),
        }
    finally:
        trainer.close()


def test_an_overflow_in_the_llm_alone_backs_off_the_one_loss_scale():
    [result] = run_distributed(
        _overflow_in_the_llm_only, 1, artifact_for(TINY, ONE_RANK), timeout=120
    )
    assert result["parts"] == 2, "the LLM and the encoder each have an optimizer part"
    assert result["before"] == 1024.0 and not result["updated"]
    assert result["after"] == [512.0, 512.0]
    assert result["unscaled"] == [1.0 / 512]


# fp16 on 2 ranks (LLM DP2, so the distributed optimizer shards) from a loss scale at which steps 1
# and 2 overflow (each backs off, hysteresis 1), step 3 updates and step 4 updates and grows the
# scale (window 2): a resume after step 1 starts from parts with no Adam state yet; one after step 3
# must carry the scaler's count of clean steps
FP16 = [
    "cluster.num_gpus=2",
    "cluster.gpus_per_node=2",
    "parallel.llm={dp: 2, pp: 1, tp: 1, vp: 1}",
    "training.precision=fp16",
    "training.initial_loss_scale=65536",
    "training.hysteresis=1",
    "training.loss_scale_window=2",
    "training.train_iters=5",
]


def test_fp16_resume_continues_the_loss_scale(tmp_path):
    save = tmp_path / "run"
    uninterrupted = step_numbers(
        torchrun("--override", *FP16, "--save", str(save), "--save-interval", "1", nproc=2)
    )
    assert ["skipped" in uninterrupted[step] for step in range(1, 6)] == [
        True,
        True,
        False,
        False,
        False,
    ]
    assert [uninterrupted[step].split("loss scale ")[1] for step in (3, 4)] == [
        "16384.0",
        "32768.0",
    ]
    for iteration in (1, 3):
        resumed = tmp_path / f"from_{iteration}"
        shutil.copytree(save, resumed)
        # roll back, Megatron's way
        (resumed / "latest_checkpointed_iteration.txt").write_text(f"{iteration}\n")
        lines = torchrun("--override", *FP16, "--save", str(resumed), "--resume", nproc=2)
        assert lines[0] == f"resumed from {resumed / f'iter_{iteration:07d}'} at step {iteration}"
        assert step_numbers(lines) == {
            step: uninterrupted[step] for step in range(iteration + 1, 6)
        }
