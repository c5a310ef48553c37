"""The 3D paper's load-balanced linear layer on a p x p x p cube (Bian et al., §3.1.1-3.1.2,
Algorithms 1-2), as a megatron-core linear module.

Partition. A ``[M, N]`` activation "in direction y" is held by processor (i, j, l) as row block
i*p + j (of p^2) and column block l (of p); "in direction z" swaps the roles of j and l. A layer
whose input is in one direction returns its output in the other (§3.1.1), so megatron-core's MLP
and attention, two linears each, end where they began: the first linear of a block takes
direction y, the second direction z.

With ``a`` this rank's coordinate along the input's direction and ``b`` along the other, the
weight block is W[in block b of p, out block a*p + i of p^2] (megatron-core's ``[out, in]``
weight, transposed). Forward: all-gather the input along the input's direction (rows block i),
all-gather the weight along x (out block a), multiply, reduce-scatter along the other direction
(rows block i*p + b, column block a). Backward: all-gather the output gradient along the other
direction; the input gradient is reduce-scattered along the input's direction and the weight
gradient along x, each the transpose of a forward step.

Vectors (biases, norm weights and biases; §3.1.3, Fig. 5, Algorithms 7-8). A tensor in
direction d needs the vector's block b (its hidden block). Processor (i, j, l) with j = l hosts
sub-block i of block j; forward, the holder (i, b, b) broadcasts along d and the block is
all-gathered along x; backward, the gradient is reduce-scattered along x and reduced to the
holder.

Layer norm: the statistics are all-reduced along the other direction (the hidden dimension's).
Blocks are marked and initialised as in 2D (``params``).
``get_3d_layer_spec`` plugs these into megatron-core's ``TransformerLayer`` as ``layers_2d``
does for a grid, the cube's y group being the attention's TP group (the QKV output's column block
j is heads block j).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor, nn

from optimus_mllm.runtime.layer_ops import all_gather, reduce_scatter
from optimus_mllm.runtime.tp_modes.groups import Cube3D
from optimus_mllm.runtime.tp_modes.linear_args import linear_args
from optimus_mllm.runtime.tp_modes.params import init_block, mark_held_once
from optimus_mllm.runtime.tp_modes.summa import RowStatsNorm

DIRECTIONS = ("y", "z")
OTHER = {"y": "z", "z": "y"}


def _groups(cube: Cube3D, direction: str) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(the direction's group, the other one's)."""
    return (cube.y_group, cube.z_group) if direction == "y" else (cube.z_group, cube.y_group)


def _hidden_block(cube: Cube3D, direction: str) -> int:
    """b: which hidden block (of p) a rank holds of a tensor in ``direction``."""
    return cube.l if direction == "y" else cube.j


def _holds_vectors(cube: Cube3D) -> bool:
    return cube.j == cube.l


class FromDiagonal(torch.autograd.Function):
    """Block b of a vector hosted on the cube's j = l diagonal, for a tensor in ``direction``
    (Algorithms 7-8): broadcast along the direction from (i, b, b), all-gather along x."""

    @staticmethod
    def forward(ctx: Any, local: Tensor, cube: Cube3D, direction: str) -> Tensor:
        b = _hidden_block(cube, direction)
        holder = cube.layout.rank(cube.i, b, b)
        along, _ = _groups(cube, direction)
        block = local.detach().clone() if dist.get_rank() == holder else torch.empty_like(local)
        dist.broadcast(block, src=holder, group=along)
        ctx.cube, ctx.holder, ctx.along = cube, holder, along
        return all_gather(block, cube.x_group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None]:
        part = reduce_scatter(grad.contiguous(), ctx.cube.x_group)
        dist.reduce(part, dst=ctx.holder, group=ctx.along)
        return (part if dist.get_rank() == ctx.holder else None), None, None


