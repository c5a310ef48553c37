"""Peak bytes of the tensors a piece of code allocates, counted on CPU by storage.

``LiveBytes`` is a ``TorchDispatchMode``: every op's output storage not seen before is counted from
the op that creates it until the storage is freed (a weak reference's callback), so views, in-place
ops and ``out=`` writes (outputs sharing an input's storage) add nothing, and tensors that existed
before (inputs, parameters) are not counted. ``peak`` is the largest sum of live counted bytes at
any op; ``live`` what is still allocated (what the code kept, e.g. for backward). Buffers a
collective writes into were allocated by an op (``empty_like``), so they count as well.

``held_bytes`` counts what a layer holds: its parameters, and the storages autograd saves in its
forward (a ``saved_tensors_hooks`` pack hook), each once.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from optimus_mllm.costing.tp_memory import LayerBytes


class LiveBytes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: dict[int, int] = {}  # storage data pointer -> bytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for tensor in tree_leaves(out):
            if (
                isinstance(tensor, torch.Tensor)
                and tensor.untyped_storage().data_ptr() not in inputs
            ):
                self._count(tensor.untyped_storage())
        return out

    def _count(self, storage: torch.UntypedStorage) -> None:
        key, size = storage.data_ptr(), storage.nbytes()
        if key in self._seen or size == 0:
            return
        self._seen[key] = size
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.live -= self._seen.pop(key)


def held_bytes(layer: torch.nn.Module, x: torch.Tensor, mask: torch.Tensor | None) -> LayerBytes:
    """Bytes of ``layer``'s parameters on this rank, and of what autograd saves in its forward of
    ``x`` under ``mask``: each storage once, less the parameters' and the mask's."""
    skip = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    if mask is not None:
        skip.add(mask.untyped_storage().data_ptr())
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x.requires_grad_(True), attention_mask=mask)
    parameters = sum(p.numel() * p.element_size() for p in layer.parameters())
    return LayerBytes(parameters, sum(saved.values()))
