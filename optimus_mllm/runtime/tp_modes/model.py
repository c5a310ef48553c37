"""A whole model in one TP mode (1d, 2d, 3d, metp), trainable by megatron-core's DDP and optimizer
(issues 36 and 37, acceptance 1).

``TPModeModel`` is a linear input projection (a patch or feature embedding), megatron-core's
``TransformerBlock`` of the mode's layers and final norm, and a linear per-token classification
head with its cross-entropy. The block's layers are megatron-core's local GPT layer (1d), the 2D
and 3D layers (``layers_2d``, ``layers_3d``) or METP's (``runtime.metp``), causal in every mode.

What a rank holds of the ``[s, b, h]`` residual stream (``TokenLayout``):

- 1d: all of it (megatron-core's TP without sequence parallelism);
- 2d, grid (i, j): samples block i of q (along b), hidden block j of q;
- 3d, cube (i, j, l): samples block i*p + j of p^2, hidden block l of p (direction y);
- metp, rank r: positions block r of p (along s), the whole hidden.

The projection and the head are replicated: every rank holds them whole (the papers partition the
transformer layers; an embedding or output layer partitioned their way is not built). In 1d every
rank computes every token, so their gradients are whole and alike on every rank, megatron-core's
convention. In the other modes a rank computes only its tokens and, in 2d and 3d, only its hidden
block of the projection's output and of the head's input (the head's partial logits are then
summed over the ranks holding the other hidden blocks, each keeping a slice of the sequence): its
gradients are partial sums. They are marked ``sequence_parallel``, and megatron-core's
``finalize_model_grads`` sums them over the TP group, as it sums the norms' under sequence
parallelism. Such a model's config therefore has ``sequence_parallel`` and the mode's total degree
as ``tensor_model_parallel_size``; its DDP, optimizer and ``finalize_model_grads`` take the mode's
whole group as their TP group (``training_process_groups``).

Gradient norm. megatron-core counts a parameter marked ``tensor_model_parallel`` on every rank and
any other on TP rank 0 only. The 2D and 3D layers mark each of their blocks (``params``), held by
one rank each: weights, and vectors hosted on row 0 or on the cube's diagonal, which the other
ranks do not hold at all. That is no trouble for DDP: its buffers are per rank and its
data-parallel reduction runs between replicas of one grid or cube position, which hold the same
parameters. The replicated parameters, alike on every rank once summed, count once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.enums import ModelType
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import reduce_scatter_to_sequence_parallel_region
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlock,
    TransformerBlockSubmodules,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from optimus_mllm.config import TPMode
from optimus_mllm.errors import ConfigError
from optimus_mllm.runtime.llm import SequenceParallelTorchNorm
from optimus_mllm.runtime.metp import metp_layer_spec
from optimus_mllm.runtime.tp_modes.groups import Cube3D, Grid2D
from optimus_mllm.runtime.tp_modes.layers_2d import LayerNorm2D, get_2d_layer_spec
from optimus_mllm.runtime.tp_modes.layers_3d import LayerNorm3D, get_3d_layer_spec


@dataclass(frozen=True)
class TPModeGroups:
    """The groups of a model in a TP mode.

    ``tp`` holds all the mode's ranks (its total degree); ``grid`` (2d) and ``cube`` (3d) place
    them (``groups.build_grid_groups`` / ``build_cube_groups`` over ``tp``'s ranks).
    """

    mode: TPMode
    tp: ProcessGroup
    grid: Grid2D | None = None
    cube: Cube3D | None = None

    def __post_init__(self) -> None:
        if (self.grid is not None) != (self.mode == "2d") or (self.cube is not None) != (
            self.mode == "3d"
        ):
            raise ValueError(f"TPModeGroups: mode {self.mode} takes a grid for 2d, a cube for 3d")


@dataclass(frozen=True)
class Part:
    """Block ``index`` of ``parts`` equal blocks along one dimension."""

    parts: int
    index: int

    def of(self, tensor: Tensor, dim: int) -> Tensor:
        if tensor.shape[dim] % self.parts:
            raise ValueError(
                f"dimension {dim} of size {tensor.shape[dim]} does not split in {self.parts}"
            )
        return tensor.chunk(self.parts, dim=dim)[self.index]


WHOLE = Part(1, 0)


@dataclass(frozen=True)
class TokenLayout:
    """Which part of an ``[s, b, h]`` activation a rank holds in a mode's residual stream.

    ``hidden_group``: the ranks holding the other hidden blocks of its tokens (2d: the grid's row;
    3d: the cube's z line), over which the head's partial logits are summed.
    """

    sequence: Part
    batch: Part
    hidden: Part
    hidden_group: ProcessGroup | None

    @property
    def whole(self) -> bool:
        """Whether the rank computes every token (1d)."""
        return self.sequence == WHOLE and self.batch == WHOLE and self.hidden == WHOLE

    def tokens(self, x: Tensor) -> Tensor:
        """This rank's tokens of ``x`` ``[s, b, ...]``."""
        return self.batch.of(self.sequence.of(x, 0), 1)

    def scored(self, labels: Tensor) -> Tensor:
        """The labels of the tokens whose logits this rank has after the head."""
        mine = self.tokens(labels)
        if self.hidden_group is None:
            return mine
        return Part(self.hidden_group.size(), self.hidden_group.rank()).of(mine, 0)


def token_layout(groups: TPModeGroups) -> TokenLayout:
    """Where this rank's tokens and hidden block are in ``groups.mode``."""
    if groups.mode == "1d":
        return TokenLayout(WHOLE, WHOLE, WHOLE, None)
    if groups.mode == "metp":
        return TokenLayout(Part(groups.tp.size(), groups.tp.rank()), WHOLE, WHOLE, None)
    if groups.grid is not None:
        grid = groups.grid
        return TokenLayout(WHOLE, Part(grid.q, grid.row), Part(grid.q, grid.column), grid.row_group)
    cube = groups.cube
    assert cube is not None
    p = cube.p
    return TokenLayout(WHOLE, Part(p**2, cube.i * p + cube.j), Part(p, cube.l), cube.z_group)


def _block_spec(groups: TPModeGroups) -> tuple[TransformerBlockSubmodules, ProcessGroup]:
    """The mode's layer spec and final norm, and the TP group its layers divide heads over."""
    if groups.grid is not None:
        layer = get_2d_layer_spec(groups.grid)
        norm = ModuleSpec(module=LayerNorm2D, params={"grid": groups.grid})
        return TransformerBlockSubmodules([layer], norm), groups.grid.row_group
    if groups.cube is not None:
        layer = get_3d_layer_spec(groups.cube)
        norm = ModuleSpec(module=LayerNorm3D, params={"cube": groups.cube})
        return TransformerBlockSubmodules([layer], norm), groups.cube.y_group
    if groups.mode == "metp":
        layer = metp_layer_spec(groups.tp, AttnMaskType.causal)
        return TransformerBlockSubmodules([layer], SequenceParallelTorchNorm), groups.tp
    layer = get_gpt_layer_local_spec()
    return TransformerBlockSubmodules([layer], layer.submodules.input_layernorm), groups.tp


def _check_config(config: TransformerConfig, groups: TPModeGroups) -> None:
    degree = groups.tp.size()
    if config.tensor_model_parallel_size != degree:
        raise ConfigError(
            "tensor_model_parallel_size",
            f"{config.tensor_model_parallel_size} differs from the {groups.mode} group's {degree} "
            "ranks; set it to the mode's total degree",
        )
    partial = groups.mode != "1d"
    if degree > 1 and config.sequence_parallel != partial:
        raise ConfigError(
            "sequence_parallel",
            f"set it {partial} for {groups.mode}: the replicated projection and head's gradients "
            + ("are partial sums over the group" if partial else "are whole on every rank"),
        )


class _Replicated(nn.Module):
    """A linear layer every rank holds whole (``weight`` ``[out, in]``, ``bias`` ``[out]``)."""

    def __init__(self, config: TransformerConfig, in_features: int, out_features: int) -> None:
        super().__init__()
        weight = torch.empty(out_features, in_features, dtype=torch.float)
        if config.perform_initialization:
            config.init_method(weight)
        self.weight = nn.Parameter(weight.to(config.params_dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=config.params_dtype))


class TPModeModel(MegatronModule):
    """Input projection, ``TransformerBlock`` and token classification head in one TP mode.

    Built in the same order with the same draws in every mode, so that under
    ``use_cpu_initialization`` models seeded alike start from the same weights.
    """

    def __init__(
        self,
        config: TransformerConfig,
        groups: TPModeGroups,
        input_size: int,
        num_classes: int,
    ) -> None:
        """
        Args:
            config: megatron-core's; ``tensor_model_parallel_size`` is ``groups.tp``'s size and
                ``sequence_parallel`` is set in every mode but 1d (see the module's docstring).
            groups: the mode and its groups.
            input_size: features per input token.
            num_classes: the head's classes.
        """
        super().__init__(config=config)
        _check_config(config, groups)
        self.model_type = ModelType.encoder_or_decoder  # what megatron-core's schedules read
        self.groups = groups
        self.layout = token_layout(groups)
        self.input_projection = _Replicated(config, input_size, config.hidden_size)
        block, layer_group = _block_spec(groups)
        self.decoder = TransformerBlock(
            config,
            block,
            pg_collection=ProcessGroupCollection(tp=layer_group, cp=None, pp=None),
        )
        self.head = _Replicated(config, config.hidden_size, num_classes)
        if not self.layout.whole:  # partial sums on every rank: finalize_model_grads adds them
            for module in (self.input_projection, self.head):
                for param in module.parameters():
                    param.sequence_parallel = True

    def set_input_tensor(self, input_tensor: list[Tensor | None] | Tensor | None) -> None:
        """Where megatron-core's schedules hand a stage its input: this model is one whole stage,
        so it takes none."""
        tensors = input_tensor if isinstance(input_tensor, list) else [input_tensor]
        if any(tensor is not None for tensor in tensors):
            raise ValueError("TPModeModel is a single pipeline stage: it takes no input tensor")

    def forward(self, inputs: Tensor, labels: Tensor) -> Tensor:
        """This rank's share of the microbatch's mean token cross-entropy.

        Args:
            inputs: the whole microbatch, ``[s, b, input_size]``, on every rank of the group.
            labels: its classes, ``[s, b]``.

        Returns:
            The mean loss itself in 1d, where every rank scores every token; in the other modes the
            ranks' shares sum to it over ``groups.tp`` (``mean_loss``).
        """
        layout = self.layout
        projection = self.input_projection
        hidden = F.linear(
            layout.tokens(inputs),
            layout.hidden.of(projection.weight, 0),
            layout.hidden.of(projection.bias, 0),
        )
        causal = None
        if self.groups.mode != "metp":  # METP's layers apply their spec's mask type
            s = hidden.shape[0]
            causal = torch.ones(s, s, dtype=torch.bool, device=hidden.device).triu(1)[None, None]
        hidden = self.decoder(hidden, attention_mask=causal)
        logits = F.linear(hidden, layout.hidden.of(self.head.weight, 1))
        if layout.hidden_group is not None:
            # the hidden blocks' partial logits summed; each rank of the group keeps a slice of
            # the sequence, so that every token is scored once
            logits = reduce_scatter_to_sequence_parallel_region(logits, group=layout.hidden_group)
        logits = logits + self.head.bias
        scored = layout.scored(labels)
        loss = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), scored.reshape(-1), reduction="sum"
        )
        return loss / labels.numel()

    def mean_loss(self, share: Tensor) -> Tensor:
        """The microbatch's mean loss from this rank's ``forward`` (the same on every rank)."""
        total = share.detach().clone()
        if not self.layout.whole:
            dist.all_reduce(total, group=self.groups.tp)
        return total


def training_process_groups(
    groups: TPModeGroups,
    dp: ProcessGroup,
    alone: ProcessGroup,
    instance: ProcessGroup,
) -> ProcessGroupCollection:
    """megatron-core's groups for the schedule, DDP, optimizer and ``finalize_model_grads`` of a
    ``TPModeModel`` (no pipeline, no experts, no context parallelism).

    Args:
        groups: the model's; its whole group is the TP and the model-parallel group (over which
            the gradient norm is summed).
        dp: the data-parallel group (the replicas of this rank's position).
        alone: a group of this rank alone (the pipeline and context-parallel groups).
        instance: every rank of the job, over which the distributed optimizer sums the norm.
    """
    return ProcessGroupCollection(
        tp=groups.tp,
        pp=alone,
        cp=alone,
        mp=groups.tp,
        dp=dp,
        dp_cp=dp,
        expt_dp=dp,
        ep=None,
        tp_ep_pp=None,
        embd=None,
        pos_embd=None,
        intra_dist_opt=instance,
    )
