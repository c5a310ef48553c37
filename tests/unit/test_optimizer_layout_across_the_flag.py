"""Which optimizer states a job with ``--optimus-schedule`` saves and resumes
(``optimus_mllm.megatron.seams``): every optimizer's, the distributed one's in
``--ckpt-format torch`` only (other formats are refused at start-up, the weights still save and
load); not a checkpoint missing a rank's distributed optimizer's state; and no state that an earlier
version saved in the chained layout (marked in the checkpoint's folder)."""

from __future__ import annotations

from argparse import Namespace
from pathlib import Path

import pytest

from optimus_mllm.errors import OptimusError
from optimus_mllm.megatron.seams import (
    OPTIMIZER_MARK,
    _check_optimizer_layout,
    refuse_distributed_optimizer_checkpoints,
)


def _checkpoint(folder: Path, marked: bool, distrib_optim: bool = True) -> Path:
    """A Megatron-LM --save folder whose latest checkpoint is iteration 2 (torch format, two
    model-parallel ranks' folders), the distributed optimizer's state in each where
    ``distrib_optim``."""
    iteration = folder / "iter_0000002"
    for rank in ("mp_rank_00_000", "mp_rank_00_001"):
        iteration.joinpath(rank).mkdir(parents=True)
        iteration.joinpath(rank, "model_optim_rng.pt").write_bytes(b"")
        if distrib_optim:
            iteration.joinpath(rank, "distrib_optim.pt").write_bytes(b"")
    folder.joinpath("latest_checkpointed_iteration.txt").write_text("2")
    if marked:
        iteration.joinpath(OPTIMIZER_MARK).write_text("")
    return folder


def _args(load: Path, distributed: bool, no_load_optim: bool = False) -> Namespace:
    return Namespace(
        load=str(load),
        no_load_optim=no_load_optim,
        finetune=False,
        ckpt_step=None,
        use_distributed_optimizer=distributed,
    )


@pytest.mark.parametrize("distributed", [False, True], ids=["optimizer", "distributed-optimizer"])
def test_an_optimizer_state_in_megatron_s_layout_resumes(distributed: bool, tmp_path: Path) -> None:
    load = _checkpoint(tmp_path / "ckpt", marked=False)
    _check_optimizer_layout(_args(load, distributed), "load")
    _check_optimizer_layout(_args(load, distributed, no_load_optim=True), "load")


@pytest.mark.parametrize("distributed", [False, True], ids=["optimizer", "distributed-optimizer"])
def test_the_chained_layout_of_earlier_versions_is_refused(
    distributed: bool, tmp_path: Path
) -> None:
    load = _checkpoint(tmp_path / "ckpt", marked=True)
    _check_optimizer_layout(_args(load, distributed, no_load_optim=True), "load")  # weights only
    with pytest.raises(OptimusError) as refused:
        _check_optimizer_layout(_args(load, distributed), "load")
    said = str(refused.value)
    assert "\n" not in said and said.startswith(f"--load {load}: the checkpoint at iter_0000002 ")
    assert "by an earlier version with --optimus-schedule and --use-distributed-opt" in said
    assert "--no-load-optim" in said


def test_a_checkpoint_without_the_distributed_optimizer_s_state_is_refused(
    tmp_path: Path,
) -> None:
    # saved with --no-save-optim, or a save that did not finish: one line naming the file, before
    # Megatron-LM reads anything (its own KeyError would be a traceback on every rank)
    load = _checkpoint(tmp_path / "ckpt", marked=False, distrib_optim=False)
    _check_optimizer_layout(_args(load, distributed=False), "load")  # no such file to expect
    _check_optimizer_layout(_args(load, True, no_load_optim=True), "load")
    with pytest.raises(OptimusError) as refused:
        _check_optimizer_layout(_args(load, distributed=True), "load")
    said = str(refused.value)
    assert "\n" not in said and said.startswith(f"--load {load}: the checkpoint at iter_0000002 ")
    assert f"{load}/iter_0000002/mp_rank_00_000/distrib_optim.pt" in said
    assert "--no-load-optim" in said


def test_nothing_to_resume_is_no_refusal(tmp_path: Path) -> None:
    # a job's first start with --load: the folder has no checkpoint yet
    _check_optimizer_layout(_args(tmp_path / "empty", distributed=True), "load")


def _flags(distributed: bool = True, **flags: object) -> Namespace:
    return Namespace(
        **{
            "use_distributed_optimizer": distributed,
            "save": None,
            "load": None,
            "no_save_optim": False,
            "no_load_optim": False,
            "non_persistent_save_interval": None,
            "non_persistent_ckpt_type": None,
            "ckpt_format": "torch",
            **flags,
        }
    )


@pytest.mark.parametrize(
    "flags",
    [
        {"save": "ckpt", "ckpt_format": "torch_dist"},
        {"load": "ckpt", "ckpt_format": "torch_dist"},
        {"non_persistent_save_interval": 5, "non_persistent_ckpt_type": "global"},
    ],
    ids=["save-torch-dist", "load-torch-dist", "non-persistent-save"],
)
def test_a_distributed_optimizer_state_in_another_format_is_refused_at_start_up(
    flags: dict,
) -> None:
    with pytest.raises(OptimusError) as refused:
        refuse_distributed_optimizer_checkpoints(_flags(**flags))
    said = str(refused.value)
    assert "\n" not in said
    assert said.startswith("--optimus-schedule with --use-distributed-optimizer and --ckpt-format ")
    assert "--ckpt-format torch" in said and "--no-save-optim / --no-load-optim" in said
    # what the line offers runs: the weights alone, or another optimizer
    refuse_distributed_optimizer_checkpoints(
        _flags(**flags, no_save_optim=True, no_load_optim=True)
    )
    refuse_distributed_optimizer_checkpoints(_flags(False, **flags))


def test_the_distributed_optimizer_s_state_in_torch_format_saves_and_resumes() -> None:
    refuse_distributed_optimizer_checkpoints(_flags(save="ckpt", load="ckpt"))
    refuse_distributed_optimizer_checkpoints(_flags())  # nothing saved
