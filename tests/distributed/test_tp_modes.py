"""2D (SUMMA) tensor parallelism on a 2 x 2 grid of gloo ranks equals the 1-rank computation.

Every rank builds the 1-rank reference itself (megatron-core's local GPT layer, its MLP, a plain
linear) on a one-rank TP group, then the 2D twin holding the reference's weights cut in blocks,
and compares its own blocks: of the output, of the input gradient and of every weight gradient.
Each element of every tensor is some rank's block (the vectors are row 0's), so together the ranks
compare everything. One ``run_distributed`` does all cases: the ranks start once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor, nn

from optimus_mllm.config import TPMode, TransformerSpec
from optimus_mllm.costing.tp_footprint import (
    LayerShape,
    activation_bytes_1d,
    activation_bytes_2d,
    activation_bytes_3d,
    parameter_bytes_1d,
    parameter_bytes_2d,
    parameter_bytes_3d,
)
from optimus_mllm.costing.tp_memory import LayerBytes, layer_bytes
from optimus_mllm.runtime.llm import causal_mask, unfused_settings
from optimus_mllm.runtime.tp_modes.groups import (
    Cube3D,
    Grid2D,
    build_cube_groups,
    build_grid_groups,
)
from optimus_mllm.runtime.tp_modes.layers_2d import Linear2D, get_2d_layer_spec
from optimus_mllm.runtime.tp_modes.layers_3d import Linear3D, get_3d_layer_spec

from support.distributed_utils import run_distributed
from support.megatron_ranks import megatron_state
from support.tensor_accounting import held_bytes

SEQ, BATCH, HIDDEN, HEADS, FFN = 4, 4, 16, 8, 32
# Every error is relative to the largest magnitude of the reference's block, since fp32 rounds
# relative to the values' size. A twin's value is the reference's sums taken in another order
# (partial sums over the grid's or cube's ranks): reordering a sum of n terms moves it by up to
# n * eps of its terms' magnitude, and nested sums add their depths. The longest chain here is a
# layer norm's weight gradient: the FFN terms of fc1's input gradient, then a sum over the
# SEQ * BATCH tokens. (Measured here: at most 9 eps, on the 3D cube's input_layernorm.weight; an
# absolute 1e-5 failed there by 5 %. A wrong block is off by order 1.)
TOL = (FFN + SEQ * BATCH) * torch.finfo(torch.float32).eps


def _config() -> TransformerConfig:
    return TransformerConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        ffn_hidden_size=FFN,
        init_method_std=0.3,  # outputs of order 1
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        pipeline_dtype=torch.float32,
        gradient_accumulation_fusion=False,
        **unfused_settings(),
    )


def _block(full: Tensor, grid: Grid2D, dims: tuple[int, int]) -> Tensor:
    """Block (i, j) of ``full`` split q ways along ``dims`` (the token dim, the hidden dim)."""
    for dim, index in zip(dims, (grid.row, grid.column), strict=True):
        full = full.tensor_split(grid.q, dim=dim)[index]
    return full


def _param_block(full: Tensor, grid: Grid2D) -> Tensor:
    """This rank's share of a reference parameter: block (j, i) of a ``[out, in]`` weight (block
    (i, j) of W = weight^T), block j of a vector."""
    if full.dim() == 2:
        return _block(full, grid, (1, 0))
    return full.tensor_split(grid.q)[grid.column]


@dataclass(frozen=True)
class _Share:
    """What one rank of a grid or a cube holds of the 1-rank reference's tensors."""

    activation: Callable[[Tensor], Tensor]
    parameter: Callable[[str, Tensor], Tensor]  # of the parameter's name and value
    hosts_vectors: bool  # whether the rank holds vector parameters (a host of theirs)


def _grid_share(grid: Grid2D, dims: tuple[int, int]) -> _Share:
    """Rank (i, j)'s share: block (i, j) of an activation split along ``dims`` (the token dim, the
    hidden dim), ``_param_block`` of a parameter, the vectors on row 0."""
    return _Share(
        lambda full: _block(full, grid, dims),
        lambda _, full: _param_block(full, grid),
        grid.row == 0,
    )


