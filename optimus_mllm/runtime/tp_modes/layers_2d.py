"""megatron-core layer modules for 2D (SUMMA) tensor parallelism (Xu et al., §3.2), and the
``TransformerLayer`` spec built from them.

Partition. The hidden states ``[s, b, h]`` are split in batch and hidden: rank (i, j) of the grid
holds ``[s, b/q, h/q]`` (sequences block i, hidden block j; the paper's choice of b and h, so
attention needs no communication). Read as a ``[s*b/q, h/q]`` matrix this is block (i, j) of the
``[s*b, h]`` activation matrix, so every linear layer is one SUMMA product.

Plugging into megatron-core. ``TransformerLayer``, ``SelfAttention``, ``DotProductAttention``,
``MLP`` and the bias-dropout-add run unchanged with the grid's *row* group as their TP group:
each rank then computes n/q heads (``SelfAttention`` divides heads by the TP size) of its b/q
sequences, and column block j of megatron-core's fused QKV output is exactly heads block j, as
in 1D TP. The linear layers and norms are replaced:

- ``Linear2D``: weight block (j, i) of megatron-core's ``[out, in]`` weight, i.e. block (i, j) of
  W = weight^T; forward and backward by ``summa.SummaLinear``. The bias is hosted on row 0 and
  broadcast down the column (``summa.FromRowZero``).
- ``LayerNorm2D``: statistics all-reduced along the row (``summa.RowStatsNorm``), weight and bias
  hosted on row 0.

megatron-core builds ``linear_fc1``, ``linear_fc2``, ``linear_proj`` and the norms with
``build_module`` (a ``ModuleSpec`` carries the grid in its params) but calls
``submodules.linear_qkv(...)`` directly (``attention.py``), so the QKV entry is a
``functools.partial`` binding the grid.

Vector parameters (biases, norm weights) are hosted on row 0 and exist only there: the other
rows hold None under the same name and receive the column's block when it is used. Every block
(weight or vector) is marked as held by its rank alone and a weight block is initialised as its
share of the whole weight (``params``), so megatron-core's optimizer and a 1D twin agree.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor, nn

from optimus_mllm.runtime.tp_modes.groups import Grid2D
from optimus_mllm.runtime.tp_modes.linear_args import linear_args
from optimus_mllm.runtime.tp_modes.params import init_block, mark_held_once
from optimus_mllm.runtime.tp_modes.summa import FromRowZero, RowStatsNorm, SummaLinear


def _block(size: int, grid: Grid2D, what: str) -> int:
    if size % grid.q:
        raise ValueError(f"2D tensor parallelism: {what} {size} is not divisible by q={grid.q}")
    return size // grid.q


def _row_zero_parameter(
    block: int, fill: float, grid: Grid2D, dtype: torch.dtype
) -> nn.Parameter | None:
    """Block j of a vector parameter: a Parameter on rank (0, j), None on the other rows."""
    if grid.row != 0:
        return None
    return mark_held_once(nn.Parameter(torch.full((block,), fill, dtype=dtype)))


def _from_row_zero(vector: Tensor | None, block: int, grid: Grid2D, dtype: torch.dtype) -> Tensor:
    """Column j's block of a row-0 hosted vector, on every rank of the column."""
    # the other rows pass what the broadcast writes into; it asks for a gradient so that their
    # backward runs too and joins the reduce to row 0
    local = vector if vector is not None else torch.empty(block, dtype=dtype, requires_grad=True)
    return FromRowZero.apply(local, grid)


