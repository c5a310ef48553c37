"""CPU stand-ins for the spots where megatron-core hard-codes CUDA on its pipeline-schedule path.

Each ``_patch_*`` function names one megatron-core attribute and builds its replacement; megatron's
own code keeps running, only its CUDA device lookups are answered with the CPU.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch


class MegatronPatchError(RuntimeError):
    """A megatron-core attribute that a patch needs is missing (renamed in this version?)."""


@dataclass(frozen=True)
class Patch:
    """Replace ``owner.name`` (a module or class attribute) by ``replacement``."""

    owner: object
    name: str
    replacement: object


def _megatron_version() -> str:
    return getattr(importlib.import_module("megatron.core"), "__version__", "unknown")


def _module(path: str) -> ModuleType:
    try:
        return importlib.import_module(path)
    except ImportError as error:
        raise MegatronPatchError(
            f"megatron_patches: cannot import {path} (megatron-core {_megatron_version()})"
        ) from error


def _require(owner: object, name: str) -> Any:
    if not hasattr(owner, name):
        raise MegatronPatchError(
            f"megatron_patches: {getattr(owner, '__name__', owner)} has no attribute {name!r} "
            f"(megatron-core {_megatron_version()}); update megatron_patches for this version"
        )
    return getattr(owner, name)


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
    schedules = _module("megatron.core.pipeline_parallel.schedules")
    _require(schedules, "torch")
    return Patch(schedules, "torch", _CpuTorch())


def _patch_p2p_buffers() -> Patch:
    # p2p receive buffers go to torch.cuda.current_device(); batch_p2p_sync calls
    # torch.cuda.synchronize()
    p2p = _module("megatron.core.pipeline_parallel.p2p_communication")
    _require(p2p, "torch")
    return Patch(p2p, "torch", _CpuTorch())


def _cpu_get_tensor(
    self: Any, tensor_shape: Sequence[int], dtype: torch.dtype, name: str, *args: Any, **kwargs: Any
) -> torch.Tensor:
    """A fresh CPU tensor: the shared buffer only spares the CUDA caching allocator."""
    return torch.empty(tuple(tensor_shape), dtype=dtype)


def _patch_global_memory_buffer() -> Patch:
    # get_tensor() allocates on torch.cuda.current_device(); the local attention calls it
    buffer_class = _require(_module("megatron.core.utils"), "GlobalMemoryBuffer")
    _require(buffer_class, "get_tensor")
    return Patch(buffer_class, "get_tensor", _cpu_get_tensor)


def _rng_tracker_class() -> type:
    return _require(_module("megatron.core.tensor_parallel.random"), "CudaRNGStatesTracker")


def _cpu_rng_add(self: Any, name: str, seed: int) -> None:
    """Track a CPU generator state seeded with ``seed`` (megatron's add() seeds the CUDA one)."""
    if seed in self.seeds_:
        raise Exception(f"seed {seed} already exists")
    if name in self.states_:
        raise Exception(f"rng state {name} already exists")
    self.seeds_.add(seed)
    self.states_[name] = torch.Generator().manual_seed(seed).get_state()
    self._is_initialized = True


def _patch_rng_tracker_add() -> Patch:
    # add() reads and seeds the CUDA generator; model_parallel_cuda_manual_seed reaches only this
    tracker_class = _rng_tracker_class()
    _require(tracker_class, "add")
    return Patch(tracker_class, "add", _cpu_rng_add)


def _cpu_rng_fork(default_name: str) -> Callable[..., contextlib.AbstractContextManager[None]]:
    """fork() over the default CPU generator, which plays the CUDA generator's part on CPU."""

    @contextlib.contextmanager
    def fork(self: Any, name: str = default_name) -> Iterator[None]:
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        outer_state = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer_state)

    return fork


