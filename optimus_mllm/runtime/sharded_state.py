"""The model's sharded state dict for megatron-core's ``dist_checkpointing``, under either runtime.

Keys are megatron-core's LLaVA layout (``megatron.core.models.multimodal.llava_model``), so a
checkpoint loads into any plan, into either runtime and into a plain megatron-core script:

- ``language_model.``: each LLM chunk's own ``GPTModel.sharded_state_dict`` (global layer numbers,
  TP shards, the tied output embedding as a replica of the input one);
- ``vision_model.`` and ``vision_projection.`` for the encoder (prefixed by the encoder's name,
  ``<name>.vision_model.``, when the config has several), under megatron-core's own modules' keys:
  the patch embedding as ``CLIPViTModel``'s (``conv1.*``, ``position_embeddings.weight``); the
  layers' own ``TransformerLayer.sharded_state_dict``, stacked over layers as megatron-core's
  ``TransformerBlock`` saves them (``decoder.layers.self_attention.linear_qkv.weight`` holds every
  layer, each rank writing its layers' slices; with ``layer_ops.vision_layer_spec`` the norms go as
  ``.self_attention.linear_qkv.layer_norm_weight``); the projector as ``MultimodalProjector``'s
  (``encoder.linear_fc1`` ...; the ``affine`` and ``linear`` projectors' one GEMM as
  ``encoder.weight``: the same matrix, column- or row-sharded).

Each tensor is a ``ShardedTensor`` holding the parameter itself (so the optimizer's state maps onto
it) with its TP shard and its replica id over the encoder's own groups: in Optimus mode the encoder
plan's TP and DP groups, in the Megatron-style baseline the LLM's.

``copy_sharded_state`` moves tensors between two such layouts in memory (one plan's shards into
another's), as a save under one and a load under the other would.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import (
    ShardedStateDict,
    ShardedTensor,
    apply_factories,
    is_main_replica,
)
from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
from megatron.core.utils import make_sharded_tensor_for_checkpoint
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from optimus_mllm.config import OptimusConfig
from optimus_mllm.errors import OptimusError
from optimus_mllm.runtime.vit import EncoderStage, VisionStage

LLM_PREFIX = "language_model."
LLM_ROOTS = ("embedding.", "decoder.", "output_layer.")  # a megatron-core GPTModel's own keys
ENCODER_ROOTS = ("vision_model.", "vision_projection.")


def model_entries(chunks: int) -> list[str]:
    """Megatron-LM's ``model`` (one chunk) or ``model0``, ``model1``... (virtual stages) entry
    names."""
    return ["model"] if chunks == 1 else [f"model{i}" for i in range(chunks)]


def llm_sharded_state_dict(chunks: list[Any]) -> dict[str, ShardedStateDict]:
    """The LLM chunks' ``model`` / ``model<i>`` entries."""
    return {
        key: chunk.sharded_state_dict(prefix=LLM_PREFIX)
        for key, chunk in zip(model_entries(len(chunks)), chunks)
    }


def encoder_prefix(config: OptimusConfig, name: str) -> str:
    """The key prefix of one encoder: LLaVA's own names for a single encoder."""
    return "" if len(config.encoders) == 1 else f"{name}."


def part_layout(config: OptimusConfig, part: str) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    """(prefix, roots, prefixes a checkpoint may hold it under) of one model part, ``"llm"`` or an
    encoder's name: its keys are prefix + a root + the rest. Besides this layout's own prefix, the
    LLM may stand alone (a megatron-core GPT checkpoint) and an encoder alone or among several."""
    if part == "llm":
        return LLM_PREFIX, LLM_ROOTS, (LLM_PREFIX, "")
    prefix = encoder_prefix(config, part)
    return prefix, ENCODER_ROOTS, tuple(dict.fromkeys((prefix, "", f"{part}.")))


def encoder_sharded_state_dict(
    config: OptimusConfig, stage: EncoderStage, dp_group: ProcessGroup
) -> ShardedStateDict:
    """This rank's encoder stage as ShardedTensors keyed by the LLaVA layout's plan-independent
    names.

    Args:
        config: the job's config (its encoders name the prefixes).
        stage: this rank's encoder stage; its TP group is the one the tensors are sharded over.
        dp_group: the group of the stage's data-parallel replicas (only replica 0 writes a tensor).
    """
    groups = {"tp_group": stage.tp_group, "dp_cp_group": dp_group}
    metadata = {"dp_cp_group": dp_group}
    state: ShardedStateDict = {}
    for name, vision in stage.encoders.items():
        prefix = encoder_prefix(config, name)
        state.update(_vision_state(vision, f"{prefix}vision_model.", groups, metadata))
        projector = vision.projector
        # megatron-core's MultimodalProjector (mlp, affine), its own keys
        if projector is not None and projector.kind != "linear":
            state.update(
                projector.projection.sharded_state_dict(f"{prefix}vision_projection.", (), metadata)
            )
        elif projector is not None:
            state.update(
                projector.linear.sharded_state_dict(
                    f"{prefix}vision_projection.encoder.", (), metadata
                )
            )
    return state


