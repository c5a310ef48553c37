"""Encoder weights that do not depend on the encoder's parallel plan, and whole-tensor views of shards.

Every matrix-shaped parameter is drawn whole from a generator seeded by its global name (encoder,
global layer index, parameter), then cut to this rank's shard the way megatron-core shards it
(``partition_dim``, ``partition_stride``). Vectors keep megatron-core's constant initialisation (zero
biases, unit norm weights). So an encoder built under any (PP, TP) plan, Optimus's or the
Megatron-style baseline's, starts from the same weights.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from optimus_mllm.runtime.vit import EncoderStage


def global_parameter_names(stage: EncoderStage) -> dict[str, torch.nn.Parameter]:
    """Parameters keyed by a name that is the same under every plan: layer indices are global."""
    names = {}
    for encoder, vision in stage.encoders.items():
        for name, param in vision.named_parameters():
            parts = name.split(".")
            if parts[0] == "layers":
                parts[1] = str(vision.first_layer + int(parts[1]))
            names[f"{encoder}.{'.'.join(parts)}"] = param
    return names


def is_sharded(param: torch.Tensor) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False))


def shard(full: torch.Tensor, param: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """This TP rank's part of a whole tensor, as megatron-core splits it."""
    if not is_sharded(param) or size == 1:
        return full
    stride = getattr(param, "partition_stride", 1)
    chunks = full.chunk(size * stride, dim=param.partition_dim)
    return torch.cat(chunks[rank::size], dim=param.partition_dim)


def init_plan_independent_(stage: EncoderStage, seed: int) -> None:
    group = stage.tp_group
    rank, size = group.rank(), group.size()
    with torch.no_grad():
        for name, param in global_parameter_names(stage).items():
            if param.dim() < 2:
                continue
            shape = list(param.shape)
            if is_sharded(param):
                shape[param.partition_dim] *= size
            generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
            full = torch.randn(shape, generator=generator) * 0.02
            param.copy_(shard(full, param, rank, size))


def whole(tensor: torch.Tensor, param: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The whole tensor (e.g. a gradient) from every TP rank's shard of ``param``."""
    size = group.size()
    if not is_sharded(param) or size == 1:
        return tensor.clone()
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    stride = getattr(param, "partition_stride", 1)
    pieces = [part.chunk(stride, dim=param.partition_dim) for part in parts]
    return torch.cat([pieces[r][k] for k in range(stride) for r in range(size)], dim=param.partition_dim)
