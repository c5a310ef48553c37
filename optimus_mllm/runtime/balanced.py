"""The paper's Megatron-LM balanced baseline as a runtime: encoder and LLM layers form one sequence,
split into V*PP contiguous virtual stages, run by megatron-core's own interleaved 1F1B schedule.

The split (``scheduler.baselines.balanced_layer_ranges``, given to each function here) is the one
``megatron_lm_balanced_baseline`` simulates (Appendix B's dynamic program over the cost model's
layer times), so the runtime runs the plan the benchmark prices. A virtual stage is a
``BalancedChunk``: its encoder layers (an ``EncoderStage`` over a layer range, at the LLM's TP, with
the patch embedding if it holds the first layer and the projector if it holds the last) and its LLM
layers (a megatron-core ``GPTModel`` that a ``pipeline_model_parallel_layout`` gives its global
layer numbers; the word embedding with the first LLM layer, the output layer with the last). A word
embedding tied to the output layer thus lives on whichever pipeline ranks the split gives them, not
megatron-core's first and last: its two copies' gradients are summed over a group of those two ranks
(``tied_embedding_group``).

A stage boundary carries encoder hidden states, image embeddings or LLM hidden states, while
megatron-core's schedule sends one tensor shape: each boundary tensor travels packed flat into a
buffer of the largest one's size (``packed_shape``), the padding costing P2P bytes only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec

from optimus_mllm.config import OptimusConfig
from optimus_mllm.planner.plans import ParallelPlan
from optimus_mllm.runtime.data import Microbatch
from optimus_mllm.runtime.llm import (
    causal_mask,
    decoder_input_with_images,
    gpt_chunk,
    llm_pipelines,
    transformer_config,
)
from optimus_mllm.runtime.vit import EncoderStage
from optimus_mllm.scheduler.baselines import embedding_stage

Range = tuple[int, int]
Shape = tuple[int, int, int]


def split_ranges(
    ranges: tuple[Range, ...], encoder_layers: int
) -> list[tuple[Range | None, Range | None]]:
    """Per virtual stage: its encoder layers and its LLM layers (LLM numbering), None where it has
    none."""
    parts = []
    for lo, hi in ranges:
        encoder = (lo, min(hi, encoder_layers)) if lo < encoder_layers else None
        llm = (
            (max(lo, encoder_layers) - encoder_layers, hi - encoder_layers)
            if hi > encoder_layers
            else None
        )
        parts.append((encoder, llm))
    return parts


def llm_layout(
    parts: list[tuple[Range | None, Range | None]], num_llm_layers: int
) -> list[list[str]]:
    """megatron-core's ``pipeline_model_parallel_layout``: each virtual stage's LLM layers, the
    embedding
    before the first and the loss after the last."""
    layout = []
    for _, llm in parts:
        entries = [] if llm is None else ["decoder"] * (llm[1] - llm[0])
        if llm is not None and llm[0] == 0:
            entries.insert(0, "embedding")
        if llm is not None and llm[1] == num_llm_layers:
            entries.append("loss")
        layout.append(entries)
    return layout


def boundary_shapes(config: OptimusConfig, plan: ParallelPlan) -> tuple[Shape, Shape, Shape]:
    """What crosses a stage boundary, on one TP rank: the encoder's hidden states (its tokens under
    sequence parallelism), the image embeddings (whole on every rank) and the LLM's hidden
    states."""
    enc, llm, b = config.encoders[0], config.llm, config.training.micro_batch_size
    shard = plan.tp if config.training.sequence_parallel and plan.tp > 1 else 1
    return (
        (enc.layer_tokens // shard, b, enc.hidden_size),
        (enc.image_tokens, b, llm.hidden_size),
        (llm.seq_length // shard, b, llm.hidden_size),
    )


def packed_shape(config: OptimusConfig, plan: ParallelPlan) -> Shape:
    """The one [sequence, batch, LLM hidden] shape every boundary tensor travels in, with room for
    the largest. Its sequence length, times TP under sequence parallelism, is what megatron-core's
    schedule takes as ``seq_length``."""
    b, hidden = config.training.micro_batch_size, config.llm.hidden_size
    largest = max(math.prod(shape) for shape in boundary_shapes(config, plan))
    return math.ceil(largest / (b * hidden)), b, hidden


def pack(x: torch.Tensor, shape: Shape) -> torch.Tensor:
    flat = x.reshape(-1)
    return torch.cat([flat, flat.new_zeros(math.prod(shape) - flat.numel())]).view(shape)


def unpack(buffer: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    return buffer.reshape(-1)[: math.prod(shape)].view(shape)


class BalancedChunk(MegatronModule):
    """One virtual stage: encoder layers, then LLM layers, either possibly absent."""

    def __init__(
        self,
        config: OptimusConfig,
        plan: ParallelPlan,
        tconfig: TransformerConfig,
        encoder: EncoderStage | None,
        llm: GPTModel | None,
        first: bool,
        last: bool,
    ):
        super().__init__(config=tconfig)  # megatron-core's schedule reads the first chunk's config
        self.model_type = ModelType.encoder_or_decoder  # and its model type: one stack
        self.encoder_stage, self.llm = encoder, llm
        self.first, self.last = first, last  # the whole pipeline's first and last virtual stage
        # what megatron-core's finalize_model_grads asks of a rank's first or last chunk: whether
        # the rank holds a copy of a word embedding tied across pipeline ranks
        # (build_balanced_chunks), and which
        self.pre_process, self.share_embeddings_and_output_weights = first, False
        self._tied_copy: list[
            torch.nn.Parameter
        ] = []  # a list: not registered as this module's parameter
        self.shape = packed_shape(config, plan)
        self.encoder_name = config.encoders[0].name
        # what arrives packed: encoder hidden states, the projected image embeddings, or LLM hidden
        # states
        encoder_hidden, images, llm_hidden = boundary_shapes(config, plan)
        self.input_shape = (
            encoder_hidden if encoder is not None else images if llm.pre_process else llm_hidden
        )
        self.input_tensor: torch.Tensor | None = None

    def shared_embedding_or_output_weight(self) -> torch.nn.Parameter:
        """This rank's copy of the tied word embedding, whichever of its chunks holds it."""
        return self._tied_copy[0]

    def set_input_tensor(self, input_tensor: Any) -> None:
        """megatron-core's schedule hands the received boundary tensor (a one-element list) here."""
        self.input_tensor = input_tensor[0] if isinstance(input_tensor, list) else input_tensor

    def forward(self, mb: Microbatch, images: torch.Tensor | None, seed: int) -> torch.Tensor:
        """The first virtual stage takes ``images`` (the encoder's patches), the others the received
        buffer; the last returns the LLM's per-token loss, the others the packed boundary tensor."""
        x = images if self.first else unpack(self.input_tensor, self.input_shape)
        if self.encoder_stage is not None:
            x = self.encoder_stage({self.encoder_name: x}, seed)[self.encoder_name]
        if self.llm is not None:
            mask = causal_mask(mb.tokens.shape[1], mb.tokens.device)
            if self.llm.pre_process:
                x = self.llm(
                    mb.tokens,
                    mb.position_ids,
                    mask,
                    decoder_input=decoder_input_with_images(self.llm, mb, x),
                    labels=mb.labels,
                )
            else:
                self.llm.set_input_tensor(x)
                x = self.llm(mb.tokens, mb.position_ids, mask, labels=mb.labels)
        return x if self.last else pack(x, self.shape)