def _patch_rng_tracker_fork() -> Patch:
    # fork() swaps the CUDA generator state; the local attention enters it around its dropout
    tracker_class = _rng_tracker_class()
    original = _require(tracker_class, "fork")
    name_parameter = inspect.signature(original).parameters.get("name")
    if name_parameter is None or name_parameter.default is inspect.Parameter.empty:
        raise MegatronPatchError(
            f"megatron_patches: CudaRNGStatesTracker.fork{inspect.signature(original)} has no "
            f"default 'name' (megatron-core {_megatron_version()})"
        )
    return Patch(tracker_class, "fork", _cpu_rng_fork(name_parameter.default))


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
    module = _module(path)
    _require(module, "torch")
    return Patch(module, "torch", _CpuTorch())


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
    module = _module(module_path)
    owner = module if owner_name is None else _require(module, owner_name)
    return Patch(owner, name, _within(_cuda_type_names, _require(owner, name)))


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
    module = _require(
        _module("megatron.core.models.common.language_module.language_module"), "LanguageModule"
    )
    original = _require(module, "setup_embeddings_and_output_layer")
    return Patch(module, "setup_embeddings_and_output_layer", _within(_cuda_stays_on_cpu, original))


def _patch_clip_vit_setup() -> Patch:
    # CLIPViTModel puts its position ids on the GPU with .cuda() in its constructor
    model = _require(_module("megatron.core.models.vision.clip_vit_model"), "CLIPViTModel")
    return Patch(model, "__init__", _within(_cuda_stays_on_cpu, _require(model, "__init__")))


@functools.lru_cache(maxsize=32)
def _cpu_default_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq), diagonal=1).bool()


def _patch_default_causal_mask() -> Patch:
    # given no mask (CLIPViTModel passes none), a causal layer's local softmax builds one on the GPU
    softmax = _module("megatron.core.fusions.fused_softmax")
    _require(softmax, "get_default_causal_mask")
    return Patch(softmax, "get_default_causal_mask", _cpu_default_causal_mask)


def _cpu_load_scaler_state(self: Any, state_dict: dict[str, Any]) -> None:
    """DynamicGradScaler.load_state_dict without its ``.cuda()``: the scale stays on the CPU."""
    self._scale = state_dict["scale"].cpu()
    self._growth_tracker = state_dict["growth_tracker"]
    self._hysteresis_tracker = state_dict["hysteresis_tracker"]


def _patch_scaler_load() -> Patch:
    scaler = _require(_module("megatron.core.optimizer.grad_scaler"), "DynamicGradScaler")
    _require(scaler, "load_state_dict")
    return Patch(scaler, "load_state_dict", _cpu_load_scaler_state)


def training_patches() -> list[Patch]:
    """DDP, the (distributed) optimizer, clipping, loss scaling and tied embeddings on the CPU."""
    return [
        *(_patch_training_module(path) for path in _TRAINING_MODULES),
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
    ]


def _cpu_get_rng_state(
    device: Any = "cuda", clone: bool = False, graph_safe: bool = False
) -> torch.Tensor:
    """The default CPU generator's state, which plays the CUDA generator's part on CPU (as in
    fork())."""
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _patch_rng_state(name: str, replacement: Callable[..., Any]) -> Patch:
    # activation checkpointing (selective and full recompute) saves and restores the CUDA generator
    # around the recomputed forward, through these two functions
    random = _module("megatron.core.tensor_parallel.random")
    _require(random, name)
    return Patch(random, name, replacement)


def cpu_patches() -> list[Patch]:
    """Every patch CPU runs need; raises MegatronPatchError before anything is installed."""
    return [
        _patch_schedules_token_counter(),
        _patch_p2p_buffers(),
        _patch_global_memory_buffer(),
        _patch_rng_tracker_add(),
        _patch_rng_tracker_fork(),
        _patch_rng_state("_get_cuda_rng_state", _cpu_get_rng_state),
        _patch_rng_state("_set_cuda_rng_state", _cpu_set_rng_state),
        _patch_clip_vit_setup(),
        _patch_default_causal_mask(),
        *training_patches(),
    ]
