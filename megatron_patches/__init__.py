"""The only place in optimus-mllm that patches megatron-core, in two parts.

Production seams, used on GPUs as on the CPU, each a hook megatron-core has no API for:
- ``p2p``: pipeline P2P with one process group per direction, for any warm-up (the paper's
  adjusted warm-up hangs or mismatches messages under megatron-core's own communicator);
- ``hooks``: hook points around the tensor-parallel reductions inside megatron-core's layers, where
  the runtime launches encoder kernels, and the warm-up count of megatron-core's schedule;
- ``ddp``: gradient averaging over fewer replicas than the DP group, and whole reduced gradients;
- ``optimizer``: the optimizer checkpoint state where torch's optimizers stand in for apex / TE;
- ``checkpoint``: megatron-core's checkpoint writer run synchronously, without its extra process.

CPU emulation, for tests and CI on hosts without CUDA (``cpu``): megatron-core's CUDA device
lookups, CUDA generator and ``Tensor.type`` / ``.cuda`` answered with the CPU. ``apply()``,
``remove()``, ``is_applied()`` and ``patched()`` install and restore it; with CUDA they install
nothing. Every target is resolved through ``lookup``, checked against the installed version.
"""

from __future__ import annotations

from megatron_patches.cpu import apply, is_applied, patched, remove
from megatron_patches.lookup import MegatronPatchError

__all__ = ["MegatronPatchError", "apply", "is_applied", "patched", "remove"]
