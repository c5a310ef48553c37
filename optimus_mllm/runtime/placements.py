"""Where the encoders train: the three placements ``Trainer`` drives, chosen by ``placement(mode)``.

- ``OptimusPlacement``: the encoder stage under the schedule artifact's own encoder plan and process
  groups, its ops at the LLM's hook points, A_i and G_i by P2P (``optimus_encoder``).
- ``BaselinePlacement``: Megatron-LM's placement, the encoders whole in the first pipeline stage's
  pre-process, tensor-parallel with the LLM.
- ``BalancedPlacement``: the paper's Megatron-LM balanced baseline (``runtime.balanced``): encoder
  and LLM layers split together into the LLM plan's virtual stages.

Each says what differs between them: which jobs it refuses, how the LLM's modules are built, where
the encoder's layers live, what a chunk's forward takes and the shape megatron-core's P2P carries.
``placement`` is the one place a mode's name is read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedStateDict
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec
from torch import nn

from optimus_mllm.config import OptimusConfig
from optimus_mllm.errors import OptimusError
from optimus_mllm.planner.plans import ParallelPlan
from optimus_mllm.runtime.balanced import (
    balanced_transformer_config,
    build_balanced_chunks,
    packed_shape,
    tied_embedding_group,
)
from optimus_mllm.runtime.data import Microbatch
from optimus_mllm.runtime.llm import (
    build_llm_chunks,
    causal_mask,
    decoder_input_with_images,
    masked_lm_loss,
    transformer_config,
)
from optimus_mllm.runtime.mode import Mode
from optimus_mllm.runtime.sharded_state import (
    LLM_PREFIX,
    encoder_sharded_state_dict,
    llm_sharded_state_dict,
    model_entries,
)
from optimus_mllm.runtime.streams import to_device
from optimus_mllm.runtime.tp_modes.groups import Grid2D, build_grids
from optimus_mllm.runtime.vit import EncoderStage
from optimus_mllm.runtime.weights import init_llm_plan_independent_
from optimus_mllm.scheduler.artifact_format import ScheduleArtifact
from optimus_mllm.scheduler.baselines import balanced_layer_ranges

ForwardOutput = tuple[torch.Tensor, Callable[..., Any]]


@dataclass(frozen=True)
class LLMParts:
    """The LLM side of a job as one placement builds it on this rank."""

    tconfig: TransformerConfig  # the config megatron-core's schedule reads
    modules: list[nn.Module]  # per virtual stage: what DDP wraps and the schedule runs
    chunks: list[nn.Module]  # the GPTModel chunks in them (TP collectives, sharded state)
    # a word embedding tied across pipeline ranks (balanced); None: megatron-core's own group
    embedding_group: dist.ProcessGroup | None = None


@dataclass(frozen=True)
class ChunkInput:
    """What one LLM op's forward step hands the placement."""

    config: OptimusConfig
    microbatch: Microbatch  # its text on the training device
    model: Any  # megatron-core's DDP around ``module``
    module: nn.Module  # the virtual stage as built (``LLMParts.modules``)
    seed: int  # the microbatch's dropout seed
    device: torch.device
    # A_i for this microbatch, called only where the chunk takes image tokens
    image_embeddings: Callable[[], torch.Tensor]


class Placement(Protocol):
    mode: Mode  # what a checkpoint records
    # the encoder stage trains under the artifact's own plan and groups, its ops at the hook points
    encoder_plan: bool

    def refuse(
        self, artifact: ScheduleArtifact | Callable[..., Any] | None, user_model: bool
    ) -> None:
        """Raise ``OptimusError`` for a job this placement does not run, before any group:
        ``artifact`` the schedule (a ``ScheduleFor`` for a model_provider's model), ``user_model``
        whether the job brings its own model."""
        ...

    def refuse_data(self, varying_images: bool) -> None:
        """Raise ``OptimusError`` for data this placement does not run."""
        ...

    def build_llm(
        self,
        config: OptimusConfig,
        llm_plan: ParallelPlan,
        encoder_layer_specs: Mapping[str, ModuleSpec] | None,
    ) -> LLMParts:
        """This project's model (collective: every rank builds its chunks)."""
        ...

    def encoder_in_llm(
        self,
        config: OptimusConfig,
        stage: int,
        encoder_layer_specs: Mapping[str, ModuleSpec] | None,
    ) -> EncoderStage | None:
        """The encoder stage at the LLM's TP beside pipeline stage ``stage``'s chunks, or None
        (collective: every rank takes part)."""
        ...

    def encoder_stages(
        self, modules: list[nn.Module], encoder: EncoderStage | None
    ) -> list[EncoderStage]:
        """This rank's encoder layers."""
        ...

    def model_state(
        self, config: OptimusConfig, modules: list[nn.Module], chunks: list[nn.Module]
    ) -> dict[str, ShardedStateDict]:
        """The LLM's modules as Megatron-LM's ``model`` / ``model<i>`` checkpoint entries."""
        ...

    def forward(self, chunk: ChunkInput) -> ForwardOutput:
        """One LLM op's forward of this project's model: its output and loss function."""
        ...

    def p2p_seq_length(
        self, config: OptimusConfig, llm_plan: ParallelPlan, tconfig: TransformerConfig
    ) -> int:
        """The ``seq_length`` megatron-core's schedule sizes its P2P tensors by."""
        ...


