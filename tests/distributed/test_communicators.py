"""runtime/communicators.py: every group the runtime uses has had its first operation (NCCL creates
its communicator there) before the first schedule step, on 4 gloo ranks of the tiny config."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from support.distributed_utils import run_distributed
from support.paths import CONFIGS

pytestmark = pytest.mark.distributed

RECORDED = ("all_reduce", "send", "recv", "isend", "irecv")


def _groups_without_a_first_use() -> list[str]:
    from megatron.core import parallel_state

    from optimus_mllm.config import load_config
    from optimus_mllm.planner import plan
    from optimus_mllm.runtime.trainer import Trainer
    from optimus_mllm.scheduler.artifact import schedule_job_artifact

    used: dict[int, set[str]] = {}
    for name in RECORDED:
        call = getattr(dist, name)

        def recording(*args, _name=name, _call=call, group=None, **kwargs):
            used.setdefault(id(group or dist.group.WORLD), set()).add(_name)
            return _call(*args, group=group, **kwargs)

        setattr(dist, name, recording)
    config = load_config(CONFIGS / "tiny.yaml")
    planned = plan(config)
    trainer = Trainer(config, planned.llm_plan, "optimus", schedule_job_artifact(config, planned))
    try:  # what the trainer's constructor did, i.e. before the first step
        collective = {
            "llm tp": parallel_state.get_tensor_model_parallel_group(),
            "llm pp": parallel_state.get_pipeline_model_parallel_group(),
            "llm dp": parallel_state.get_data_parallel_group(with_context_parallel=True),
            "encoder tp": trainer.groups.tp_group,
            "encoder pp": trainer.groups.pp_group,
            "encoder dp": trainer.groups.dp_group,
            "encoder mp": trainer.groups.mp_group,
        }
        channels = {f"encoder {c}": g for c, g in trainer.groups.channels.items()}
        pipeline = trainer.communicator.channels
        channels.update(
            {f"llm pipeline {n}": getattr(pipeline, n) for n in pipeline.__dataclass_fields__}
        )
        missing = [n for n, g in collective.items() if "all_reduce" not in used.get(id(g), ())]
        missing += [n for n, g in channels.items() if not {"send", "recv"} & used.get(id(g), set())]
        return missing
    finally:
        trainer.close()


def test_every_group_has_its_communicator_before_the_first_step():
    per_rank = run_distributed(_groups_without_a_first_use, 4, timeout=300)
    assert per_rank == [[]] * 4, per_rank