def _diagonal_parameter(
    size: int, fill: float, cube: Cube3D, dtype: torch.dtype
) -> nn.Parameter | None:
    """Sub-block i of a vector's block j (size / p^2 elements) on (i, j, j); None elsewhere."""
    if size % cube.p**2:
        raise ValueError(f"3D tensor parallelism: vector size {size} must divide by p^2")
    if not _holds_vectors(cube):
        return None
    return mark_held_once(nn.Parameter(torch.full((size // cube.p**2,), fill, dtype=dtype)))


def _from_diagonal(
    vector: nn.Parameter | None, size: int, cube: Cube3D, direction: str, dtype: torch.dtype
) -> Tensor:
    # ranks off the diagonal pass a placeholder asking for a gradient, so their backward runs
    local = (
        vector
        if vector is not None
        else torch.empty(size // cube.p**2, dtype=dtype, requires_grad=True)
    )
    return FromDiagonal.apply(local, cube, direction)


class CubeLinear(torch.autograd.Function):
    """Y = X W on the cube (Algorithms 1 and 2), input in ``direction``, output in the other."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, cube: Cube3D, direction: str) -> Tensor:
        gather, scatter = _groups(cube, direction)
        x_rows = all_gather(x, gather)  # [M/p, in/p]
        w_out = all_gather(weight, cube.x_group)  # [out/p, in/p]
        ctx.save_for_backward(x_rows, w_out)
        ctx.cube, ctx.direction = cube, direction
        return reduce_scatter(x_rows @ w_out.t(), scatter)

    @staticmethod
    def backward(ctx: Any, grad_y: Tensor) -> tuple[Tensor, Tensor, None, None]:
        x_rows, w_out = ctx.saved_tensors
        gather, scatter = _groups(ctx.cube, ctx.direction)
        grad_rows = all_gather(grad_y.contiguous(), scatter)  # [M/p, out/p]
        grad_x = reduce_scatter(grad_rows @ w_out, gather)
        grad_w = reduce_scatter(grad_rows.t() @ x_rows, ctx.cube.x_group)
        return grad_x, grad_w, None, None


class Linear3D(nn.Module):
    """A linear layer on a p x p x p cube, taking megatron-core's linear keywords (``linear_args``);
    ``input_direction`` is ``"y"`` for the first linear of a block, ``"z"`` for the second."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: TransformerConfig,
        init_method: Callable[[Tensor], None],
        cube: Cube3D,
        input_direction: str,
        **megatron_args: Any,
    ) -> None:
        super().__init__()
        args = linear_args("Linear3D", "3D", megatron_args)
        if input_direction not in DIRECTIONS:
            raise ValueError(f"Linear3D: input_direction must be one of {DIRECTIONS}")
        p = cube.p
        if output_size % p**2 or input_size % p:
            raise ValueError(
                f"3D tensor parallelism: output size {output_size} must divide by p^2={p**2}"
                f" and input size {input_size} by p={p}"
            )
        self.cube, self.input_direction = cube, input_direction
        self.skip_bias_add = args.skip_bias_add
        self.weight = mark_held_once(
            nn.Parameter(
                torch.empty(output_size // p**2, input_size // p, dtype=config.params_dtype)
            )
        )
        # out block a*p + i (of p^2), in block b (of p) of megatron-core's [out, in] weight
        a, b = (cube.j, cube.l) if input_direction == "y" else (cube.l, cube.j)
        blocks = ((p**2, a * p + cube.i), (p, b))
        init_block(self.weight, (output_size, input_size), blocks, config, init_method)
        self.output_size, self.has_bias = output_size, args.bias
        self.bias = (
            _diagonal_parameter(output_size, 0.0, cube, config.params_dtype) if args.bias else None
        )

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
        tokens = x.reshape(-1, x.shape[-1])
        out = CubeLinear.apply(tokens, self.weight, self.cube, self.input_direction)
        out = out.view(*x.shape[:-1], -1)
        if not self.has_bias:
            return out, None
        direction = OTHER[self.input_direction]  # the output's
        bias = _from_diagonal(self.bias, self.output_size, self.cube, direction, out.dtype)
        return (out, bias) if self.skip_bias_add else (out + bias, None)


class LayerNorm3D(nn.Module):
    """Layer norm of a tensor in direction y (a block's input and output) on a cube."""

    def __init__(
        self, config: TransformerConfig, hidden_size: int, cube: Cube3D, eps: float = 1e-5
    ) -> None:
        super().__init__()
        if config.normalization != "LayerNorm":
            raise ValueError(
                f"3D tensor parallelism: normalization {config.normalization!r} is not built,"
                " only LayerNorm"
            )
        self.hidden_size, self.eps, self.cube = hidden_size, eps, cube
        self.weight = _diagonal_parameter(hidden_size, 1.0, cube, config.params_dtype)
        self.bias = _diagonal_parameter(hidden_size, 0.0, cube, config.params_dtype)

    def forward(self, x: Tensor) -> Tensor:
        _, hidden_group = _groups(self.cube, "y")
        x_hat = RowStatsNorm.apply(x, self.hidden_size, self.eps, hidden_group)
        weight = _from_diagonal(self.weight, self.hidden_size, self.cube, "y", x.dtype)
        bias = _from_diagonal(self.bias, self.hidden_size, self.cube, "y", x.dtype)
        return x_hat * weight + bias


def get_3d_layer_spec(cube: Cube3D) -> ModuleSpec:
    """megatron-core's local GPT ``TransformerLayer`` spec with its linears and norms on ``cube``.

    Build it with ``pg_collection.tp`` set to ``cube.y_group``; feed it ``[s, b/p^2, h/p]`` in
    direction y (sequences block i*p + j, hidden block l).
    """
    warnings.warn("3D tensor parallelism is experimental", stacklevel=2)
    spec = get_gpt_layer_local_spec()

    def linear(direction: str) -> ModuleSpec:
        return ModuleSpec(module=Linear3D, params={"cube": cube, "input_direction": direction})

    norm = ModuleSpec(module=LayerNorm3D, params={"cube": cube})
    layer, attention, mlp = spec.submodules, spec.submodules.self_attention, spec.submodules.mlp
    return replace(
        spec,
        submodules=replace(
            layer,
            input_layernorm=norm,
            self_attention=replace(
                attention,
                submodules=replace(
                    attention.submodules,
                    # called directly, not through build_module: a callable, not a spec
                    linear_qkv=partial(Linear3D, cube=cube, input_direction="y"),
                    linear_proj=linear("z"),
                ),
            ),
            pre_mlp_layernorm=norm,
            mlp=replace(
                mlp,
                submodules=replace(mlp.submodules, linear_fc1=linear("y"), linear_fc2=linear("z")),
            ),
        ),
    )
