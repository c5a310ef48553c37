"""Whole models in the 2D, 3D and METP tensor-parallel modes train like their 1D twin on gloo
(issues 36 and 37, acceptance 1).

Each model is a ``TPModeModel`` (input projection, a two-layer ``TransformerBlock`` with its final
norm, token classification head), seeded alike in every mode, wrapped in megatron-core's
``DistributedDataParallel``, run by its no-pipelining schedule (which calls
``finalize_model_grads``) and stepped by ``get_megatron_optimizer``'s optimizer (SGD, gradients
clipped at norm 1), for three steps on the same microbatches. Its
twin is megatron-core's 1D TP over the same ranks. Every step's loss and gradient norm equal the
twin's. The ranks start once per world size and train every model of that size: 2 ranks (1d,
metp), 4 (1d, 2d on a 2 x 2 grid, metp) and 8 (1d, 3d on a 2 x 2 x 2 cube).

megatron-core's own groups (``parallel_state``) are left at one rank of TP: every group the models,
DDP and optimizer use is passed in, so a fallback to megatron-core's globals would show as a
difference.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor

from optimus_mllm.config import TPMode
from optimus_mllm.errors import ConfigError
from optimus_mllm.runtime.llm import unfused_settings
from optimus_mllm.runtime.tp_modes.groups import build_cube_groups, build_grid_groups
from optimus_mllm.runtime.tp_modes.model import (
    TPModeGroups,
    TPModeModel,
    training_process_groups,
)

from support.distributed_utils import run_distributed
from support.megatron_ranks import group_of_this_rank, megatron_state

REL = 1e-5
STEPS, LR, SEED = 3, 0.5, 7
SEQ, BATCH, HIDDEN, HEADS, FFN, LAYERS = 4, 4, 16, 8, 32, 2
INPUTS, CLASSES = 8, 8
MODES: dict[int, tuple[TPMode, ...]] = {2: ("metp",), 4: ("2d", "metp"), 8: ("3d",)}


def _config(world: int, mode: TPMode) -> TransformerConfig:
    return TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        ffn_hidden_size=FFN,
        init_method_std=0.3,  # activations of order 1, so that the tolerance is a tight bound
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=world,
        sequence_parallel=mode != "1d",
        use_cpu_initialization=True,
        pipeline_dtype=torch.float32,
        gradient_accumulation_fusion=False,
        **unfused_settings(),
    )


def _groups(mode: TPMode) -> TPModeGroups:
    """The mode's groups over every rank (built on every rank: ``new_group`` is collective)."""
    ranks = tuple(range(dist.get_world_size()))
    world = dist.group.WORLD
    if mode == "2d":
        return TPModeGroups(mode, world, grid=build_grid_groups(ranks))
    if mode == "3d":
        return TPModeGroups(mode, world, cube=build_cube_groups(ranks))
    return TPModeGroups(mode, world)


def _train(groups: TPModeGroups, alone: dist.ProcessGroup) -> dict[str, list[float]]:
    """Every step's mean loss and gradient norm of a model in ``groups.mode``."""
    world = groups.tp.size()
    config = _config(world, groups.mode)
    torch.manual_seed(SEED)
    model = TPModeModel(config, groups, INPUTS, CLASSES)
    process_groups = training_process_groups(groups, dp=alone, alone=alone, instance=groups.tp)
    ddp = DistributedDataParallel(
        config,
        DistributedDataParallelConfig(grad_reduce_in_fp32=True),
        model,
        pg_collection=process_groups,
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="sgd", lr=LR, sgd_momentum=0.0, weight_decay=0.0, clip_grad=1.0),
        [ddp],
        use_gloo_process_groups=False,
        pg_collection=process_groups,
    )
    config.finalize_model_grads_func = finalize_model_grads  # the schedule calls it

    def forward_step(batches: Iterator[tuple[Tensor, Tensor]], module: Any) -> tuple[Tensor, Any]:
        share = module(*next(batches))
        return share, lambda loss: (loss, {"loss": model.mean_loss(loss)})

    data = torch.Generator().manual_seed(SEED + 1)
    losses, norms = [], []
    for _ in range(STEPS):
        inputs = torch.randn(SEQ, BATCH, INPUTS, generator=data)
        labels = torch.randint(CLASSES, (SEQ, BATCH), generator=data)
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        (reported,) = forward_backward_no_pipelining(
            forward_step_func=forward_step,
            data_iterator=iter([(inputs, labels)]),
            model=[ddp],
            num_microbatches=1,
            seq_length=SEQ,
            micro_batch_size=BATCH,
            pg_collection=process_groups,
        )
        stepped, norm, _ = optimizer.step()
        assert stepped
        losses.append(reported["loss"].item())
        norms.append(float(norm))
    return {"losses": losses, "grad norms": norms}


def _refusal(world: int) -> str:
    """What a METP model says of a config without sequence parallelism."""
    try:
        TPModeModel(_config(world, "1d"), _groups("metp"), INPUTS, CLASSES)
    except ConfigError as error:
        return str(error)
    return "built"


def _rank(modes: tuple[TPMode, ...]) -> dict[str, Any]:
    warnings.simplefilter("ignore")  # the modes' "experimental" warnings, on every rank
    world = dist.get_world_size()
    alone = group_of_this_rank()
    with megatron_state():
        trained = {mode: _train(_groups(mode), alone) for mode in ("1d", *modes)}
        return {"trained": trained, "refusal": _refusal(world) if "metp" in modes else None}


@pytest.mark.distributed
@pytest.mark.parametrize("world", sorted(MODES))
def test_models_train_like_their_1d_twin(world: int) -> None:
    results: list[dict[str, Any]] = run_distributed(_rank, world, MODES[world], timeout=180.0)
    twin = results[0]["trained"]["1d"]
    # the twin trains: its loss moves
    assert abs(twin["losses"][-1] - twin["losses"][0]) > 100 * REL * abs(twin["losses"][0])
    for rank, result in enumerate(results):
        if result["refusal"] is not None:
            assert result["refusal"].startswith("sequence_parallel: set it True for metp")
        for mode, trained in result["trained"].items():
            print(f"{world} ranks, rank {rank}, {mode}: {trained}")
            for what in ("losses", "grad norms"):
                for step, (got, want) in enumerate(zip(trained[what], twin[what], strict=True)):
                    assert math.isclose(got, want, rel_tol=REL), (rank, mode, what, step, got, want)
