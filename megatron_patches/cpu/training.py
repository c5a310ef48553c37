"""CPU stand-ins for the spots where Megatron-LM's ``megatron.training`` hard-codes CUDA.

megatron-core's own CUDA spots are ``megatron_patches.cpu``'s; this module adds those of
Megatron-LM's training loop (a checkout, not the megatron-core wheel), so that Megatron-LM's
unmodified scripts (``pretrain_vlm.py``) train on gloo ranks of a host without CUDA. It is CPU
emulation only: where CUDA is available ``apply()`` installs nothing. Each ``_patch_*`` names one
Megatron-LM attribute, checked to exist when the patches are built (a missing one installs nothing),
and ``remove()`` puts back every original object, megatron-core's included.

What is redirected, and why:
- ``initialize_megatron`` asserts CUDA unless ``allow_no_cuda=True``, which ``pretrain`` does not
  pass; ``_initialize_distributed`` and ``_set_random_seed`` build ``parallel_state`` and seed the
  model-parallel RNG tracker only when ``torch.cuda.device_count() > 0``: in ``initialize`` the CPU
  is counted as the one device, and setting it does nothing.
- ``device="cuda"`` tensors, ``torch.cuda.current_device()`` and the DDP set-up's side stream in
  ``training``, ``utils``, ``checkpointing`` and ``initialize``, and
  ``tensor_parallel.broadcast_data``'s buffers: the CPU, and a stream that orders nothing; a
  checkpoint's CUDA RNG state is the CPU generator's, which plays its part on the CPU.
- ``set_jit_fusion_options`` warms the GPU's fused kernels up with inputs drawn from the CUDA
  generator; on the CPU they would be drawn from the one the weights are initialized from, so the
  warm-up is skipped.
- ``.cuda()`` on the model in ``get_model``, on the batch in ``broadcast_data`` and on the
  validation-loss sums in ``evaluate``: the CPU object itself.
- ``validate_args`` asks the GPU's architecture at TP>1; a CPU has none (0: no architecture, so the
  pre-Blackwell ``CUDA_DEVICE_MAX_CONNECTIONS=1`` requirement stays, as Megatron's examples set it).
- ``LLaVAModel`` builds ``CLIPViTModel`` with its default ``ln_pre``, which without
  transformer-engine is ``torch.nn.LayerNorm`` given a ``config=`` it does not take: megatron-core's
  ``WrappedTorchNorm`` (the same LayerNorm) is passed instead.
- ``_compile_dependencies`` builds the dataset helpers with ``make`` in megatron-core's folder; the
  megatron-core wheel ships them built and has no Makefile, so the built module is used when it
  imports.
- resuming with ``--use-distributed-optimizer --ckpt-format torch`` fails in megatron-core's
  ``DistributedOptimizer.load_parameter_state_from_dp_zero`` with torch's optimizers, which stand in
  for apex / transformer-engine here: ``megatron_patches.optimizer.dp_zero_load_patches``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable
from typing import Any

import torch

import megatron_patches
from megatron_patches.cpu.devices import _CpuCuda, _CpuTorch
from megatron_patches.cpu.tensor_methods import _cuda_stays_on_cpu, _within
from megatron_patches.lookup import MegatronPatchError, Originals, Patch, install, restore
from megatron_patches.lookup import import_module as _module
from megatron_patches.lookup import require as _require

__all__ = [
    "MegatronPatchError",
    "apply",
    "is_applied",
    "remove",
    "training_cpu_patches",
]

_originals: Originals = []
_installed_core = False  # whether apply() installed megatron-core's patches (remove() takes them)


class _NoStream:
    """A CUDA stream on the CPU: work runs in program order, so there is nothing to order."""

    def wait_stream(self, stream: Any) -> None:
        """Nothing queued on another stream to wait for."""

    def synchronize(self) -> None:
        """Nothing queued to finish."""


class _TrainingCuda(_CpuCuda):
    """``torch.cuda`` as a ``megatron.training`` module sees it: the CPU is its one device."""

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def set_device(device: Any) -> None:
        """The CPU is the only device; there is none to select."""

    Stream = _NoStream

    @staticmethod
    def current_stream(device: Any = None) -> _NoStream:
        return _NoStream()

    @staticmethod
    def stream(stream: Any) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    # the default CPU generator plays the CUDA generator's part (as in cpu/rng.py's RNG tracker), so
    # a checkpoint's "cuda_rng_state" is its state
    @staticmethod
    def get_rng_state(device: Any = "cuda") -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
        torch.set_rng_state(new_state)


class _TrainingTorch(_CpuTorch):
    """The ``torch`` name inside one ``megatron.training`` module (``_CpuTorch`` plus the device
    count, device selection and streams its set-up asks for)."""

    cuda = _TrainingCuda()


# the megatron.training modules (and megatron-core's broadcast_data) whose ``torch`` is redirected
_TRAINING_LOOP_MODULES = (
    "megatron.training.initialize",  # device count and selection, the JIT warm-up's tensors
    "megatron.training.training",  # start-time and loss-sum tensors, the DDP side stream
    "megatron.training.utils",  # grad-norm and loss-average tensors
    "megatron.training.checkpointing",  # the iteration agreed on the device, the RNG states
    "megatron.core.tensor_parallel.data",  # broadcast_data's size and payload buffers
)


def _patch_torch_name(path: str) -> Patch:
    module = _module(path)
    _require(module, "torch")
    return Patch(module, "torch", _TrainingTorch())


def _patch_initialize_megatron() -> Patch:
    # pretrain() calls initialize_megatron without allow_no_cuda, which asserts CUDA
    training = _module("megatron.training.training")
    original = _require(training, "initialize_megatron")
    return Patch(training, "initialize_megatron", functools.partial(original, allow_no_cuda=True))


def _patch_stays_on_cpu(path: str, name: str) -> Patch:
    module = _module(path)
    return Patch(module, name, _within(_cuda_stays_on_cpu, _require(module, name)))


def _no_jit_warmup() -> None:
    """Nothing to warm up: the fused kernels are the GPU's."""