def balanced_transformer_config(
    config: OptimusConfig, plan: ParallelPlan, ranges: tuple[Range, ...]
) -> TransformerConfig:
    """The LLM's megatron-core config with the balanced split's layout."""
    parts = split_ranges(ranges, config.encoders[0].num_layers)
    return transformer_config(config, plan, llm_layout(parts, config.llm.num_layers))


def tied_across_pipeline(config: OptimusConfig, plan: ParallelPlan) -> bool:
    """A word embedding tied to the output layer, with several pipeline ranks: megatron-core's
    GPTModel would
    then initialise the output layer's copy over its own first/last-rank group, which the balanced
    split does not keep to (``build_balanced_chunks`` leaves that group out)."""
    return not config.llm.untie_embeddings_and_output_weights and plan.pp > 1


def tied_embedding_group(
    config: OptimusConfig, plan: ParallelPlan, ranges: tuple[Range, ...]
) -> dist.ProcessGroup | None:
    """The group that sums the gradients of a word embedding tied across pipeline ranks: per LLM
    pipeline,
    the ranks holding the balanced split's first LLM layer and its output layer, in megatron-core's
    place for the first and last pipeline ranks. None on a rank that holds no copy, or when no
    embedding is tied across ranks. Collective."""
    if not tied_across_pipeline(config, plan):
        return None
    first_stage = embedding_stage(ranges, config.encoders[0].num_layers)
    # one chunk holds the embedding and the output layer: one parameter
    if first_stage == len(ranges) - 1:
        return None
    first = first_stage % plan.pp
    mine = None
    for ranks in llm_pipelines():
        holders = [ranks[first], ranks[-1]]
        group = dist.new_group(holders)  # every rank creates every group, in one order
        mine = group if dist.get_rank() in holders else mine
    return mine


