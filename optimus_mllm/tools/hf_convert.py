"""Hugging Face-style GPT-2 and ViT weights as a checkpoint of this project's model (LLaVA's keys).

``optimus-convert`` (``cli/convert.py``) writes the result as a megatron-core dist checkpoint that
``optimus-train --pretrained-checkpoint`` / ``--pretrained-llm`` / ``--pretrained-encoder`` load
into any plan. The mapping is of names and layouts only:

- GPT-2 (``GPT2LMHeadModel``: ``transformer.wte``, ``transformer.h.<i>.attn.c_attn`` ...). Its
  ``Conv1D`` weights are stored [in, out] and are transposed; ``c_attn`` holds [Q; K; V] for all
  heads, which megatron-core's ``linear_qkv`` holds per head ([q; k; v] of head 0, then head 1 ...).
  ``lm_head`` becomes the output layer when the config unties the embeddings.
- ViT (``ViTModel``: ``embeddings.patch_embeddings.projection`` ...). The Conv2d patch embedding
  becomes megatron-core ``CLIPViTModel``'s ``conv1``; the class token (``cls_token``, first in
  ViT's sequence as in ``CLIPViTModel``'s) becomes ``class_token`` when the encoder has one
  (``class_token: true``) and is dropped with its position embedding otherwise; the final
  ``layernorm`` is dropped (this encoder has none). Separate ``query`` / ``key`` /
  ``value`` weights are interleaved per head as above. A LLaVA ``multi_modal_projector.linear_1`` /
  ``linear_2`` in the same state dict becomes the projector; without one the projector starts from
  scratch.

Activations are not converted: GPT-2's tanh GELU and megatron-core's exact GELU differ slightly.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from optimus_mllm.config import EncoderConfig, LLMConfig
from optimus_mllm.errors import OptimusError

Tensor = torch.Tensor
# a whole tensor of the checkpoint: (its key, its data, (layer, num_layers) for a layer's slice of a
# tensor stacked over layers, as megatron-core's TransformerBlock saves them, else None)
Entry = tuple[str, Tensor, "tuple[int, int] | None"]


def _take(state: Mapping[str, Tensor], key: str, source: str) -> Tensor:
    if key not in state:
        raise OptimusError(f"{source}: no tensor {key!r}; give a Hugging Face {source} state dict")
    return state[key].float()


def _per_head(q: Tensor, k: Tensor, v: Tensor, heads: int) -> Tensor:
    """[q; k; v] per head, megatron-core's QKV layout (one query group per head), along dim 0."""
    parts = [x.reshape(heads, x.shape[0] // heads, *x.shape[1:]) for x in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(-1, *q.shape[1:])


def _check_layers(spec: LLMConfig | EncoderConfig, where: str) -> None:
    """GPT-2's and ViT's layers: one key and value per head, LayerNorm, biases, a plain GELU MLP."""
    wanted = {
        "num_query_groups": (spec.query_groups, spec.num_attention_heads),
        "normalization": (spec.normalization, "LayerNorm"),
        "add_bias_linear": (spec.add_bias_linear, True),
        "gated_linear_unit": (spec.gated_linear_unit, False),
        "activation": (spec.activation, "gelu"),
    }
    for field, (value, theirs) in wanted.items():
        if value != theirs:
            raise OptimusError(
                f"{where}.{field} is {value}; Hugging Face GPT-2 and ViT layers have {theirs}"
            )


def gpt2_entries(state: Mapping[str, Tensor], llm: LLMConfig) -> list[Entry]:
    """The LLM's tensors from a GPT-2 state dict (keys with or without the ``transformer.``
    prefix)."""
    _check_layers(llm, "model.llm")
    source = "GPT-2"
    state = {key.removeprefix("transformer."): value for key, value in state.items()}
    out = "language_model."
    entries: list[Entry] = [
        (f"{out}embedding.word_embeddings.weight", _take(state, "wte.weight", source), None)
    ]
    if llm.position_embedding_type == "learned_absolute":
        positions = _take(state, "wpe.weight", source)
        if positions.shape[0] < llm.seq_length:
            raise OptimusError(
                f"GPT-2: {positions.shape[0]} positions, model.llm.seq_length is {llm.seq_length}"
            )
        entries.append(
            (f"{out}embedding.position_embeddings.weight", positions[: llm.seq_length], None)
        )
    for i in range(llm.num_layers):
        h, layer = f"h.{i}.", (i, llm.num_layers)
        qkv_w = _take(state, f"{h}attn.c_attn.weight", source).t()
        qkv_b = _take(state, f"{h}attn.c_attn.bias", source)
        entries += [
            (
                f"{out}decoder.layers.self_attention.linear_qkv.layer_norm_weight",
                _take(state, f"{h}ln_1.weight", source),
                layer,
            ),
            (
                f"{out}decoder.layers.self_attention.linear_qkv.layer_norm_bias",
                _take(state, f"{h}ln_1.bias", source),
                layer,
            ),
            (
                f"{out}decoder.layers.self_attention.linear_qkv.weight",
                _per_head(*qkv_w.chunk(3, dim=0), llm.num_attention_heads),
                layer,
            ),
            (
                f"{out}decoder.layers.self_attention.linear_qkv.bias",
                _per_head(*qkv_b.chunk(3, dim=0), llm.num_attention_heads),
                layer,
            ),
            (
                f"{out}decoder.layers.self_attention.linear_proj.weight",
                _take(state, f"{h}attn.c_proj.weight", source).t(),
                layer,
            ),
            (
                f"{out}decoder.layers.self_attention.linear_proj.bias",
                _take(state, f"{h}attn.c_proj.bias", source),
                layer,
            ),
            (
                f"{out}decoder.layers.mlp.linear_fc1.layer_norm_weight",
                _take(state, f"{h}ln_2.weight", source),
                layer,
            ),
            (
                f"{out}decoder.layers.mlp.linear_fc1.layer_norm_bias",
                _take(state, f"{h}ln_2.bias", source),
                layer,
            ),
            (
                f"{out}decoder.layers.mlp.linear_fc1.weight",
                _take(state, f"{h}mlp.c_fc.weight", source).t(),
                layer,
            ),
            (
                f"{out}decoder.layers.mlp.linear_fc1.bias",
                _take(state, f"{h}mlp.c_fc.bias", source),
                layer,
            ),
            (
                f"{out}decoder.layers.mlp.linear_fc2.weight",
                _take(state, f"{h}mlp.c_proj.weight", source).t(),
                layer,
            ),
            (
                f"{out}decoder.layers.mlp.linear_fc2.bias",
                _take(state, f"{h}mlp.c_proj.bias", source),
                layer,
            ),
        ]
    entries += [
        (f"{out}decoder.final_layernorm.weight", _take(state, "ln_f.weight", source), None),
        (f"{out}decoder.final_layernorm.bias", _take(state, "ln_f.bias", source), None),
    ]
    if llm.untie_embeddings_and_output_weights:
        head = state.get("lm_head.weight", state["wte.weight"])  # GPT-2 ties them: the embedding
        entries.append((f"{out}output_layer.weight", head.float(), None))
    return entries


def vit_entries(state: Mapping[str, Tensor], encoder: EncoderConfig, prefix: str) -> list[Entry]:
    """An encoder's tensors from a ViT state dict (keys with or without the ``vit.`` prefix), and
    its projector's from LLaVA's ``multi_modal_projector`` when present; ``prefix``: the encoder's
    key prefix (``sharded_state.encoder_prefix``)."""
    _check_layers(encoder, f"model.encoders[{encoder.name}]")
    if encoder.model_subtype != "internvit":  # a biased patch conv and no norm before the layers
        raise OptimusError(
            f"model.encoders[{encoder.name}].model_subtype is {encoder.model_subtype}; Hugging "
            "Face "
            "ViT's embedding is internvit's"
        )
    source = "ViT"
    state = {key.removeprefix("vit."): value for key, value in state.items()}
    out = f"{prefix}vision_model."
    conv = _take(state, "embeddings.patch_embeddings.projection.weight", source)
    position = _take(state, "embeddings.position_embeddings", source).reshape(
        -1, encoder.hidden_size
    )
    if position.shape[0] != encoder.seq_length + 1:
        raise OptimusError(
            f"ViT: {position.shape[0] - 1} patch positions, "
            f"model.encoders[{encoder.name}].seq_length "
            f"is {encoder.seq_length}"
        )
    entries: list[Entry] = [  # megatron-core CLIPViTModel's names
        (f"{out}conv1.weight", conv, None),
        (
            f"{out}conv1.bias",
            _take(state, "embeddings.patch_embeddings.projection.bias", source),
            None,
        ),
    ]
    if encoder.class_token:
        entries += [
            (
                f"{out}class_token",
                _take(state, "embeddings.cls_token", source).reshape(1, 1, -1),
                None,
            ),
            (f"{out}position_embeddings.weight", position, None),
        ]
    else:  # without the class token's position
        entries.append((f"{out}position_embeddings.weight", position[1:], None))
    heads = encoder.num_attention_heads
    for i in range(encoder.num_layers):
        h, layer, a = (
            f"encoder.layer.{i}.",
            (i, encoder.num_layers),
            f"encoder.layer.{i}.attention.",
        )
        q, k, v = (
            _take(state, f"{a}attention.{name}.weight", source)
            for name in ("query", "key", "value")
        )
        qb, kb, vb = (
            _take(state, f"{a}attention.{name}.bias", source) for name in ("query", "key", "value")
        )
        entries += [
            (
                f"{out}decoder.layers.self_attention.linear_qkv.layer_norm_weight",
                _take(state, f"{h}layernorm_before.weight", source),
                layer,
            ),
            (
                f"{out}decoder.layers.self_attention.linear_qkv.layer_norm_bias",
                _take(state, f"{h}layernorm_before.bias", source),
                layer,
            ),
            (
                f"{out}decoder.layers.self_attention.linear_qkv.weight",
                _per_head(q, k, v, heads),
                layer,
            ),
            (
                f"{out}decoder.layers.self_attention.linear_qkv.bias",
                _per_head(qb, kb, vb, heads),
                layer,
            ),
            (
                f"{out}decoder.layers.self_attention.linear_proj.weight",
                _take(state, f"{a}output.dense.weight", source),
                layer,
            ),
            (
                f"{out}decoder.layers.self_attention.linear_proj.bias",
                _take(state, f"{a}output.dense.bias", source),
                layer,
            ),
            (
                f"{out}decoder.layers.mlp.linear_fc1.layer_norm_weight",
                _take(state, f"{h}layernorm_after.weight", source),
                layer,
            ),
            (
                f"{out}decoder.layers.mlp.linear_fc1.layer_norm_bias",
                _take(state, f"{h}layernorm_after.bias", source),
                layer,
            ),
            (
                f"{out}decoder.layers.mlp.linear_fc1.weight",
                _take(state, f"{h}intermediate.dense.weight", source),
                layer,
            ),
            (
                f"{out}decoder.layers.mlp.linear_fc1.bias",
                _take(state, f"{h}intermediate.dense.bias", source),
                layer,
            ),
            (
                f"{out}decoder.layers.mlp.linear_fc2.weight",
                _take(state, f"{h}output.dense.weight", source),
                layer,
            ),
            (
                f"{out}decoder.layers.mlp.linear_fc2.bias",
                _take(state, f"{h}output.dense.bias", source),
                layer,
            ),
        ]
    if "multi_modal_projector.linear_1.weight" in state:
        if encoder.projector.spatial_merge != 1:
            raise OptimusError(
                "ViT: LLaVA's projector merges no tokens, "
                f"model.encoders[{encoder.name}].projector."
                f"spatial_merge is {encoder.projector.spatial_merge}; set it to 1, or drop "
                "multi_modal_projector from the checkpoint to train a new projector"
            )
        if encoder.projector.type != "mlp":
            raise OptimusError(
                f"ViT: LLaVA's projector is an MLP, model.encoders[{encoder.name}].projector.type "
                "is "
                f"{encoder.projector.type}"
            )
        mlp = encoder.projector
        if (mlp.activation, mlp.gated_linear_unit, mlp.add_bias_linear) != ("gelu", False, True):
            raise OptimusError(
                "ViT: LLaVA's projector is a GELU MLP with biases, "
                f"model.encoders[{encoder.name}].projector is {mlp.activation}"
                f"{', gated' if mlp.gated_linear_unit else ''}"
                f"{'' if mlp.add_bias_linear else ', without biases'}; drop multi_modal_projector "
                "from the checkpoint to train a new projector"
            )
        projector = f"{prefix}vision_projection.encoder."
        for ours, theirs in (("linear_fc1", "linear_1"), ("linear_fc2", "linear_2")):
            for kind in ("weight", "bias"):
                entries.append(
                    (
                        f"{projector}{ours}.{kind}",
                        _take(state, f"multi_modal_projector.{theirs}.{kind}", source),
                        None,
                    )
                )
    return entries


def save_dist_checkpoint(entries: list[Entry], folder: str) -> None:
    """Write whole tensors as a megatron-core dist checkpoint (this process alone must be the
    group)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from megatron_patches.checkpoint import synchronous_writer

    state = {}
    for key, data, layer in entries:
        if layer is None:
            state[key] = ShardedTensor.from_rank_offsets(key, data.contiguous(), replica_id=0)
        else:  # this layer's slice of the tensor stacked over layers
            index, num_layers = layer
            state[f"{key}.{index}"] = ShardedTensor.from_rank_offsets(
                key, data.contiguous(), (0, index, num_layers), replica_id=0, prepend_axis_num=1
            )
    with synchronous_writer():
        dist_checkpointing.save({"model": state}, folder)
