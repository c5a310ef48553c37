"""The LLM: megatron-core ``GPTModel`` chunks for one pipeline rank, and the image-token splice.

The projected encoder output of a microbatch replaces the word embeddings at the image positions of
the first chunk on the first stage, passed in as ``decoder_input``; it is a leaf that requires grad,
so after the LLM's backward its ``.grad`` is the gradient G_i the encoder needs.

On a GPU the layers' core attention is torch's fused ``scaled_dot_product_attention`` (flash
attention; transformer-engine is optional): megatron-core's local ``DotProductAttention``
materialises the [batch * heads, seq, seq] scores. On the CPU the local spec is used unchanged.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from optimus_mllm.config import OptimusConfig
from optimus_mllm.planner.plans import ParallelPlan
from optimus_mllm.runtime.data import Microbatch
from optimus_mllm.runtime.dtypes import ACTIVATIONS, DTYPES


def unfused_settings() -> dict[str, Any]:
    """TransformerConfig settings every model here shares: the fusions that need CUDA (or apex) off,
    and
    in place of megatron-core's own cuda_graph_scope default, "full", which is deprecated and warns,
    [] (the same: the whole layer; a fresh list per config)."""
    return {
        "bias_activation_fusion": False,
        "masked_softmax_fusion": False,
        "bias_dropout_fusion": False,
        "persist_layer_norm": False,
        "apply_rope_fusion": False,
        **(
            {"cuda_graph_scope": []}
            if "cuda_graph_scope" in TransformerConfig.__dataclass_fields__
            else {}
        ),
    }


def transformer_config(
    config: OptimusConfig, plan: ParallelPlan, layout: list[list[str]] | None = None
) -> TransformerConfig:
    """megatron-core's config for the LLM under ``plan``, with fusions that need CUDA turned off;
    ``layout``: megatron-core's ``pipeline_model_parallel_layout`` (LLM layers per virtual stage),
    else even stages."""
    llm, t = config.llm, config.training
    dtype = DTYPES[t.precision]
    return TransformerConfig(
        num_layers=llm.num_layers,
        hidden_size=llm.hidden_size,
        num_attention_heads=llm.num_attention_heads,
        ffn_hidden_size=llm.ffn_hidden_size,
        kv_channels=llm.head_dim,
        num_query_groups=llm.query_groups,
        gated_linear_unit=llm.gated_linear_unit,
        add_bias_linear=llm.add_bias_linear,
        normalization=llm.normalization,
        activation_func=ACTIVATIONS[llm.activation],
        tensor_model_parallel_size=plan.tp,
        pipeline_model_parallel_size=plan.pp,
        virtual_pipeline_model_parallel_size=plan.vp if plan.vp > 1 else None,
        pipeline_model_parallel_layout=layout,
        sequence_parallel=t.sequence_parallel and plan.tp > 1,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=t.precision == "bf16",
        fp16=t.precision == "fp16",
        hidden_dropout=llm.hidden_dropout,
        attention_dropout=llm.attention_dropout,
        use_cpu_initialization=not torch.cuda.is_available(),
        **unfused_settings(),
        # megatron-core pairs interleaved PP=2 sends wrongly when batched (NVIDIA/Megatron-LM#750)
        batch_p2p_comm=False,
        # Megatron-LM's --recompute-granularity; full recomputes every layer (--recompute-method
        # uniform, --recompute-num-layers 1), as the memory model assumes
        recompute_granularity=None if t.recompute == "none" else t.recompute,
        **(
            {"recompute_method": "uniform", "recompute_num_layers": 1}
            if t.recompute == "full"
            else {}
        ),
    )


def build_llm_chunks(
    config: OptimusConfig, plan: ParallelPlan, tconfig: TransformerConfig
) -> list[GPTModel]:
    """This rank's model chunks (one per virtual stage); needs megatron's parallel_state
    initialised."""
    layers = config.llm.num_layers // (plan.pp * plan.vp)
    return [
        gpt_chunk(config, plan, tconfig, layers, pre, post, vp_stage)
        for vp_stage, (pre, post) in enumerate(pre_post_process(plan))
    ]


def gpt_chunk(
    config: OptimusConfig,
    plan: ParallelPlan,
    tconfig: TransformerConfig,
    layers: int,
    pre_process: bool,
    post_process: bool,
    vp_stage: int,
    pg_collection: ProcessGroupCollection | None = None,
) -> GPTModel:
    """One model chunk of ``layers`` LLM layers; megatron-core numbers them from ``tconfig`` and
    ``vp_stage``.
    ``pg_collection``: its process groups, by default megatron-core's ``parallel_state``."""
    llm = config.llm
    return GPTModel(
        config=tconfig,
        transformer_layer_spec=decoder_spec(tconfig, layers),
        vocab_size=llm.vocab_size,
        max_sequence_length=llm.seq_length,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=not llm.untie_embeddings_and_output_weights,
        # the image tokens are spliced into the whole sequence first (decoder_input_with_images)
        scatter_embedding_sequence_parallel=False,
        position_embedding_type=llm.position_embedding_type,
        pg_collection=pg_collection,
        **({"vp_stage": vp_stage} if plan.vp > 1 else {}),
    )