def build_balanced_chunks(
    config: OptimusConfig,
    plan: ParallelPlan,
    tconfig: TransformerConfig,
    ranges: tuple[Range, ...],
    layer_specs: Mapping[str, ModuleSpec] | None = None,
    synced_copy: bool = False,
) -> list[BalancedChunk]:
    """This pipeline rank's virtual stages; needs megatron's parallel_state initialised. Under
    ``tied_across_pipeline`` the GPTModels are built without megatron-core's embedding group (the
    copies are drawn alike anyway, ``init_llm_plan_independent_``); ``synced_copy``: this rank holds
    a copy of the word embedding that ``tied_embedding_group`` keeps in sync, and says so to
    ``finalize_model_grads``."""
    enc, llm_layers = config.encoders[0], config.llm.num_layers
    parts = split_ranges(ranges, enc.num_layers)
    stage = parallel_state.get_pipeline_model_parallel_rank()
    tp_group = parallel_state.get_tensor_model_parallel_group()
    groups = None
    if tied_across_pipeline(config, plan):
        groups = ProcessGroupCollection.use_mpu_process_groups()
        groups.embd = None
    chunks = []
    for vp_stage in range(plan.vp):
        v = vp_stage * plan.pp + stage
        encoder_layers, llm = parts[v]
        encoder = (
            None
            if encoder_layers is None
            else EncoderStage(
                config, 0, 1, tp_group, layer_specs=layer_specs, layers={enc.name: encoder_layers}
            )
        )
        gpt = (
            None
            if llm is None
            else gpt_chunk(
                config,
                plan,
                tconfig,
                llm[1] - llm[0],
                llm[0] == 0,
                llm[1] == llm_layers,
                vp_stage,
                groups,
            )
        )
        chunks.append(
            BalancedChunk(config, plan, tconfig, encoder, gpt, v == 0, v == len(parts) - 1)
        )
    copies = [
        c.llm.shared_embedding_or_output_weight()
        for c in chunks
        if synced_copy and c.llm is not None and (c.llm.pre_process or c.llm.post_process)
    ]
    for copy in copies:
        # a DDP bucket of its own, so that the distributed optimizer shards both copies alike over
        # DP and their sum over the group adds reduced shards (megatron-core marks only a
        # first-stage embedding so)
        copy.shared_embedding = True
    for chunk in chunks:
        chunk.share_embeddings_and_output_weights, chunk._tied_copy = bool(copies), copies
    return chunks
