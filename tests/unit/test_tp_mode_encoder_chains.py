"""The scheduler's chain for a METP or 2D encoder and the runtime's ops for it name the same
kernels, in the same order (``cost_model.runtime_layer_ops``, ``layer_ops``' METP and 2D steps):
the hook plan runs the runtime's op k where the artifact put the chain's kernel k. Built on a fake
4-rank job as its rank 0 (no collective runs: only the layers and their steps are built)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from optimus_mllm.config import load_config
from optimus_mllm.costing.cost_model import CostModel
from optimus_mllm.planner import ParallelPlan
from optimus_mllm.runtime.encoder_ops import build_stage_ops
from optimus_mllm.runtime.tp_modes.groups import build_grid_groups
from optimus_mllm.runtime.vit import EncoderStage
from optimus_mllm.scheduler.encoder_costs import build_encoder_work

from support.paths import CONFIGS

WORLD = 4
# mode: (config, TP degree, the ops of one layer's forward)
MODES = {
    "metp": ("metp_tiny.yaml", 2, ["ln_attn", "metp_attn", "ln_mlp", "metp_mlp"]),
    "2d": (
        "summa_tiny.yaml",
        4,
        ["ln_attn", "qkv", "attn_core", "attn_proj", "ln_mlp", "fc1", "act", "fc2"],
    ),
}


@pytest.fixture(scope="module")
def job() -> Iterator[None]:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    yield
    dist.destroy_process_group()


# every mode, recomputation and stage count the runtime trains: 2d encoders run in one stage,
# without selective recomputation (tp_modes.trained, Trainer refuse the rest)
CASES = [
    (mode, recompute, num_stages)
    for mode in MODES
    for recompute in ("none", "selective", "full")
    for num_stages in (1, 2)
    if mode != "2d" or (recompute != "selective" and num_stages == 1)
]


@pytest.mark.parametrize("mode, recompute, num_stages", CASES)
def test_runtime_ops_are_the_chain(job, mode: str, recompute: str, num_stages: int) -> None:
    name, tp, layer_ops = MODES[mode]
    config = load_config(CONFIGS / name, [f"training.recompute={recompute}"])
    llm = config.parallel.llm
    enc_plan = ParallelPlan(WORLD // (num_stages * tp), num_stages, tp, 1, mode)
    work = build_encoder_work(
        config, ParallelPlan(llm.dp, llm.pp, llm.tp), enc_plan, CostModel.from_config(config)
    )
    group = dist.new_group(list(range(tp)))
    grid = build_grid_groups(tuple(range(tp))) if mode == "2d" else None
    for stage in range(num_stages):
        encoder = EncoderStage(config, stage, num_stages, group, tp_mode=mode, grid=grid)
        ops = build_stage_ops(encoder.blocks(), recompute)
        for phase in ("fwd", "bwd"):
            kernels = getattr(work, phase)[stage].kernels
            assert ops.chain(phase) == [
                (k.encoder, k.layer, k.name, k.splittable) for k in kernels
            ], (stage, phase)
            assert [op.is_comm for op in getattr(ops, phase)] == [k.is_comm for k in kernels]
        first = min(layer for _, layer, _, _ in ops.chain("fwd") if layer >= 0)
        assert [n for _, layer, n, _ in ops.chain("fwd") if layer == first] == layer_ops


def test_metp_layers_are_checkpointed_as_their_tp_shards(job) -> None:
    """A METP layer's sharded state (what ``sharded_state`` saves per layer) holds each linear's
    shard of the whole tensor, as 1D TP's does, not a replica per rank, and its norms under
    ``vision_layer_spec``'s keys: a resumed METP run gets its own shards back."""
    from optimus_mllm.runtime.sharded_state import sharded_tensors

    config = load_config(CONFIGS / "metp_tiny.yaml")
    enc = config.encoders[0]
    stage = EncoderStage(config, 0, 1, dist.new_group([0, 1]), tp_mode="metp")
    layer = stage.encoders[enc.name].layers[0]
    metadata = {"dp_cp_group": dist.new_group([0])}
    tensors = sharded_tensors(layer.sharded_state_dict("", ((0, 0, enc.num_layers),), metadata))
    whole = {
        "self_attention.linear_qkv.weight": (3 * enc.hidden_size, enc.hidden_size),
        "self_attention.linear_proj.weight": (enc.hidden_size, enc.hidden_size),
        "mlp.linear_fc1.weight": (enc.ffn_hidden_size, enc.hidden_size),
        "mlp.linear_fc2.weight": (enc.hidden_size, enc.ffn_hidden_size),
        "self_attention.linear_qkv.layer_norm_weight": (enc.hidden_size,),
    }
    for name, shape in whole.items():
        (first, *_) = tensors[name]
        assert first.global_shape == (enc.num_layers, *shape), name
