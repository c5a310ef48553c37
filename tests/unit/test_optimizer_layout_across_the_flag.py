"""Which optimizer states a job with ``--optimus-schedule`` resumes (``megatron_lm_seams``): every
non-distributed one (saved in Megatron's own layout either way), and a distributed optimizer's only
when the flag saved it (the chained layout, marked in the checkpoint's folder)."""

from __future__ import annotations

from argparse import Namespace
from pathlib import Path

import pytest

from optimus_mllm.errors import OptimusError
from optimus_mllm.megatron_lm_seams import OPTIMIZER_MARK, _check_optimizer_layout


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


@pytest.mark.parametrize("marked", [False, True], ids=["saved-plain", "saved-flagged"])
@pytest.mark.parametrize("distributed", [False, True], ids=["optimizer", "distributed-optimizer"])
def test_an_optimizer_state_resumes_unless_its_layout_is_the_other_optimizers(
    marked: bool, distributed: bool, tmp_path: Path
) -> None:
    load = _checkpoint(tmp_path / "ckpt", marked)
    _check_optimizer_layout(_args(load, distributed, no_load_optim=True), "load")  # weights only
    if marked == distributed:  # the plain layout, or the flag's own distributed layout
        _check_optimizer_layout(_args(load, distributed), "load")
        return
    with pytest.raises(OptimusError) as refused:
        _check_optimizer_layout(_args(load, distributed), "load")
    said = str(refused.value)
    assert "\n" not in said and said.startswith(f"--load {load}: the checkpoint at iter_0000002 ")
    assert "--no-load-optim" in said
    if distributed:
        assert "saved without --optimus-schedule" in said
    else:
        assert "with --optimus-schedule and --use-distributed-optimizer" in said
