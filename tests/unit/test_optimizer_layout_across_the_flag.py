"""Which optimizer states a job with ``--optimus-schedule`` saves and resumes
(``optimus_mllm.megatron.seams``): every non-distributed one (in Megatron's own layout either way);
a distributed optimizer's state neither (refused at start-up, and where a checkpoint is read), its
weights both; and no state that an earlier version saved in the chained layout (marked in the
checkpoint's folder)."""

from __future__ import annotations

from argparse import Namespace
from pathlib import Path

import pytest

from optimus_mllm.errors import OptimusError
from optimus_mllm.megatron.seams import (
    OPTIMIZER_MARK,
    _check_optimizer_layout,
    refuse_distributed_optimizer_state,
)


def _checkpoint(folder: Path, marked: bool) -> Path:
    """A Megatron-LM --save folder whose latest checkpoint is iteration 2."""
    folder.joinpath("iter_0000002").mkdir(parents=True)
    folder.joinpath("latest_checkpointed_iteration.txt").write_text("2")
    if marked:
        folder.joinpath("iter_0000002", OPTIMIZER_MARK).write_text("")
    return folder


def _args(load: Path, distributed: bool, no_load_optim: bool = False) -> Namespace:
    return Namespace(
        load=str(load),
        no_load_optim=no_load_optim,
        finetune=False,
        ckpt_step=None,
        use_distributed_optimizer=distributed,
    )


@pytest.mark.parametrize("marked", [False, True], ids=["saved-plain", "saved-chained"])
@pytest.mark.parametrize("distributed", [False, True], ids=["optimizer", "distributed-optimizer"])
def test_an_optimizer_state_resumes_only_in_megatron_s_layout_without_the_distributed_optimizer(
    marked: bool, distributed: bool, tmp_path: Path
) -> None:
    load = _checkpoint(tmp_path / "ckpt", marked)
    _check_optimizer_layout(_args(load, distributed, no_load_optim=True), "load")  # weights only
    if not marked and not distributed:  # Megatron-LM's own layout of a plain optimizer
        _check_optimizer_layout(_args(load, distributed), "load")
        return
    with pytest.raises(OptimusError) as refused:
        _check_optimizer_layout(_args(load, distributed), "load")
    said = str(refused.value)
    assert "\n" not in said and said.startswith(f"--load {load}: the checkpoint at iter_0000002 ")
    assert "--no-load-optim" in said
    if marked:
        assert "by an earlier version with --optimus-schedule and --use-distributed-opt" in said
    else:
        assert "saved without --optimus-schedule" in said
        assert "cannot yet resume a distributed optimizer's state" in said


def test_nothing_to_resume_is_no_refusal(tmp_path: Path) -> None:
    # a job's first start with --load: the folder has no checkpoint yet
    _check_optimizer_layout(_args(tmp_path / "empty", distributed=True), "load")


def _saving(distributed: bool, **flags: object) -> Namespace:
    return Namespace(
        **{
            "use_distributed_optimizer": distributed,
            "save": None,
            "no_save_optim": False,
            "non_persistent_save_interval": None,
            **flags,
        }
    )


@pytest.mark.parametrize(
    "flags",
    [{"save": "ckpt"}, {"non_persistent_save_interval": 5}],
    ids=["save", "non-persistent-save"],
)
def test_saving_a_distributed_optimizer_state_is_refused_at_start_up(flags: dict) -> None:
    with pytest.raises(OptimusError) as refused:
        refuse_distributed_optimizer_state(_saving(True, **flags))
    said = str(refused.value)
    assert "\n" not in said
    assert said.startswith("--optimus-schedule with --use-distributed-optimizer and --save: ")
    assert "--no-save-optim" in said
    # what the line offers runs: the weights alone, or another optimizer
    refuse_distributed_optimizer_state(_saving(True, no_save_optim=True, **flags))
    refuse_distributed_optimizer_state(_saving(False, **flags))
    refuse_distributed_optimizer_state(_saving(True))  # nothing saved
