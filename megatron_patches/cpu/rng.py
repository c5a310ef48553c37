"""megatron-core's CUDA random-number state kept in the CPU generator (test and CI emulation only).

megatron-core seeds, forks and restores the CUDA generator: ``CudaRNGStatesTracker.add`` and
``fork`` (model-parallel seeds, dropout inside tensor-parallel regions) and
``_get_cuda_rng_state`` / ``_set_cuda_rng_state`` (activation recompute replays its forward's
dropout). On the CPU the default CPU generator plays the CUDA generator's part in all four, so
dropout and recompute draw the same numbers in the same order as they would on one GPU.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch

from megatron_patches.lookup import (
    MegatronPatchError,
    Patch,
    import_module,
    megatron_version,
    require,
)


def _rng_tracker_class() -> type:
    return require(import_module("megatron.core.tensor_parallel.random"), "CudaRNGStatesTracker")


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
    require(tracker_class, "add")
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
    original = require(tracker_class, "fork")
    name_parameter = inspect.signature(original).parameters.get("name")
    if name_parameter is None or name_parameter.default is inspect.Parameter.empty:
        raise MegatronPatchError(
            f"megatron_patches: CudaRNGStatesTracker.fork{inspect.signature(original)} has no "
            f"default 'name' (megatron-core {megatron_version()})"
        )
    return Patch(tracker_class, "fork", _cpu_rng_fork(name_parameter.default))


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
    random = import_module("megatron.core.tensor_parallel.random")
    require(random, name)
    return Patch(random, name, replacement)


def rng_patches() -> list[Patch]:
    """The tracker's add and fork, and the state save and restore around a recomputed forward."""
    return [
        _patch_rng_tracker_add(),
        _patch_rng_tracker_fork(),
        _patch_rng_state("_get_cuda_rng_state", _cpu_get_rng_state),
        _patch_rng_state("_set_cuda_rng_state", _cpu_set_rng_state),
    ]
