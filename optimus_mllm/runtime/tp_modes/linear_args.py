"""megatron-core's linear constructor keywords, as the 2D and 3D linears take them: all of them,
so that they plug into megatron-core's specs (its ``MLP`` and attention pass them to any linear),
refusing in one line those that ask for a layout they do not build.
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
    """``megatron_args`` as ``LinearArgs`` (an unknown keyword is a ``TypeError``), refusing in one
    line those ``layer`` (a class name) does not build in ``mode`` (``"2D"`` or ``"3D"``)."""
    args = LinearArgs(**megatron_args)
    if args.gather_output or not args.input_is_parallel or args.stride != 1 or args.is_expert:
        raise ValueError(
            f"{layer}: gather_output, unpartitioned input, stride > 1 and experts are not built"
            f" in {mode} tensor parallelism"
        )
    return args