class _GPTPlacement:
    """The LLM as megatron-core's ``GPTModel`` chunks, the encoders apart from them."""

    def refuse_data(self, varying_images: bool) -> None:
        pass

    def build_llm(
        self,
        config: OptimusConfig,
        llm_plan: ParallelPlan,
        encoder_layer_specs: Mapping[str, ModuleSpec] | None,
    ) -> LLMParts:
        tconfig = transformer_config(config, llm_plan)
        chunks = build_llm_chunks(config, llm_plan, tconfig)
        init_llm_plan_independent_(
            chunks, config.training.seed, parallel_state.get_tensor_model_parallel_group()
        )
        return LLMParts(tconfig, list(chunks), chunks)

    def encoder_stages(
        self, modules: list[nn.Module], encoder: EncoderStage | None
    ) -> list[EncoderStage]:
        return [encoder] if encoder is not None else []

    def model_state(
        self, config: OptimusConfig, modules: list[nn.Module], chunks: list[nn.Module]
    ) -> dict[str, ShardedStateDict]:
        return llm_sharded_state_dict(chunks)

    def forward(self, chunk: ChunkInput) -> ForwardOutput:
        mb, device = chunk.microbatch, chunk.device
        mask = mb.attention_mask
        if mask is None:
            mask = causal_mask(chunk.config.llm.seq_length, device)
        decoder_input = None
        if chunk.module.pre_process:
            decoder_input = decoder_input_with_images(chunk.module, mb, chunk.image_embeddings())
        output = chunk.model(
            mb.tokens, mb.position_ids, mask, decoder_input=decoder_input, labels=mb.labels
        )
        return output, partial(masked_lm_loss, loss_mask=mb.loss_mask)

    def p2p_seq_length(
        self, config: OptimusConfig, llm_plan: ParallelPlan, tconfig: TransformerConfig
    ) -> int:
        return config.llm.seq_length


class OptimusPlacement(_GPTPlacement):
    mode: Mode = "optimus"
    encoder_plan = True

    def refuse(
        self, artifact: ScheduleArtifact | Callable[..., Any] | None, user_model: bool
    ) -> None:
        if artifact is None:
            raise OptimusError(
                "the Optimus runtime needs a schedule artifact (optimus-plan --artifact)"
            )
        if callable(artifact) != user_model:
            raise OptimusError(
                "a model_provider's model is scheduled once its model is read: pass a "
                "ScheduleFor (config -> artifact) with user_model, an artifact without"
            )

    def encoder_in_llm(
        self,
        config: OptimusConfig,
        stage: int,
        encoder_layer_specs: Mapping[str, ModuleSpec] | None,
    ) -> EncoderStage | None:
        return None  # under its own plan (``OptimusEncoder``)


class BaselinePlacement(_GPTPlacement):
    mode: Mode = "baseline"
    encoder_plan = False

    def refuse(
        self, artifact: ScheduleArtifact | Callable[..., Any] | None, user_model: bool
    ) -> None:
        pass

    def encoder_in_llm(
        self,
        config: OptimusConfig,
        stage: int,
        encoder_layer_specs: Mapping[str, ModuleSpec] | None,
    ) -> EncoderStage | None:
        """Whole in the first stage; 2d on the grid over its TP group (every rank builds every
        group's grid, collective)."""
        grid = llm_tp_grid() if config.parallel.encoder_tp_mode == "2d" else None
        if stage != 0:
            return None
        return EncoderStage(
            config,
            0,
            1,
            parallel_state.get_tensor_model_parallel_group(),
            layer_specs=encoder_layer_specs,
            tp_mode=config.parallel.encoder_tp_mode,
            grid=grid,
        )


