"""megatron-core's linear constructor keywords, as the 2D and 3D linears take them.

megatron-core's ``MLP`` and attention build every linear of a spec with the keywords of its
``ColumnParallelLinear`` / ``RowParallelLinear`` (``build_module`` in ``mlp.py``, a direct call
for ``linear_qkv`` in ``attention.py``). ``Linear2D`` and ``Linear3D`` accept them all, so that
they plug into megatron-core's specs, read the bias ones, and refuse in one line those asking for
a layout they do not build: a gathered output, an unpartitioned input, a strided weight, an expert.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LinearArgs:
    """The keywords megatron-core passes to a linear, with its defaults."""

    bias: bool = True
    skip_bias_add: bool = False
    gather_output: bool = False
    input_is_parallel: bool = True
    stride: int = 1
    is_expert: bool = False
    tp_comm_buffer_name: str | None = None  # megatron-core's; no buffers here
    tp_group: object = None  # megatron-core's 1D group; the grid or the cube replaces it


def linear_args(layer: str, mode: str, megatron_args: dict[str, Any]) -> LinearArgs:
    """``megatron_args`` read as ``LinearArgs``, refusing what ``layer`` does not build.

    Args:
        layer: the linear's class name, for the message.
        mode: ``"2D"`` or ``"3D"``, for the message.
        megatron_args: the keywords megatron-core passed (an unknown one is a ``TypeError``).

    Returns:
        The keywords, every one of them built.
    """
    args = LinearArgs(**megatron_args)
    if args.gather_output or not args.input_is_parallel or args.stride != 1 or args.is_expert:
        raise ValueError(
            f"{layer}: gather_output, unpartitioned input, stride > 1 and experts are not built"
            f" in {mode} tensor parallelism"
        )
    return args