def _patch_jit_warmup() -> Patch:
    # the warm-up draws its inputs from the CUDA generator; on the CPU they would come from the
    # generator that --use-cpu-initialization initializes the weights from, by an amount that
    # depends on TP, so the weights would too
    initialize = _module("megatron.training.initialize")
    _require(initialize, "_warmup_jit_function")
    return Patch(initialize, "_warmup_jit_function", _no_jit_warmup)


def _no_device_arch_version() -> int:
    """A CPU has no GPU architecture (0: older than any)."""
    return 0


def _patch_device_arch_version() -> Patch:
    # validate_args asks torch.cuda.get_device_properties("cuda:0") at TP>1 or CP>1
    arguments = _module("megatron.training.arguments")
    _require(arguments, "get_device_arch_version")
    return Patch(arguments, "get_device_arch_version", _no_device_arch_version)


def _built_helpers_or_make(make: Callable[[], None]) -> Callable[[], None]:
    def compile_helpers() -> None:
        try:
            importlib.import_module("megatron.core.datasets.helpers_cpp")
        except ImportError:
            make()

    return compile_helpers


def _patch_dataset_helpers() -> Patch:
    utils = _module("megatron.core.datasets.utils")
    return Patch(
        utils, "compile_helpers", _built_helpers_or_make(_require(utils, "compile_helpers"))
    )


def _torch_norm_by_default(init: Callable[..., None]) -> Callable[..., None]:
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    @functools.wraps(init)
    def build(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("ln_pre_impl", WrappedTorchNorm)
        init(self, *args, **kwargs)

    return build


def _patch_clip_ln_pre() -> Patch:
    # without transformer-engine, CLIPViTModel's default ln_pre is torch.nn.LayerNorm, which
    # build_module gives a config= it does not take; LLaVAModel passes none
    clip = _module("megatron.core.models.vision.clip_vit_model")
    if _require(clip, "NORM_IMPL") is not torch.nn.LayerNorm:
        raise MegatronPatchError("megatron_patches: CLIPViTModel's ln_pre is not torch's LayerNorm")
    model = _require(clip, "CLIPViTModel")
    return Patch(model, "__init__", _torch_norm_by_default(_require(model, "__init__")))


def training_cpu_patches() -> list[Patch]:
    """The ``megatron.training`` patches; raises MegatronPatchError when Megatron-LM is not
    importable or lacks an attribute, before anything is installed."""
    from megatron_patches.optimizer import dp_zero_load_patches  # imports megatron-core

    return [
        *(_patch_torch_name(path) for path in _TRAINING_LOOP_MODULES),
        _patch_initialize_megatron(),
        _patch_stays_on_cpu("megatron.training.training", "get_model"),
        _patch_stays_on_cpu("megatron.training.training", "evaluate"),
        # pretrain_vlm.py calls it as tensor_parallel.broadcast_data: the package's name too
        _patch_stays_on_cpu("megatron.core.tensor_parallel.data", "broadcast_data"),
        _patch_stays_on_cpu("megatron.core.tensor_parallel", "broadcast_data"),
        _patch_jit_warmup(),
        _patch_device_arch_version(),
        _patch_dataset_helpers(),
        _patch_clip_ln_pre(),
        *dp_zero_load_patches(),
    ]


def apply() -> None:
    """Install megatron-core's CPU patches and Megatron-LM's; a no-op if they are installed or CUDA
    is available.

    Raises MegatronPatchError, installing nothing, if an attribute a patch needs is missing.
    """
    global _installed_core
    if _originals or torch.cuda.is_available():
        return
    _installed_core = not megatron_patches.is_applied()
    megatron_patches.apply()
    try:  # built over megatron-core's patches (CLIPViTModel.__init__ is patched twice)
        patches = training_cpu_patches()
    except MegatronPatchError:
        remove()
        raise
    install(patches, _originals)


def remove() -> None:
    """Restore every patched attribute to its original object, and megatron-core's if apply()
    installed them; a no-op if nothing is installed."""
    global _installed_core
    restore(_originals)
    if _installed_core:
        megatron_patches.remove()
        _installed_core = False


def is_applied() -> bool:
    """Whether these patches are installed now."""
    return bool(_originals)
