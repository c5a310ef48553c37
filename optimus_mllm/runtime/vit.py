"""A ViT encoder stage and its projector, tensor-parallel, written as kernel-sized steps.

Megatron-core's layout and modules: activations are [sequence, batch, hidden]; the patch embedding
holds ``CLIPViTModel``'s parameters, the layers are megatron-core ``TransformerLayer``s built from a
layer spec (``layer_ops.vision_layer_spec`` by default) and the ``mlp`` and ``affine`` projectors
are ``MultimodalProjector``s. None of their forwards runs: steps apply their weights (the layers'
steps come from ``layer_ops.layer_steps``), so that every TP collective is a step of its own. The
encoder has its own plan, so its TP group is always passed in; megatron-core's ``parallel_state`` is
never read.

Under sequence parallelism (TP > 1) the parameters applied to a rank's own tokens (norms,
row-parallel biases, patch and position embedding) get partial gradients: they carry megatron-core's
``sequence_parallel`` attribute, and ``EncoderStage.reduce_sequence_parallel_grads`` sums them over
the TP group.

Stage 0 embeds patches given as [batch, seq, in_channels * patch_size**2], after ``CLIPViTModel``'s
class token when the encoder has one; the last stage's projector (``mlp``: megatron-core's MLP, fc1,
its activation (gated or not), fc2; ``affine``: megatron-core's one column-parallel GEMM;
``linear``: one row-parallel GEMM; each after LLaVA's drop of the class token and the optional
spatial merge of ``projector.spatial_merge``) returns [image tokens, batch, llm_hidden], whole on
every TP rank (``mlp``, ``linear``: one all-reduce, ``tp_ar_projector``; ``affine``: one all-gather
of its columns, ``tp_ag_projector_output``); under sequence parallelism it first gathers the tokens
(``tp_ag_projector``), then drops and merges them. Its backward collective follows its first GEMM's
backward: ``tp_ar_projector`` (mlp, affine), ``tp_rs_projector`` (mlp, affine, sequence parallel)
or ``tp_ag_projector`` (linear), none for a frozen encoder.

Where this differs from ``cost_model.layer_kernels`` (TP > 1 only): the cost model mirrors each
forward collective into the backward, which puts the no-SP backward all-reduces and the projector's
backward collective before the GEMMs whose gradients they reduce, and has no projector gather.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.models.vision.multimodal_projector import MultimodalProjector
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from torch import nn
from torch.distributed import ProcessGroup

from optimus_mllm.config import EncoderConfig, OptimusConfig, TPMode, encoder_tp_problem
from optimus_mllm.costing.params import stage_layer_bounds
from optimus_mllm.runtime.dtypes import ACTIVATIONS
from optimus_mllm.runtime.encoder_ops import Block, Step, run_steps
from optimus_mllm.runtime.layer_ops import (
    all_gather,
    build_layer,
    check_decomposable,
    collective,
    compute,
    layer_steps,
    tp_entry,
    tp_exit,
    vision_layer_spec,
    vision_transformer_config,
    wants_grad,
)
from optimus_mllm.runtime.metp import metp_layer_spec
from optimus_mllm.runtime.tp_modes.groups import Grid2D
from optimus_mllm.runtime.tp_modes.layers_2d import get_2d_layer_spec

Tensor = torch.Tensor
InitMethod = Callable[[Tensor], Any]


def _all_gather_last_dim(x: Tensor, group: ProcessGroup) -> Tensor:
    return torch.cat(all_gather(x, group).chunk(group.size(), dim=0), dim=-1)


def _own_chunk(x: Tensor, group: ProcessGroup, dim: int) -> Tensor:
    return x.chunk(group.size(), dim=dim)[group.rank()].clone()  # a view would pin the whole tensor


def spatial_merge(x: Tensor, merged_tokens: int) -> Tensor:
    """[seq, batch, hidden] -> [seq / n, batch, n * hidden]: each n consecutive tokens (one spatial
    group
    of the data's patch order) side by side, as Qwen2-VL's patch merger concatenates them."""
    s, b, h = x.shape
    return (
        x.view(s // merged_tokens, merged_tokens, b, h)
        .transpose(1, 2)
        .reshape(s // merged_tokens, b, -1)
    )


def _merge_step(merged_tokens: int) -> Step:
    return Step(
        forward=lambda x: (spatial_merge(x, merged_tokens),),
        fwd_kernel=None,
        bwd_kernel=None,
        trainable=False,
    )


def _drop_step(tokens: int) -> Step:
    # LLaVA's drop_vision_class_token: the class tokens lead the sequence
    return Step(forward=lambda x: (x[tokens:],), fwd_kernel=None, bwd_kernel=None, trainable=False)


def _bias_step(bias: Tensor | None) -> Step:
    return Step(
        forward=lambda x: (x if bias is None else x + bias,),
        fwd_kernel=None,
        bwd_kernel=None,
        trainable=wants_grad(bias),
    )


# ---------------------------------------------------------------------------------------------
# Modules


class PatchEmbedding(nn.Module):
    """Patches -> hidden plus a learned position embedding, replicated over TP: megatron-core's
    ``CLIPViTModel`` embedding, under its names: ``conv1``, a patch-sized stride-``patch`` Conv2d
    (with a bias for the ``internvit`` subtype, without for ``clip``), the ``class_token`` [1,
    class tokens, hidden] put before the patches when the encoder has one, ``position_embeddings``
    over every token and, for ``clip``, the norm ``ln_pre``."""

    def __init__(self, encoder: EncoderConfig, init_method: InitMethod, dtype: torch.dtype):
        super().__init__()
        clip = encoder.model_subtype == "clip"
        self.conv1 = nn.Conv2d(
            encoder.in_channels,
            encoder.hidden_size,
            encoder.patch_size,
            encoder.patch_size,
            bias=not clip,
            dtype=dtype,
        )
        self.position_embeddings = nn.Embedding(
            encoder.layer_tokens, encoder.hidden_size, dtype=dtype
        )
        class_token = (
            nn.Parameter(torch.empty(1, encoder.class_tokens, encoder.hidden_size, dtype=dtype))
            if encoder.class_token
            else None
        )
        self.register_parameter("class_token", class_token)
        norm = nn.RMSNorm if encoder.normalization == "RMSNorm" else nn.LayerNorm
        self.ln_pre = norm(encoder.hidden_size, eps=1e-5, dtype=dtype) if clip else None
        init_method(self.conv1.weight)
        if self.conv1.bias is not None:
            nn.init.zeros_(self.conv1.bias)
        init_method(self.position_embeddings.weight)
        if self.class_token is not None:
            init_method(self.class_token)

    def step(self, tokens: slice) -> Step:
        """Embed the sequence positions ``tokens`` (a rank's own share under sequence parallelism):
        the class tokens first, then the patches. The data gives each patch flattened channel-last,
        so the convolution is one GEMM over it."""
        conv, position, ln_pre = self.conv1, self.position_embeddings.weight, self.ln_pre
        class_token = self.class_token
        leading = 0 if class_token is None else class_token.shape[1]
        patches_of = slice(max(tokens.start - leading, 0), tokens.stop - leading)

        def forward(patches: Tensor) -> Tensor:
            weight = conv.weight.permute(0, 2, 3, 1).reshape(conv.out_channels, -1)
            # pixels arrive in fp32 (the data loader's); the weights are in the training precision
            x = F.linear(patches[:, patches_of].to(weight.dtype), weight, conv.bias)
            if tokens.start < leading:  # this share holds class tokens: CLIPViTModel's concat
                own = class_token[:, tokens.start : min(tokens.stop, leading)]
                x = torch.cat([own.expand(x.shape[0], -1, -1), x], dim=1)
            x = x + position[tokens]
            x = x if ln_pre is None else ln_pre(x)
            return x.transpose(0, 1).contiguous()

        return compute("patch_embed", forward, *self.parameters())


class Projector(nn.Module):
    """Encoder features -> the LLM's hidden size, whole on every TP rank.

    ``mlp``: megatron-core's ``MultimodalProjector`` of type ``mlp`` (LLaVA's: column-parallel fc1,
    the activation, gated as megatron-core's MLP gates it, row-parallel fc2; one all-reduce at the
    end) of the configured width, activation and biases. ``affine``: megatron-core's
    ``MultimodalProjector`` of type ``affine``, one column-parallel GEMM whose output is gathered
    over TP (``tp_ag_projector_output``; its adjoint keeps this rank's columns). Both are applied by
    steps over the module's weights. ``linear``: one row-parallel GEMM over this rank's slice of
    the features (its input gradient is gathered: ``tp_ag_projector``), then an all-reduce. Before
    any of them, LLaVA's drop of the class token and the spatial merge select the tokens.
    """

    def __init__(
        self,
        encoder: EncoderConfig,
        llm_hidden_size: int,
        layer_config: TransformerConfig,
        group: ProcessGroup,
    ):
        super().__init__()
        projector = encoder.projector
        self.kind = projector.type
        self.merged_tokens = encoder.merged_tokens
        self.dropped_tokens = encoder.layer_tokens - encoder.projected_tokens
        if self.kind == "linear":
            self.linear = RowParallelLinear(
                encoder.projector_input_size,
                llm_hidden_size,
                config=layer_config,
                init_method=layer_config.init_method,
                bias=projector.add_bias_linear,
                skip_bias_add=False,
                input_is_parallel=True,
                tp_group=group,
            )
            return
        config = replace(
            layer_config,
            hidden_size=llm_hidden_size,
            ffn_hidden_size=projector.mlp_ffn_hidden_size(llm_hidden_size),
            gated_linear_unit=projector.gated_linear_unit,
            activation_func=ACTIVATIONS[projector.activation],
            add_bias_linear=projector.add_bias_linear,
        )
        self.projection = MultimodalProjector(
            config,
            MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
            self.kind,
            encoder.projector_input_size,
            tp_group=group,
        )

    def steps(self, group: ProcessGroup, sequence_parallel: bool) -> tuple[Step, ...]:
        """Under sequence parallelism: gather the tokens, drop and merge them, the GEMMs; otherwise
        drop and merge, enter the TP region, the GEMMs. Either way the output ends whole."""
        select = [_drop_step(self.dropped_tokens)] if self.dropped_tokens else []
        if self.merged_tokens > 1:
            select.append(_merge_step(self.merged_tokens))
        if self.kind == "linear":
            gather, entry = self._row_parallel_entry(group, sequence_parallel)
        else:  # column-parallel first, entered as megatron-core enters it
            into = [tp_entry(group, sequence_parallel, "projector")] if group.size() > 1 else []
            gather, entry = (into, []) if sequence_parallel else ([], into)
        body = {"mlp": self._mlp, "affine": self._affine, "linear": self._linear}[self.kind](group)
        return (*gather, *select, *entry, *body)

    def _mlp(self, group: ProcessGroup) -> list[Step]:
        """fc1 with its activation (gated or not), fc2, the reduce of its partial sums, fc2's bias
        on the whole output."""
        mlp = self.projection.encoder
        fc1, fc2 = mlp.linear_fc1, mlp.linear_fc2
        act, gated = mlp.config.activation_func, mlp.config.gated_linear_unit

        def fc1_activation(x: Tensor) -> Tensor:
            y = F.linear(x, fc1.weight, fc1.bias)
            if gated:  # megatron-core's MLP: this rank's [gate; up] halves
                gate, up = y.chunk(2, dim=-1)
                return act(gate) * up
            return act(y)

        return [
            compute("projector_fc1", fc1_activation, fc1.weight, fc1.bias),
            compute("projector_fc2", lambda x: F.linear(x, fc2.weight), fc2.weight),
            *([tp_exit(group, False, "projector")] if group.size() > 1 else []),
            _bias_step(fc2.bias),
        ]

    def _affine(self, group: ProcessGroup) -> list[Step]:
        """The GEMM to this rank's columns with their bias, the gather of every rank's columns.
        megatron-core adds the bias after its gather: the same numbers at TP 1; at TP > 1 it adds a
        rank's slice of the bias to the whole output and fails."""
        affine = self.projection.encoder
        weight, bias = affine.weight, affine.bias
        gathered = collective(
            lambda x: _all_gather_last_dim(x, group),
            lambda g: _own_chunk(g, group, -1),
            "tp_ag_projector_output",
            None,
        )
        return [
            compute("projector_fc1", lambda x: F.linear(x, weight, bias), weight, bias),
            *([gathered] if group.size() > 1 else []),
        ]

    def _linear(self, group: ProcessGroup) -> list[Step]:
        """The GEMM over this rank's slice of the features, the reduce, the bias."""
        linear = self.linear
        return [
            compute("projector_fc1", lambda x: F.linear(x, linear.weight), linear.weight),
            *([tp_exit(group, False, "projector")] if group.size() > 1 else []),
            _bias_step(linear.bias),
        ]

    def _row_parallel_entry(
        self, group: ProcessGroup, sequence_parallel: bool
    ) -> tuple[list[Step], list[Step]]:
        """``linear``'s way in: the gather of every token (SP; replicated downstream, so its
        adjoint keeps this rank's tokens), then this rank's slice of the features (its adjoint
        gathers the slices' gradients)."""
        gather = [
            collective(
                lambda x: all_gather(x, group),
                lambda g: _own_chunk(g, group, 0),
                "tp_ag_projector",
                None,
            )
        ]
        entry = [
            collective(
                lambda x: _own_chunk(x, group, -1),
                lambda g: _all_gather_last_dim(g, group),
                None,
                "tp_ag_projector",
            )
        ]
        return (gather if sequence_parallel else []), (entry if group.size() > 1 else [])


def _grid_block(x: Tensor, grid: Grid2D) -> Tensor:
    """This rank's ``[s, b/q, h/q]`` block of ``[s, b, h]``: samples block ``row``, hidden block
    ``column`` (``layers_2d``'s layout)."""
    samples = x.chunk(grid.q, dim=1)[grid.row]
    return samples.chunk(grid.q, dim=2)[grid.column].contiguous()


def _grid_whole(block: Tensor, grid: Grid2D, group: ProcessGroup) -> Tensor:
    """``[s, b, h]`` from every grid rank's block (``group``: the grid's ranks)."""
    parts = [torch.empty_like(block) for _ in range(group.size())]
    dist.all_gather(parts, block.contiguous(), group=group)
    at = {grid.layout.coords(dist.get_global_rank(group, r)): p for r, p in enumerate(parts)}
    rows = [torch.cat([at[(i, j)] for j in range(grid.q)], dim=2) for i in range(grid.q)]
    return torch.cat(rows, dim=1)


def _grid_entry(grid: Grid2D, group: ProcessGroup) -> Step:
    """Into the 2D layers: the rank's block of the replicated embedding; its adjoint gathers every
    block's gradient (each rank's embedding is used through its block alone)."""
    return collective(
        lambda x: _grid_block(x, grid), lambda g: _grid_whole(g, grid, group), None, None
    )


def _grid_exit(grid: Grid2D, group: ProcessGroup) -> Step:
    """Out of the 2D layers: the whole features on every rank for the projector (1D over the same
    ranks, replicated input); its adjoint keeps the rank's block of the whole, reduced gradient."""
    return collective(
        lambda x: _grid_whole(x, grid, group), lambda g: _grid_block(g, grid), None, None
    )


class VisionStage(nn.Module):
    """One encoder's global layers ``layers`` = [lo, hi): with the patch embedding if lo is 0, with
    the projector if hi is the last; ``frozen`` freezes everything but the projector. The layers are
    built from ``layer_spec`` (a megatron-core ``TransformerLayer`` spec; default
    ``vision_layer_spec()``) with the encoder's sizes and TP, and split into steps by
    ``layer_ops.layer_steps``. Under ``tp_mode`` metp they are ``metp.metp_layer_spec``'s, on the
    TP group's sequence-parallel tokens (METP's residual stream holds 1/p of them), one op per
    attention and per MLP; under 2d ``layers_2d.get_2d_layer_spec``'s on ``grid`` (the q x q grid
    over the TP group), each rank's ``[s, b/q, h/q]`` block cut from the replicated patch embedding
    and gathered whole again before the projector (1D over the same ranks)."""

    def __init__(
        self,
        encoder: EncoderConfig,
        llm_hidden_size: int,
        layers: tuple[int, int],
        tp_group: ProcessGroup,
        *,
        sequence_parallel: bool = False,
        params_dtype: torch.dtype = torch.float32,
        init_std: float = 0.02,
        layer_spec: ModuleSpec | None = None,
        tp_mode: TPMode = "1d",
        grid: Grid2D | None = None,
    ):
        super().__init__()
        tp = tp_group.size()
        self.encoder = encoder
        self.tp_group = tp_group
        self.grid = grid
        self.sequence_parallel = sequence_parallel and tp > 1
        if tp_mode not in ("1d", "metp", "2d"):
            raise ValueError(f"encoder {encoder.name}: tp_mode {tp_mode} has no runtime layers yet")
        if (grid is None) != (tp_mode != "2d") or (grid is not None and grid.q**2 != tp):
            raise ValueError(f"encoder {encoder.name}: tp_mode 2d takes the TP group's grid")
        if tp_mode == "2d" and (layer_spec is not None or self.sequence_parallel):
            # trained.py refuses both
            raise ValueError(
                f"encoder {encoder.name}: tp_mode 2d runs its own layers, without sequence "
                "parallelism; it takes no layer spec"
            )
        if tp_mode == "metp" and (layer_spec is not None or not self.sequence_parallel):
            # the planner's chain prices METP on sequence-parallel tokens; trained.py refuses both
            raise ValueError(
                f"encoder {encoder.name}: tp_mode metp runs its own layers on sequence-parallel "
                "tokens (TP >= 2); it takes no layer spec"
            )
        problem = encoder_tp_problem(encoder, llm_hidden_size, self.sequence_parallel, tp)
        if problem:  # the planner and the config checks keep such plans out
            raise ValueError(f"encoder {encoder.name}: {problem}")
        self.first_layer, last_layer = layers
        layer_config = vision_transformer_config(encoder, tp, params_dtype, init_std)
        first = self.first_layer == 0
        self.patch_embed = (
            PatchEmbedding(encoder, layer_config.init_method, params_dtype) if first else None
        )
        layer_group = tp_group
        if tp_mode == "metp":  # its norms saved under vision_layer_spec's keys, as its shards
            keys = vision_layer_spec().submodules.sharded_state_dict_keys_map
            spec = metp_layer_spec(tp_group)
            spec = replace(
                spec, submodules=replace(spec.submodules, sharded_state_dict_keys_map=keys)
            )
        elif grid is not None:  # a ViT attends both ways; heads split over the grid's rows
            spec, layer_group = get_2d_layer_spec(grid, AttnMaskType.no_mask), grid.row_group
        else:
            spec = layer_spec if layer_spec is not None else vision_layer_spec()
        self.layers = nn.ModuleList(
            build_layer(spec, layer_config, layer_group, index)
            for index in range(self.first_layer, last_layer)
        )
        # refused when built, not when first run
        for index, layer in enumerate(self.layers, self.first_layer):
            check_decomposable(layer, f"{encoder.name}:{index}")
        last = last_layer == encoder.num_layers
        self.projector = (
            Projector(encoder, llm_hidden_size, layer_config, tp_group) if last else None
        )
        for name, param in self.named_parameters():
            if encoder.frozen and not name.startswith("projector."):
                param.requires_grad_(False)
            # megatron-core's mark for gradients that are partial sums over the TP group
            if (
                self.sequence_parallel
                and not name.startswith("projector.")
                and not getattr(param, "tensor_model_parallel", False)
            ):
                param.sequence_parallel = True

    def blocks(self) -> list[Block]:
        """Patch embedding, layers, projector: the units of the cost model's stage chain."""
        name, group, sp = self.encoder.name, self.tp_group, self.sequence_parallel
        trainable = not self.encoder.frozen
        blocks = []
        if self.patch_embed is not None:
            tokens = self.encoder.layer_tokens
            share = tokens // group.size() if sp else tokens
            start = group.rank() * share if sp else 0
            embed = (self.patch_embed.step(slice(start, start + share)),)
            if self.grid is not None:
                embed += (_grid_entry(self.grid, group),)
            blocks.append(Block(name, -1, embed, False))
        for i, layer in enumerate(self.layers):
            index = self.first_layer + i
            blocks.append(
                Block(name, index, layer_steps(layer, group, sp, f"{name}:{index}"), trainable)
            )
        if self.projector is not None:
            gather = () if self.grid is None else (_grid_exit(self.grid, group),)
            blocks.append(Block(name, -1, gather + self.projector.steps(group, sp), trainable))
        return blocks

    def forward(self, x: Tensor, seed: int) -> Tensor:
        """The whole stage as one autograd graph (patches on stage 0, hidden states elsewhere);
        ``seed``:
        the microbatch's dropout seed."""
        if self.patch_embed is not None and x.shape[1] != self.encoder.seq_length:
            raise ValueError(
                f"{self.encoder.name}: {x.shape[1]} patches per image, seq_length is "
                f"{self.encoder.seq_length}"
            )
        return run_steps([step for block in self.blocks() for step in block.steps], x, seed)


class EncoderStage(nn.Module):
    """Every encoder of the config on one encoder pipeline stage, sharing the encoder TP group."""

    def __init__(
        self,
        config: OptimusConfig,
        stage: int,
        num_stages: int,
        tp_group: ProcessGroup,
        *,
        params_dtype: torch.dtype = torch.float32,
        init_std: float = 0.02,
        layer_specs: Mapping[str, ModuleSpec] | None = None,
        layers: Mapping[str, tuple[int, int]] | None = None,
        tp_mode: TPMode = "1d",
        grid: Grid2D | None = None,
    ):
        """``layer_specs``: a megatron-core layer spec per encoder name (the others get
        ``vision_layer_spec()``). ``tp_mode``: how ``tp_group`` splits the layers (the encoder
        plan's, 1d, metp or 2d on ``grid``, the q x q grid over ``tp_group``'s ranks;
        ``VisionStage``).
        ``layers``: each encoder's [lo, hi) layers, in place of stage ``stage``'s even share of
        ``num_stages`` (the balanced baseline's uneven virtual stages)."""
        super().__init__()
        self.tp_group = tp_group
        specs = layer_specs or {}
        if layers is None:
            layers = {
                enc.name: stage_layer_bounds(enc.num_layers, num_stages)[stage]
                for enc in config.encoders
            }
        self.encoders = nn.ModuleDict(
            {
                enc.name: VisionStage(
                    enc,
                    config.llm.hidden_size,
                    layers[enc.name],
                    tp_group,
                    sequence_parallel=config.training.sequence_parallel,
                    params_dtype=params_dtype,
                    init_std=init_std,
                    layer_spec=specs.get(enc.name),
                    tp_mode=tp_mode,
                    grid=grid,
                )
                for enc in config.encoders
            }
        )

    def blocks(self) -> list[Block]:
        return [block for stage in self.encoders.values() for block in stage.blocks()]

    def forward(self, inputs: Mapping[str, Tensor], seed: int) -> dict[str, Tensor]:
        return {name: stage(inputs[name], seed) for name, stage in self.encoders.items()}

    def reduce_sequence_parallel_grads(self) -> None:
        """Sum the partial gradients of sequence-parallel parameters over the TP group; once per
        iteration after the last backward op (megatron-core's finalize_model_grads does the same
        for these parameters when given this TP group). Under megatron-core's DDP the gradient is
        the parameter's ``main_grad``. The class token has no gradient on the ranks whose share
        does not hold it: theirs is zero."""
        params = [
            p
            for p in self.parameters()
            if getattr(p, "sequence_parallel", False) and p.requires_grad
        ]
        if not params or self.tp_group.size() == 1:
            return
        for p in params:
            if getattr(p, "main_grad", p.grad) is None:
                p.grad = torch.zeros_like(p)
        grads = [getattr(p, "main_grad", p.grad) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.tp_group)
        for g, reduced in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(reduced.view_as(g))
