"""This rank's blocks of the 2D and 3D layers' parameters: how a weight block is initialised and how
every block is marked for megatron-core's optimizer.

Initialisation. With ``config.use_cpu_initialization`` megatron-core draws a 1D-parallel weight
whole and keeps its partition (``_initialize_affine_weight_cpu``), so a model seeded alike starts
from the same weights at any TP size. ``init_block`` does the same for a block cut in both
dimensions: a 2D or 3D model seeded like its 1D twin starts from the 1D twin's weights. Without it
the block alone is drawn (i.i.d. elements: drawing the block draws its share).

Marking. megatron-core's gradient norm counts a parameter on every rank when it is marked
``tensor_model_parallel`` and on TP rank 0 only otherwise
(``param_is_not_tensor_parallel_duplicate``).
Every block here is held by one rank of the mode's group (a weight block, or a vector block on its
row-0 or diagonal host), so ``mark_held_once`` marks it; it sets no ``partition_dim``, since
megatron-core's 1D layout cannot describe a block cut in two dimensions.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor, nn


def mark_held_once(param: nn.Parameter) -> nn.Parameter:
    """Mark ``param`` as this rank's alone, so that megatron-core's gradient norm counts it here."""
    param.tensor_model_parallel = True
    return param


def init_block(
    weight: nn.Parameter,
    whole: tuple[int, int],
    block: tuple[tuple[int, int], tuple[int, int]],
    config: TransformerConfig,
    init_method: Callable[[Tensor], None],
) -> None:
    """Initialise ``weight``, one block of a ``whole`` ``[out, in]`` weight.

    Args:
        weight: this rank's block, ``[out / parts, in / parts]``.
        whole: the whole weight's ``(out, in)``.
        block: ``((parts, index), (parts, index))``: which block of the rows and of the columns.
        config: megatron-core's; ``perform_initialization`` and ``use_cpu_initialization`` apply.
        init_method: megatron-core's init method for this weight.
    """
    if not config.perform_initialization:
        return
    with torch.no_grad():
        if not config.use_cpu_initialization:
            init_method(weight)
            return
        full = torch.empty(*whole, dtype=torch.float)  # as megatron-core draws its master weight
        init_method(full)
        (row_parts, row), (column_parts, column) = block
        full = full.chunk(row_parts, dim=0)[row].chunk(column_parts, dim=1)[column]
        weight.copy_(full)
