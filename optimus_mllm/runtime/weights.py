"""Weights that do not depend on the parallel plan, and whole-tensor views of shards.

Every matrix-shaped parameter is drawn whole from a generator seeded by its global name, then cut to
this rank's shard the way megatron-core shards it (``partition_dim``, ``partition_stride``). Vectors
keep megatron-core's constant initialisation (zero biases, unit norm weights). So a model built
under any plan, Optimus's, the Megatron-style baseline's or a single rank's, starts from the same
weights.

Global names: an encoder parameter is named by its encoder, global layer index and parameter; an LLM
parameter by its name inside megatron-core's ``GPTModel`` with the layer index replaced by the
layer's global one (``TransformerLayer.layer_number`` - 1, counted over all pipeline and virtual
stages), under ``llm.``. Megatron-core's TP layouts are all contiguous blocks, ``partition_stride``
apart: QKV rows are grouped by query group (a TP rank holds whole groups), vocabularies are split
into ranges, and a gated linear unit's fc1 holds [gate; up] per rank (stride 2).
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from megatron.core.models.gpt import GPTModel

from optimus_mllm.errors import OptimusError
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
    """Re-draw the encoder stage's matrices from ``seed`` and their global names."""
    _init_matrices_(global_parameter_names(stage), seed, stage.tp_group)


def llm_global_parameter_names(chunks: Sequence[GPTModel]) -> dict[str, torch.nn.Parameter]:
    """This rank's LLM parameters (all its chunks) keyed by a name that is the same under every
    plan.

    With tied embeddings across pipeline stages, the last stage's copy of the word embedding (its
    ``output_layer.weight``) is named as the embedding: both start equal and, gradients summed over
    megatron-core's embedding group, stay equal."""
    names = {}
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            parts = name.split(".")
            if parts[:2] == ["decoder", "layers"]:
                parts[2] = str(chunk.decoder.layers[int(parts[2])].layer_number - 1)
            if name == "output_layer.weight" and chunk.share_embeddings_and_output_weights:
                parts = ["embedding", "word_embeddings", "weight"]
            names[f"llm.{'.'.join(parts)}"] = param
    return names


def init_llm_plan_independent_(
    chunks: Sequence[GPTModel], seed: int, tp_group: dist.ProcessGroup
) -> None:
    """Re-draw the LLM chunks' matrices from ``seed`` and their global names.

    megatron-core's own initialisation draws from a stream whose position depends on the plan (which
    layers this rank builds, in which order), so two plans would start from different weights.

    Raises:
        OptimusError: a gated linear unit whose fc1 is not marked stride 2 under TP > 1: its [gate;
        up]
            halves would be cut as one block, so the TP ranks would not hold the whole tensor's
            rows.
    """
    named = llm_global_parameter_names(chunks)
    if tp_group.size() > 1 and any(chunk.config.gated_linear_unit for chunk in chunks):
        for name, param in named.items():
            if (
                name.endswith("mlp.linear_fc1.weight")
                and getattr(param, "partition_stride", 1) != 2
            ):
                raise OptimusError(
                    f"{name}: this megatron-core does not mark the gated linear unit's fc1 as "
                    "strided, so its weights cannot be made plan-independent; use "
                    "model.llm.gated_linear_unit: false or tp: 1"
                )
    _init_matrices_(named, seed, tp_group)


def _init_matrices_(
    named: Mapping[str, torch.nn.Parameter], seed: int, group: dist.ProcessGroup
) -> None:
    rank, size = group.rank(), group.size()
    with torch.no_grad():
        for name, param in named.items():
            if param.dim() < 2:
                continue
            generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
            block = getattr(param, "block_of", None)  # a 2D block (tp_modes.layers_2d.Linear2D)
            if block is not None:
                whole, ((rows, row), (columns, column)) = block
                full = torch.randn(whole, generator=generator, dtype=torch.float32) * 0.02
                param.copy_(full.chunk(rows, dim=0)[row].chunk(columns, dim=1)[column])
                continue
            shape = list(param.shape)
            if is_sharded(param):
                shape[param.partition_dim] *= size
            full = torch.randn(shape, generator=generator, dtype=torch.float32) * 0.02
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
    return torch.cat(
        [pieces[r][k] for k in range(stride) for r in range(size)], dim=param.partition_dim
    )


def whole_parameters(
    named: Mapping[str, torch.nn.Parameter], group: dist.ProcessGroup
) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """(weight, gradient) of every parameter, whole, by global name; a collective over ``group``.

    Args:
        named: this rank's parameters by global name (``global_parameter_names`` or
            ``llm_global_parameter_names``); every rank of ``group`` passes the same names.
        group: the TP group the parameters are sharded over.

    Returns:
        Whole copies; the gradient is None where the parameter has none (a frozen encoder). Another
        pipeline stage's parameters come from that stage's ranks; DP replicas hold equal copies.
        Under megatron-core's DDP the gradient is ``main_grad`` (whole after
        ``megatron_patches.ddp.gather_main_grads``).
    """
    with torch.no_grad():
        grads = {name: getattr(param, "main_grad", param.grad) for name, param in named.items()}
        return {
            name: (
                whole(param.detach(), param, group),
                None if grads[name] is None else whole(grads[name], param, group),
            )
            for name, param in named.items()
        }