class BalancedPlacement:
    mode: Mode = "balanced"
    encoder_plan = False

    def refuse(
        self, artifact: ScheduleArtifact | Callable[..., Any] | None, user_model: bool
    ) -> None:
        if user_model:
            raise OptimusError(
                "the balanced baseline runs this project's ViT and GPT; a model_provider's model "
                "runs under the Optimus schedule or the Megatron-style baseline"
            )

    def refuse_data(self, varying_images: bool) -> None:
        if varying_images:
            raise OptimusError(
                "the balanced baseline's pipeline buffers carry one image per sample; a "
                "webdataset's microbatches (data.path) vary in images"
            )

    def build_llm(
        self,
        config: OptimusConfig,
        llm_plan: ParallelPlan,
        encoder_layer_specs: Mapping[str, ModuleSpec] | None,
    ) -> LLMParts:
        ranges = balanced_layer_ranges(config, llm_plan)
        tconfig = balanced_transformer_config(config, llm_plan, ranges)
        embedding_group = tied_embedding_group(config, llm_plan, ranges)
        modules = build_balanced_chunks(
            config,
            llm_plan,
            tconfig,
            ranges,
            encoder_layer_specs,
            synced_copy=embedding_group is not None,
        )
        chunks = [chunk.llm for chunk in modules if chunk.llm is not None]
        init_llm_plan_independent_(
            chunks, config.training.seed, parallel_state.get_tensor_model_parallel_group()
        )
        return LLMParts(tconfig, list(modules), chunks, embedding_group)

    def encoder_in_llm(
        self,
        config: OptimusConfig,
        stage: int,
        encoder_layer_specs: Mapping[str, ModuleSpec] | None,
    ) -> EncoderStage | None:
        return None  # its layers are in the virtual stages (``encoder_stages``)

    def encoder_stages(
        self, modules: list[nn.Module], encoder: EncoderStage | None
    ) -> list[EncoderStage]:
        return [chunk.encoder_stage for chunk in modules if chunk.encoder_stage is not None]

    def model_state(
        self, config: OptimusConfig, modules: list[nn.Module], chunks: list[nn.Module]
    ) -> dict[str, ShardedStateDict]:
        """Each virtual stage's entry holds its LLM and its encoder layers alike."""
        dp_group = parallel_state.get_data_parallel_group()
        return {
            key: {
                **({} if chunk.llm is None else chunk.llm.sharded_state_dict(prefix=LLM_PREFIX)),
                **(
                    {}
                    if chunk.encoder_stage is None
                    else encoder_sharded_state_dict(config, chunk.encoder_stage, dp_group)
                ),
            }
            for key, chunk in zip(model_entries(len(modules)), modules)
        }

    def forward(self, chunk: ChunkInput) -> ForwardOutput:
        mb = chunk.microbatch
        images = to_device(mb.images[0], chunk.device) if chunk.module.first else None
        return chunk.model(mb, images, chunk.seed), partial(masked_lm_loss, loss_mask=mb.loss_mask)

    def p2p_seq_length(
        self, config: OptimusConfig, llm_plan: ParallelPlan, tconfig: TransformerConfig
    ) -> int:
        """The packed boundary buffer's, whole over TP under sequence parallelism."""
        sp = tconfig.sequence_parallel
        return packed_shape(config, llm_plan)[0] * (llm_plan.tp if sp else 1)


def llm_tp_grid() -> Grid2D | None:
    """The q x q grid over this rank's LLM TP group, every LLM TP group's built (collective).
    megatron-core's TP groups are runs of ``tp`` consecutive ranks (its default order)."""
    tp, world = parallel_state.get_tensor_model_parallel_world_size(), dist.get_world_size()
    groups = [tuple(range(first, first + tp)) for first in range(0, world, tp)]
    mine = tuple(dist.get_process_group_ranks(parallel_state.get_tensor_model_parallel_group()))
    if mine not in groups:
        raise OptimusError(
            f"the LLM's TP group {list(mine)} is not a run of consecutive ranks; a 2d encoder "
            "under --baseline needs megatron-core's default rank order"
        )
    return build_grids(groups)


def placement(mode: Mode) -> Placement:
    """The placement that ``mode`` names: the one place a mode's name is compared."""
    placements: dict[str, Placement] = {
        "optimus": OptimusPlacement(),
        "baseline": BaselinePlacement(),
        "balanced": BalancedPlacement(),
    }
    return placements[mode]