def _vision_state(
    vision: VisionStage, prefix: str, groups: dict[str, ProcessGroup], metadata: dict[str, Any]
) -> ShardedStateDict:
    state: ShardedStateDict = {}
    if vision.patch_embed is not None:
        # CLIPViTModel's conv1, position_embeddings
        state.update(_replicated(vision.patch_embed, prefix, groups, ()))
    layers = f"{prefix}decoder.layers."
    for i, layer in enumerate(vision.layers):
        index = vision.first_layer + i
        # megatron-core's TransformerBlock: one tensor per parameter over all layers, each layer its
        # slice
        layer_state = layer.sharded_state_dict(
            f"{layers}{index}.", ((0, index, vision.encoder.num_layers),), metadata
        )
        replace_prefix_for_sharding(layer_state, f"{layers}{index}.", layers)
        state.update(layer_state)
    return state


def _replicated(
    module: nn.Module,
    prefix: str,
    groups: dict[str, ProcessGroup],
    offsets: tuple[tuple[int, int, int], ...],
) -> ShardedStateDict:
    """A module whose parameters every TP rank holds whole (norms, the patch embedding)."""
    return {
        f"{prefix}{name}": make_sharded_tensor_for_checkpoint(
            param, f"{prefix}{name}", offsets, **groups
        )
        for name, param in module.named_parameters()
    }


def whole_tensors(
    state: ShardedStateDict, shapes: dict[str, tuple[int, ...]], what: str
) -> dict[str, Tensor]:
    """Each key of ``shapes`` as its whole (global) tensor on every rank, fp32, assembled from the
    main replicas of ``state``'s pieces wherever they are. Collective over the world; a key no rank
    holds, or held with another global shape, is an ``OptimusError`` naming it, raised on every rank
    alike."""
    have = sharded_tensors(state)
    held = global_shapes(state)
    for key in sorted(shapes):
        if key not in held:
            raise OptimusError(f"{what}: the source has no {key}")
        if held[key] != tuple(shapes[key]):
            raise OptimusError(
                f"{what}: {key} is {held[key]} in the source but {tuple(shapes[key])} here"
            )
    whole = {}
    for key in sorted(shapes):
        tensor = torch.zeros(shapes[key], dtype=torch.float32)
        for piece in have.get(key, []):
            if is_main_replica(piece.replica_id):
                tensor[piece.global_slice()] = (
                    piece.data.detach().float().reshape(piece.local_shape)
                )
        dist.all_reduce(tensor)  # every element comes from exactly one main replica
        whole[key] = tensor
    return whole


def copy_sharded_state(source: ShardedStateDict, target: ShardedStateDict, what: str) -> None:
    """Every tensor of ``target`` takes its slice of the tensor with its key in ``source``.

    Collective over the world: each rank holds any part of either side (``ShardedTensor``s, each
    placing its data in the global tensor), so one plan's shards become another's, as a
    ``dist_checkpointing`` save and load would, without the files.
    """
    want = sharded_tensors(target)
    whole = whole_tensors(source, global_shapes(target), what)
    with torch.no_grad():
        for key, pieces in want.items():
            for piece in pieces:
                piece.data.copy_(whole[key][piece.global_slice()].reshape(piece.data.shape))


def global_shapes(state: ShardedStateDict) -> dict[str, tuple[int, ...]]:
    """The global shape of every key that any rank's ``state`` holds. Collective over the world."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(
        gathered, {k: tuple(p[0].global_shape) for k, p in sharded_tensors(state).items()}
    )
    return {k: v for rank_held in gathered for k, v in rank_held.items()}


def sharded_tensors(state: ShardedStateDict) -> dict[str, list[ShardedTensor]]:
    """This rank's ``ShardedTensor`` pieces of ``state`` by key (factories applied in place)."""
    apply_factories(state)
    pieces: dict[str, list[ShardedTensor]] = {}
    for value in nested_values(state):
        if isinstance(value, ShardedTensor):
            pieces.setdefault(value.key, []).append(value)
    return pieces
