"""The scheduler's chain for a METP encoder and the runtime's ops for it name the same kernels, in
the same order (``cost_model.metp_layer_ops``, ``layer_ops``' METP steps): the hook plan runs the
runtime's op k where the artifact put the chain's kernel k. Built on a fake 2-rank group (no
collective runs: only the layers and their steps are built)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from optimus_mllm.config import load_config
from optimus_mllm.cost_model import CostModel
from optimus_mllm.planner import ParallelPlan
from optimus_mllm.runtime.encoder_ops import build_stage_ops
from optimus_mllm.runtime.vit import EncoderStage
from optimus_mllm.scheduler.encoder_costs import build_encoder_work

from support.paths import CONFIGS

TP = 2


@pytest.fixture(scope="module")
def two_ranks() -> Iterator[dist.ProcessGroup]:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=TP)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.mark.parametrize("num_stages", [1, 2])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_metp_ops_are_the_chain(two_ranks, recompute: str, num_stages: int) -> None:
    config = load_config(CONFIGS / "metp_tiny.yaml", [f"training.recompute={recompute}"])
    llm = config.parallel.llm
    enc_plan = ParallelPlan(config.cluster.num_gpus // (num_stages * TP), num_stages, TP, 1, "metp")
    work = build_encoder_work(
        config, ParallelPlan(llm.dp, llm.pp, llm.tp), enc_plan, CostModel.from_config(config)
    )
    for stage in range(num_stages):
        encoder = EncoderStage(config, stage, num_stages, two_ranks, tp_mode="metp")
        ops = build_stage_ops(encoder.blocks(), recompute)
        for phase in ("fwd", "bwd"):
            chain = [
                (k.encoder, k.layer, k.name, k.splittable)
                for k in getattr(work, phase)[stage].kernels
            ]
            assert ops.chain(phase) == chain, (stage, phase)
            assert [op.is_comm for op in getattr(ops, phase)] == [
                k.is_comm for k in getattr(work, phase)[stage].kernels
            ]
        layer_ops = {name for _, layer, name, _ in ops.chain("fwd") if layer >= 0}
        assert layer_ops == {"ln_attn", "metp_attn", "ln_mlp", "metp_mlp"}