def _load_blocks(twin: nn.Module, reference: nn.Module, share: _Share) -> None:
    full = dict(reference.named_parameters())
    with torch.no_grad():
        for name, p in twin.named_parameters():
            p.copy_(share.parameter(name, full[name]))


def _relative_error(got: Tensor, want: Tensor) -> float:
    """The largest difference over the largest magnitude of the reference's block (see TOL)."""
    return ((got - want).abs().max() / want.abs().max()).item()


def _errors(
    reference: nn.Module, twin: nn.Module, share: _Share, run: Any, x: Tensor, g: Tensor
) -> dict[str, float]:
    """Largest differences of this rank's blocks: output, input gradient, each weight gradient."""
    leaf = x.clone().requires_grad_(True)
    out = run(reference, leaf)
    out.backward(g)
    mine = share.activation(leaf.detach()).clone().requires_grad_(True)
    got = run(twin, mine)
    got.backward(share.activation(g))
    errors = {
        "output": _relative_error(got, share.activation(out.detach())),
        "input grad": _relative_error(mine.grad, share.activation(leaf.grad)),
    }
    full = dict(reference.named_parameters())
    for name, p in twin.named_parameters():
        errors[name] = _relative_error(p.grad, share.parameter(name, full[name].grad))
    names = {name for name, _ in twin.named_parameters()}
    vectors = share.hosts_vectors
    expected = set(full) if vectors else {n for n, p in full.items() if p.dim() == 2}
    assert names == expected, (vectors, sorted(names ^ expected))
    return errors


def _nonzero_vectors(module: nn.Module) -> None:
    """Biases and norm weights away from their 0 / 1 init, so their gradients are tested."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))


def _linear_case(grid: Grid2D) -> dict[str, float]:
    config = _config()
    torch.manual_seed(0)
    reference = nn.Linear(HIDDEN, FFN)
    twin = Linear2D(HIDDEN, FFN, config=config, init_method=config.init_method, grid=grid)
    share = _grid_share(grid, (0, 1))  # [tokens, h]
    _load_blocks(twin, reference, share)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(SEQ * BATCH, HIDDEN, generator=gen)
    g = torch.randn(SEQ * BATCH, FFN, generator=gen)

    def run(module: nn.Module, inp: Tensor) -> Tensor:
        out = module(inp)
        return out[0] if isinstance(out, tuple) else out

    return _errors(reference, twin, share, run, x, g)


def _layer(spec: ModuleSpec, config: TransformerConfig, tp: dist.ProcessGroup) -> nn.Module:
    """A ``TransformerLayer`` of ``spec`` with ``tp`` its TP group."""
    pg_collection = ProcessGroupCollection(tp=tp, cp=None, pp=None)
    return build_module(spec, config=config, layer_number=1, pg_collection=pg_collection)


def _reference_and_twin(
    config: TransformerConfig, twin_spec: Callable[[], ModuleSpec], tp: dist.ProcessGroup
) -> tuple[nn.Module, nn.Module]:
    """megatron-core's local GPT layer on one rank, its vectors made nonzero, and its twin."""
    one_rank = parallel_state.get_tensor_model_parallel_group()
    reference = _layer(get_gpt_layer_local_spec(), config, one_rank)
    _nonzero_vectors(reference)
    with pytest.warns(UserWarning, match="experimental"):
        spec = twin_spec()
    return reference, _layer(spec, config, tp)


def _layer_case(grid: Grid2D, part: str) -> dict[str, float]:
    """megatron-core's ``TransformerLayer`` (``part="layer"``) or its MLP (``"mlp"``)."""
    config = _config()
    torch.manual_seed(0)
    reference, twin = _reference_and_twin(config, lambda: get_2d_layer_spec(grid), grid.row_group)
    if part == "mlp":
        reference, twin = reference.mlp, twin.mlp
    share = _grid_share(grid, (1, 2))  # [s, b, h]: b and h
    _load_blocks(twin, reference, share)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=gen)
    g = torch.randn(SEQ, BATCH, HIDDEN, generator=gen)
    mask = causal_mask(SEQ)

    def run(module: nn.Module, inp: Tensor) -> Tensor:
        if part == "mlp":  # megatron-core's MLP returns (output, bias): the sum the layer adds
            out, bias = module(inp)
            return out + bias
        return module(inp, attention_mask=mask)[0]

    return _errors(reference, twin, share, run, x, g)


