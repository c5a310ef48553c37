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

Not built yet: biases (the paper stores them on the cube's diagonal, Fig. 5), the layer norm,
the attention and whole-layer spec.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor, nn

from optimus_mllm.runtime.layer_ops import all_gather, reduce_scatter
from optimus_mllm.runtime.tp_modes.groups import Cube3D

DIRECTIONS = ("y", "z")


def _groups(cube: Cube3D, direction: str) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(the input direction's group, the other one's)."""
    return (cube.y_group, cube.z_group) if direction == "y" else (cube.z_group, cube.y_group)


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
    """A linear layer on a p x p x p cube, with megatron-core's linear constructor arguments;
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
        bias: bool = True,
        skip_bias_add: bool = False,
        gather_output: bool = False,
        input_is_parallel: bool = True,
        stride: int = 1,
        is_expert: bool = False,
        tp_comm_buffer_name: str | None = None,  # megatron-core's; no buffers here
        tp_group: object = None,  # megatron-core's 1D group; the cube replaces it
    ) -> None:
        super().__init__()
        if bias or gather_output or not input_is_parallel or stride != 1 or is_expert:
            raise ValueError(
                "Linear3D: biases, gather_output, unpartitioned input, stride > 1 and experts"
                " are not built in 3D tensor parallelism"
            )
        if input_direction not in DIRECTIONS:
            raise ValueError(f"Linear3D: input_direction must be one of {DIRECTIONS}")
        p = cube.p
        if output_size % p**2 or input_size % p:
            raise ValueError(
                f"3D tensor parallelism: output size {output_size} must divide by p^2={p**2}"
                f" and input size {input_size} by p={p}"
            )
        self.cube, self.input_direction = cube, input_direction
        self.skip_bias_add = skip_bias_add
        self.weight = nn.Parameter(
            torch.empty(output_size // p**2, input_size // p, dtype=config.params_dtype)
        )
        if config.perform_initialization:
            with torch.no_grad():
                init_method(self.weight)  # i.i.d. elements: drawing the block draws its share

    def forward(self, x: Tensor) -> tuple[Tensor, None]:
        tokens = x.reshape(-1, x.shape[-1])
        out = CubeLinear.apply(tokens, self.weight, self.cube, self.input_direction)
        return out.view(*x.shape[:-1], -1), None
