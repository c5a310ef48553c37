"""``Tensor.type`` and ``Tensor.cuda`` answered for CPU tensors inside a few megatron-core calls
(test and CI emulation only).

megatron-core's optimizers sort parameters into fp32 and 16-bit groups by ``tensor.type()`` strings
(``"torch.cuda.FloatTensor"``) and gradient clipping asserts them; LanguageModule's tied-embedding
setup and CLIPViTModel's constructor move tensors with ``.cuda()``; the loss scaler's
``load_state_dict`` moves its scale with ``.cuda()``. The first two are patched on ``torch.Tensor``
itself, so each patch wraps one megatron call and installs them only for its duration (for every
thread of the process: the emulation runs one training thread per rank). The scaler's load is
replaced by one that keeps the scale on the CPU.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from megatron_patches.lookup import Patch, import_module, require


@contextlib.contextmanager
def _cuda_type_names() -> Iterator[None]:
    """``tensor.type()`` of a CPU tensor answers the CUDA name ("torch.cuda.FloatTensor"):
    megatron's optimizers sort parameters into fp32 and 16-bit groups by that string, and clipping
    asserts it."""
    original = torch.Tensor.type

    def type_name(
        self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs: Any
    ) -> Any:
        if dtype is None and not kwargs and self.device.type == "cpu":
            return original(self).replace("torch.", "torch.cuda.", 1)
        return original(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_name  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.type = original  # type: ignore[method-assign]


def _within(
    context: Callable[[], contextlib.AbstractContextManager[None]], function: Callable[..., Any]
) -> Callable[..., Any]:
    """``function``, every call of it run inside a fresh ``context()``."""

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        with context():
            return function(*args, **kwargs)

    return call


def _patch_type_check(module_path: str, owner_name: str | None, name: str) -> Patch:
    module = import_module(module_path)
    owner = module if owner_name is None else require(module, owner_name)
    return Patch(owner, name, _within(_cuda_type_names, require(owner, name)))


@contextlib.contextmanager
def _cuda_stays_on_cpu() -> Iterator[None]:
    """``tensor.cuda()`` returns the CPU tensor itself."""
    original = torch.Tensor.cuda

    def stay(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self

    torch.Tensor.cuda = stay  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.cuda = original  # type: ignore[method-assign]


def _patch_tied_embedding_setup() -> Patch:
    # with tied embeddings across pipeline stages, the last stage's copy is moved with .cuda()
    # before the all-reduce that makes it the first stage's
    module = require(
        import_module("megatron.core.models.common.language_module.language_module"),
        "LanguageModule",
    )
    original = require(module, "setup_embeddings_and_output_layer")
    return Patch(module, "setup_embeddings_and_output_layer", _within(_cuda_stays_on_cpu, original))


def _patch_clip_vit_setup() -> Patch:
    # CLIPViTModel puts its position ids on the GPU with .cuda() in its constructor
    model = require(import_module("megatron.core.models.vision.clip_vit_model"), "CLIPViTModel")
    return Patch(model, "__init__", _within(_cuda_stays_on_cpu, require(model, "__init__")))


def _cpu_load_scaler_state(self: Any, state_dict: dict[str, Any]) -> None:
    """DynamicGradScaler.load_state_dict without its ``.cuda()``: the scale stays on the CPU."""
    self._scale = state_dict["scale"].cpu()
    self._growth_tracker = state_dict["growth_tracker"]
    self._hysteresis_tracker = state_dict["hysteresis_tracker"]


def _patch_scaler_load() -> Patch:
    scaler = require(import_module("megatron.core.optimizer.grad_scaler"), "DynamicGradScaler")
    require(scaler, "load_state_dict")
    return Patch(scaler, "load_state_dict", _cpu_load_scaler_state)


def tensor_method_patches() -> list[Patch]:
    """The optimizers' and clipping's type checks, the ``.cuda()`` moves and the scaler's load."""
    return [
        _patch_type_check(
            "megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer", "__init__"
        ),
        _patch_type_check(
            "megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params", "__init__"
        ),
        # clipping asserts fp32 grads by type name; optimizer.py calls it under its own import
        _patch_type_check(
            "megatron.core.optimizer.optimizer", None, "clip_grad_by_total_norm_fp32"
        ),
        _patch_scaler_load(),
        _patch_tied_embedding_setup(),
        _patch_clip_vit_setup(),
    ]