def llm_pipelines() -> list[tuple[int, ...]]:
    """Every LLM pipeline's ranks as megatron-core's ``parallel_state`` set them up, the same sorted
    list on
    every rank (for groups that every rank must create in one order). Collective."""
    gathered: list[list[int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(
        gathered, dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())
    )
    return sorted({tuple(ranks) for ranks in gathered})


def pre_post_process(plan: ParallelPlan) -> list[tuple[bool, bool]]:
    """(pre_process, post_process) of this rank's chunk per virtual stage, from megatron's
    parallel_state."""
    flags = []
    for vp_stage in range(plan.vp):
        kwargs = {"vp_stage": vp_stage} if plan.vp > 1 else {}
        flags.append(
            (
                parallel_state.is_pipeline_first_stage(ignore_virtual=False, **kwargs),
                parallel_state.is_pipeline_last_stage(ignore_virtual=False, **kwargs),
            )
        )
    return flags


def decoder_spec(tconfig: TransformerConfig, layers: int) -> TransformerBlockSubmodules:
    """One chunk's ``layers`` layers of ``layer_spec`` and its final norm. Without apex,
    megatron-core's
    local spec has torch norms that refuse sequence parallelism; ``SequenceParallelTorchNorm`` takes
    their place then."""
    spec = layer_spec()
    norm = spec.submodules.input_layernorm
    if tconfig.sequence_parallel and norm is WrappedTorchNorm:
        norm = SequenceParallelTorchNorm
        spec = replace(
            spec, submodules=replace(spec.submodules, input_layernorm=norm, pre_mlp_layernorm=norm)
        )
    return TransformerBlockSubmodules(layer_specs=[spec] * layers, layer_norm=norm)


def layer_spec() -> ModuleSpec:
    """megatron-core's local GPT layer; on a GPU with ``SdpaCoreAttention`` as its core
    attention."""
    spec = get_gpt_layer_local_spec()
    if not torch.cuda.is_available():
        return spec
    attention = spec.submodules.self_attention
    attention = replace(
        attention, submodules=replace(attention.submodules, core_attention=SdpaCoreAttention)
    )
    return replace(spec, submodules=replace(spec.submodules, self_attention=attention))


class SequenceParallelTorchNorm:
    """megatron-core's ``WrappedTorchNorm`` (a torch LayerNorm / RMSNorm) for a sequence-parallel
    LLM.

    Under sequence parallelism a norm sees only its TP rank's tokens, so its gradient is partial;
    megatron-core sums gradients over TP for parameters marked ``sequence_parallel``
    (``finalize_model_grads``), as apex's and transformer-engine's norms are. ``WrappedTorchNorm``
    does not mark its parameters and so refuses sequence parallelism; this marks them."""

    def __new__(
        cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_: Any
    ) -> torch.nn.Module:
        norm_class = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}[
            config.normalization
        ]
        norm = norm_class(normalized_shape=hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


class SdpaCoreAttention(MegatronModule):
    """Causal softmax attention of one TP rank's heads by torch's fused SDPA; megatron-core's
    ``DotProductAttention`` interface (query [s, b, heads, d], key/value [s, b, groups, d]). For
    ``causal_mask``'s tensor ``is_causal`` stands in for the mask; another mask (packed samples)
    is passed to SDPA."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        **kwargs: Any,
    ):
        super().__init__(config=config)
        self.softmax_scale = softmax_scale
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError(
                "SdpaCoreAttention takes neither an attention bias nor packed sequences; the "
                "Optimus "
                "runtime passes neither"
            )
        s, b, heads, _ = query.shape
        per_group = heads // key.shape[2]
        if per_group > 1:
            key, value = (
                key.repeat_interleave(per_group, dim=2),
                value.repeat_interleave(per_group, dim=2),
            )
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, heads, s, d]
        p = self.dropout if self.training else 0.0
        # a TP rank's heads draw from the tracker's model-parallel state, as in megatron-core's
        # attention (under sequence parallelism the whole block already runs in it)
        fork = p > 0 and not self.config.sequence_parallel
        # causal_mask's tensor: the fused causal kernel; packed samples: their mask (True = masked)
        causal = attention_mask is None or is_causal_mask(attention_mask)
        with tensor_parallel.get_cuda_rng_tracker().fork() if fork else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=None if causal else ~attention_mask,
                dropout_p=p,
                is_causal=causal,
                scale=self.softmax_scale,
            )
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


def causal_mask(seq_length: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Megatron's boolean mask (True = masked); built here because its default lives on CUDA. One
    tensor per length and device, which ``SdpaCoreAttention`` recognises as plain causal."""
    return _causal_mask(seq_length, torch.device(device))


@functools.lru_cache(maxsize=8)
def _causal_mask(seq_length: int, device: torch.device) -> torch.Tensor:
    return torch.triu(
        torch.ones(1, 1, seq_length, seq_length, dtype=torch.bool, device=device), diagonal=1
    )


def is_causal_mask(mask: torch.Tensor) -> bool:
    """Whether ``mask`` is ``causal_mask``'s, not (say) packed samples' block-diagonal one."""
    return mask is _causal_mask(mask.shape[-1], mask.device)


def decoder_input_with_images(
    chunk: GPTModel, mb: Microbatch, image_embeddings: torch.Tensor
) -> torch.Tensor:
    """Word (+ position) embeddings with the image positions replaced by the image embeddings
    ``[image_tokens, images, hidden]`` (``mb.image_mask``'s positions, else each sample's first
    ones, one image per sample): the decoder input ``[seq, batch, hidden]``, or this TP rank's
    ``[seq / TP, batch, hidden]`` under sequence parallelism, scattered after the splice as
    megatron-core's LLaVA does (the chunks are built with
    ``scatter_embedding_sequence_parallel=False``, so the embedding's TP reduction is an
    all-reduce)."""
    embeddings = chunk.embedding(input_ids=mb.tokens, position_ids=mb.position_ids)
    images = image_embeddings.to(embeddings.dtype)
    if mb.image_mask is None:  # each sample's one image first
        combined = torch.cat([images, embeddings[images.shape[0] :]], dim=0)
    else:  # the images in row-major order of their positions, each image's tokens consecutive
        rows, positions = mb.image_mask.nonzero(as_tuple=True)
        flat = images.transpose(0, 1).reshape(-1, images.shape[-1])
        combined = embeddings.index_put((positions, rows), flat)
    if chunk.config.sequence_parallel:
        combined = tensor_parallel.scatter_to_sequence_parallel_region(combined)
    return combined


def masked_lm_loss(
    per_token: torch.Tensor, loss_mask: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mean next-token loss over text positions (megatron divides it by the microbatch count)."""
    loss = (per_token.float() * loss_mask).sum() / loss_mask.sum()
    return loss, {"lm loss": loss.detach().clone()}
