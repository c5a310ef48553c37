"""megatron-core's CUDA device lookups answered with the CPU (test and CI emulation only).

megatron-core allocates on the GPU by name in the modules its pipeline schedules and training stack
run: tensor factories given ``device="cuda"`` or ``torch.cuda.current_device()``, and
``torch.cuda.synchronize()`` around communication and timers. A patch here replaces the ``torch``
name inside one such megatron module (14 of them) by ``_CpuTorch``, which answers those calls with
the CPU and passes everything else to torch; two more replace the helpers that build a GPU tensor
themselves (the shared memory buffer, the default causal mask) by CPU twins. megatron's own code
keeps running.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from megatron_patches.lookup import Patch, import_module, require


def _cpu_if_cuda(device: Any) -> Any:
    """Map any CUDA device spec (name, torch.device or index) to the CPU; keep others as given."""
    if device is None:
        return None
    if isinstance(device, int) or torch.device(device).type == "cuda":
        return torch.device("cpu")
    return device


class _CpuCuda:
    """``torch.cuda`` as a megatron module sees it on a host without CUDA."""

    @staticmethod
    def current_device() -> torch.device:
        return torch.device("cpu")

    @staticmethod
    def synchronize(device: Any = None) -> None:
        """CPU ops are synchronous: nothing to wait for."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


def _on_cpu(factory: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``factory`` (torch.zeros, torch.tensor, ...) with a CUDA ``device=`` answered by the CPU."""

    def make(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return factory(*args, device=_cpu_if_cuda(device), **kwargs)

    return make


class _CpuTorch:
    """The ``torch`` name inside one megatron module: tensor factories given ``device="cuda"`` and
    ``cuda.current_device()`` give the CPU, ``cuda.synchronize()`` does nothing; all else is torch.
    """

    cuda = _CpuCuda()
    zeros = staticmethod(_on_cpu(torch.zeros))
    ones = staticmethod(_on_cpu(torch.ones))
    empty = staticmethod(_on_cpu(torch.empty))
    tensor = staticmethod(_on_cpu(torch.tensor))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _patch_schedules_token_counter() -> Patch:
    # schedules.py creates its token counter with torch.zeros(..., device="cuda") in every schedule
    schedules = import_module("megatron.core.pipeline_parallel.schedules")
    require(schedules, "torch")
    return Patch(schedules, "torch", _CpuTorch())


def _patch_p2p_buffers() -> Patch:
    # p2p receive buffers go to torch.cuda.current_device(); batch_p2p_sync calls
    # torch.cuda.synchronize()
    p2p = import_module("megatron.core.pipeline_parallel.p2p_communication")
    require(p2p, "torch")
    return Patch(p2p, "torch", _CpuTorch())


def _cpu_get_tensor(
    self: Any, tensor_shape: Sequence[int], dtype: torch.dtype, name: str, *args: Any, **kwargs: Any
) -> torch.Tensor:
    """A fresh CPU tensor: the shared buffer only spares the CUDA caching allocator."""
    return torch.empty(tuple(tensor_shape), dtype=dtype)


def _patch_global_memory_buffer() -> Patch:
    # get_tensor() allocates on torch.cuda.current_device(); the local attention calls it
    buffer_class = require(import_module("megatron.core.utils"), "GlobalMemoryBuffer")
    require(buffer_class, "get_tensor")
    return Patch(buffer_class, "get_tensor", _cpu_get_tensor)


_TRAINING_MODULES = (
    # each allocates a buffer, a flag or a scale with device="cuda" / torch.cuda.current_device()
    "megatron.core.distributed.param_and_grad_buffer",  # DDP's contiguous param and grad buffers
    "megatron.core.optimizer.optimizer",  # found-inf flag, overflow buffer, loss-scale one
    "megatron.core.optimizer.distrib_optimizer",  # the distributed optimizer's shard buffers
    "megatron.core.optimizer.clip_grads",  # grad-norm accumulator and overflow buffer
    "megatron.core.optimizer.grad_scaler",  # the loss scale and its growth/backoff factors
    "megatron.core.utils",  # local_multi_tensor_l2_norm, the grad norm without apex / TE
    # sequence parallelism's all-gather / reduce-scatter outputs
    "megatron.core.tensor_parallel.mappings",
    # the sequence-parallel all-gather in a linear's backward
    "megatron.core.tensor_parallel.layers",
    # dist_checkpointing: the writer's host copies wait on torch.cuda.synchronize(), and the save's
    # plan and finish agree over flags made on the current CUDA device
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    # RoPE moves its inverse frequencies to torch.cuda.current_device() at the first forward
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    # Megatron's timers synchronize CUDA around every start/stop and gather their times on the
    # device
    "megatron.core.timers",
)


def _patch_training_module(path: str) -> Patch:
    module = import_module(path)
    require(module, "torch")
    return Patch(module, "torch", _CpuTorch())


@functools.lru_cache(maxsize=32)
def _cpu_default_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq), diagonal=1).bool()


def _patch_default_causal_mask() -> Patch:
    # given no mask (CLIPViTModel passes none), a causal layer's local softmax builds one on the GPU
    softmax = import_module("megatron.core.fusions.fused_softmax")
    require(softmax, "get_default_causal_mask")
    return Patch(softmax, "get_default_causal_mask", _cpu_default_causal_mask)


def device_patches() -> list[Patch]:
    """The ``torch`` name in each megatron module that allocates on or synchronizes the GPU, and the
    helpers that build a GPU tensor themselves."""
    return [
        _patch_schedules_token_counter(),
        _patch_p2p_buffers(),
        _patch_global_memory_buffer(),
        _patch_default_causal_mask(),
        *(_patch_training_module(path) for path in _TRAINING_MODULES),
    ]