def _footprint_1d(shape: LayerShape, mask: Tensor) -> dict[str, dict[str, int]]:
    """What each rank holds of megatron-core's layer on 1 rank and under 1D TP over all ranks,
    measured and by formula."""
    world = dist.get_world_size()
    groups = {
        "1 rank": parallel_state.get_tensor_model_parallel_group(),
        f"1D TP{world}": dist.group.WORLD,
    }
    held = {}
    for mode, tp_group in groups.items():
        layer = _layer(get_gpt_layer_local_spec(), _config(), tp_group)
        tp = tp_group.size()
        held[mode] = {
            **asdict(held_bytes(layer, torch.randn(SEQ, BATCH, HIDDEN), mask)),
            "formula parameters": parameter_bytes_1d(shape, tp),
            "formula activations": activation_bytes_1d(shape, tp),
        }
    return held


def _footprint_case(mesh: Grid2D | Cube3D) -> dict[str, dict[str, int]]:
    """What each rank holds under 1 rank, 1D TP over all ranks and 2D or 3D on ``mesh``."""
    shape = LayerShape(seq=SEQ, batch=BATCH, hidden=HIDDEN, heads=HEADS, ffn=FFN)
    mask = causal_mask(SEQ)
    held = _footprint_1d(shape, mask)
    with pytest.warns(UserWarning, match="experimental"):
        if isinstance(mesh, Grid2D):
            spec, tp, mode = get_2d_layer_spec(mesh), mesh.row_group, f"2D {mesh.q}x{mesh.q}"
            x = torch.randn(SEQ, BATCH // mesh.q, HIDDEN // mesh.q)
            params = parameter_bytes_2d(shape, mesh.q, mesh.row)
            activations = activation_bytes_2d(shape, mesh.q, mesh.row)
        else:
            spec, tp, mode = get_3d_layer_spec(mesh), mesh.y_group, f"3D {mesh.p}x{mesh.p}x{mesh.p}"
            x = torch.randn(SEQ, BATCH // mesh.p**2, HIDDEN // mesh.p)
            params = parameter_bytes_3d(shape, mesh.p, mesh.j == mesh.l)
            activations = activation_bytes_3d(shape, mesh.p)
    layer = _layer(spec, _config(), tp)
    held[mode] = {
        **asdict(held_bytes(layer, x, mask)),
        "formula parameters": params,
        "formula activations": activations,
    }
    return held


def _check_footprint(rank: int, footprint: dict[str, dict[str, int]], mode: str) -> None:
    for name, held in footprint.items():
        assert held["parameters"] == held["formula parameters"], (rank, name, held)
        assert held["activations"] == held["formula activations"], (rank, name, held)
    # the papers' point: activations are split too, so fewer bytes than 1D at the same degree
    one_d = next(name for name in footprint if name.startswith("1D"))
    assert footprint[mode]["activations"] < footprint[one_d]["activations"], (rank, footprint)


def _check_memory_model(
    footprints: list[dict[str, dict[str, int]]], name: str, mode: TPMode
) -> None:
    """The memory model's figure (the fullest rank's) is the most any rank holds, for 1D at the
    same degree and for ``mode`` (the footprint's ``name``)."""
    spec = TransformerSpec(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        ffn_hidden_size=FFN,
        seq_length=SEQ,
    )
    world = len(footprints)
    for held_name, held_mode in ((f"1D TP{world}", "1d"), (name, mode)):
        held = [f[held_name] for f in footprints]
        fullest = LayerBytes(
            max(h["parameters"] for h in held), max(h["activations"] for h in held)
        )
        assert layer_bytes(spec, held_mode, world, BATCH, 4) == fullest, (held_name, fullest)


def _check_ranks(results: list[dict[str, Any]], name: str, mode: TPMode) -> None:
    """Every rank's cases within ``TOL`` and its footprint (``name``) as the formulas and the
    memory model say."""
    footprints = []
    for rank, cases in enumerate(results):
        footprints.append(cases.pop("footprint"))
        _check_footprint(rank, footprints[-1], name)
        for case, errors in cases.items():
            assert max(errors.values()) <= TOL, (rank, case, errors)
    _check_memory_model(footprints, name, mode)


def _grid_rank() -> dict[str, dict[str, Any]]:
    with megatron_state():
        grid = build_grid_groups(tuple(range(dist.get_world_size())))
        assert grid is not None
        return {
            "linear": _linear_case(grid),
            "mlp": _layer_case(grid, "mlp"),
            "attention + mlp layer": _layer_case(grid, "layer"),
            "footprint": _footprint_case(grid),
        }


@pytest.mark.distributed
def test_2d_on_a_2x2_grid_equals_one_rank() -> None:
    _check_ranks(run_distributed(_grid_rank, 4, timeout=120.0), "2D 2x2", "2d")


# 3D on a 2 x 2 x 2 cube: megatron-core's MLP without biases, and its attention + MLP layer


DIRECTIONS = {"linear_qkv": "y", "linear_proj": "z", "linear_fc1": "y", "linear_fc2": "z"}


def _cube_block(full: Tensor, cube: Cube3D, direction: str) -> Tensor:
    """This rank's block of a ``[s, b, h]`` activation in ``direction``: sequences block
    i*p + a (of p^2), hidden block b (of p), a and b the coordinates along the direction and
    the other one."""
    a, b = (cube.j, cube.l) if direction == "y" else (cube.l, cube.j)
    rows = full.tensor_split(cube.p**2, dim=1)[cube.i * cube.p + a]
    return rows.tensor_split(cube.p, dim=2)[b]


def _cube_param_block(name: str, full: Tensor, cube: Cube3D) -> Tensor:
    """A ``[out, in]`` weight of a layer taking direction d: out block a*p + i (of p^2), in
    block b (of p). A vector, on the j = l diagonal: sub-block i of block j."""
    if full.dim() == 1:
        return full.tensor_split(cube.p)[cube.j].tensor_split(cube.p)[cube.i]
    direction = DIRECTIONS[name.split(".")[-2]]
    a, b = (cube.j, cube.l) if direction == "y" else (cube.l, cube.j)
    out = full.tensor_split(cube.p**2, dim=0)[a * cube.p + cube.i]
    return out.tensor_split(cube.p, dim=1)[b]


def _cube_case(cube: Cube3D, part: str) -> dict[str, float]:
    config = _config()
    torch.manual_seed(0)
    if part == "mlp":
        config.add_bias_linear = False  # megatron-core's MLP alone, as first built

        def mlp(fc1: Any, fc2: Any, tp_group: dist.ProcessGroup) -> nn.Module:
            spec = ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=fc1, linear_fc2=fc2))
            return build_module(spec, config=config, tp_group=tp_group)

        reference = mlp(
            ColumnParallelLinear,
            RowParallelLinear,
            parallel_state.get_tensor_model_parallel_group(),
        )
        twin = mlp(
            *(
                ModuleSpec(module=Linear3D, params={"cube": cube, "input_direction": d})
                for d in ("y", "z")
            ),
            cube.y_group,
        )
    else:
        reference, twin = _reference_and_twin(config, lambda: get_3d_layer_spec(cube), cube.y_group)
    share = _Share(
        lambda full: _cube_block(full, cube, "y"),
        lambda name, full: _cube_param_block(name, full, cube),
        cube.j == cube.l,
    )
    _load_blocks(twin, reference, share)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=gen)
    g = torch.randn(SEQ, BATCH, HIDDEN, generator=gen)
    mask = causal_mask(SEQ)

    def run(module: nn.Module, inp: Tensor) -> Tensor:
        if part == "mlp":
            return module(inp)[0]
        return module(inp, attention_mask=mask)[0]

    return _errors(reference, twin, share, run, x, g)


def _cube_rank() -> dict[str, dict[str, Any]]:
    with megatron_state():
        cube = build_cube_groups(tuple(range(dist.get_world_size())))
        assert cube is not None
        return {
            "mlp": _cube_case(cube, "mlp"),
            "attention + mlp layer": _cube_case(cube, "layer"),
            "footprint": _footprint_case(cube),
        }


@pytest.mark.distributed
def test_3d_on_a_2x2x2_cube_equals_one_rank() -> None:
    _check_ranks(run_distributed(_cube_rank, 8, timeout=120.0), "3D 2x2x2", "3d")
