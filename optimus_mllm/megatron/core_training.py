"""What a Megatron-LM pretrain script imports from ``megatron.training``, which the megatron-core
wheel does not ship: its flags (``parse_args`` with an ``extra_args_provider``, ``get_args``, from
``optimus_mllm.megatron.arguments``), the language model's ``TransformerConfig`` from them
(``core_transformer_config_from_args``), and ``pretrain()``, which trains Megatron-style
(``optimus_mllm.megatron.pretrain`` is the same loop with ``--optimus-schedule``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from optimus_mllm.cli.common import quiet_library_warnings

# as megatron.training's import sets a job up: first of all, before megatron-core's imports print
# what the CPU-only optional packages' absence makes them print, so that an error stays one line
quiet_library_warnings(torch.cuda.is_available())

# after the warnings
from megatron.core.transformer import TransformerConfig  # noqa: E402

from optimus_mllm.megatron.arguments import (  # noqa: E402
    ExtraArgsProvider,
    build_parser,
    get_args,
    parse_args,
)
from optimus_mllm.megatron.entry import train_vlm  # noqa: E402
from optimus_mllm.megatron.flags import config_from_megatron_args  # noqa: E402
from optimus_mllm.runtime.llm import transformer_config  # noqa: E402

__all__ = [
    "build_parser",
    "core_transformer_config_from_args",
    "get_args",
    "parse_args",
    "pretrain",
]


def core_transformer_config_from_args(args: argparse.Namespace) -> TransformerConfig:
    """The language model's megatron-core config from the flags, as ``optimus_mllm.megatron`` reads
    them (on the CPU with megatron-core's CUDA-only fusions off)."""
    config = config_from_megatron_args(args, dist.get_world_size())
    return transformer_config(config, config.parallel.llm)


def pretrain(
    train_valid_test_datasets_provider: Callable[[list[int]], tuple[Any, Any, Any]],
    model_provider: Callable[..., Any],
    model_type: Any,
    forward_step_func: Callable[..., Any],
    extra_args_provider: ExtraArgsProvider | None = None,
    argv: list[str] | None = None,
) -> int:
    """``megatron.training.pretrain`` for a ViT + GPT job: the vision model in the first stage, as
    built."""
    return train_vlm(
        train_valid_test_datasets_provider,
        model_provider,
        model_type,
        forward_step_func,
        extra_args_provider,
        argv,
        optimus_flag=False,
    )