class Linear2D(nn.Module):
    """A linear layer on a q x q grid, taking megatron-core's linear keywords (``linear_args``).

    Input ``[..., in/q]`` holding this rank's block of tokens; output ``[..., out/q]``; returns
    ``(output, bias)`` as megatron-core's linears do (``bias`` is this column's block when
    ``skip_bias_add``, else None and the bias is already added).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: TransformerConfig,
        init_method: Callable[[Tensor], None],
        grid: Grid2D,
        **megatron_args: Any,
    ) -> None:
        super().__init__()
        args = linear_args("Linear2D", "2D", megatron_args)
        self.grid = grid
        self.skip_bias_add = args.skip_bias_add
        rows = _block(output_size, grid, "output size")
        columns = _block(input_size, grid, "input size")
        self.weight = mark_held_once(
            nn.Parameter(torch.empty(rows, columns, dtype=config.params_dtype))
        )
        # block (j, i) of megatron-core's [out, in] weight
        blocks = ((grid.q, grid.column), (grid.q, grid.row))
        init_block(self.weight, (output_size, input_size), blocks, config, init_method)
        # which block of which whole weight: what runtime.weights draws plan-independently
        self.weight.block_of = ((output_size, input_size), blocks)
        self.has_bias = args.bias
        self.bias = _row_zero_parameter(rows, 0.0, grid, config.params_dtype) if args.bias else None

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
        tokens = x.reshape(-1, x.shape[-1])
        out = SummaLinear.apply(tokens, self.weight, self.grid).view(*x.shape[:-1], -1)
        if not self.has_bias:
            return out, None
        bias = _from_row_zero(self.bias, out.shape[-1], self.grid, out.dtype)
        return (out, bias) if self.skip_bias_add else (out + bias, None)


class LayerNorm2D(nn.Module):
    """Layer norm over a hidden dimension split along the grid's rows (the paper's §3.2.2)."""

    def __init__(
        self, config: TransformerConfig, hidden_size: int, grid: Grid2D, eps: float = 1e-5
    ) -> None:
        super().__init__()
        if config.normalization != "LayerNorm":
            raise ValueError(
                f"2D tensor parallelism: normalization {config.normalization!r} is"
                " not built, only LayerNorm"
            )
        block = _block(hidden_size, grid, "hidden size")
        self.hidden_size, self.eps, self.grid = hidden_size, eps, grid
        self.block = block
        self.weight = _row_zero_parameter(block, 1.0, grid, config.params_dtype)
        self.bias = _row_zero_parameter(block, 0.0, grid, config.params_dtype)

    def forward(self, x: Tensor) -> Tensor:
        x_hat = RowStatsNorm.apply(x, self.hidden_size, self.eps, self.grid.row_group)
        weight = _from_row_zero(self.weight, self.block, self.grid, x.dtype)
        bias = _from_row_zero(self.bias, self.block, self.grid, x.dtype)
        return x_hat * weight + bias


def get_2d_layer_spec(grid: Grid2D, attn_mask_type: AttnMaskType | None = None) -> ModuleSpec:
    """megatron-core's local GPT ``TransformerLayer`` spec with its linears and norms on ``grid``;
    ``attn_mask_type`` in place of its causal mask (``no_mask``: a ViT's).

    Build it with ``pg_collection.tp`` set to ``grid.row_group``; feed it ``[s, b/q, h/q]``.
    """
    warnings.warn("2D tensor parallelism is experimental", stacklevel=2)
    spec = get_gpt_layer_local_spec()
    if attn_mask_type is not None:
        attention = spec.submodules.self_attention
        attention = replace(
            attention, params={**attention.params, "attn_mask_type": attn_mask_type}
        )
        spec = replace(spec, submodules=replace(spec.submodules, self_attention=attention))
    on_grid = {"grid": grid}
    linear = ModuleSpec(module=Linear2D, params=on_grid)
    norm = ModuleSpec(module=LayerNorm2D, params=on_grid)
    layer = spec.submodules
    attention = layer.self_attention
    mlp = layer.mlp
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
                    linear_qkv=partial(Linear2D, grid=grid),
                    linear_proj=linear,
                ),
            ),
            pre_mlp_layernorm=norm,
            mlp=replace(
                mlp, submodules=replace(mlp.submodules, linear_fc1=linear, linear_fc2=linear)
            ),
        ),
    )
