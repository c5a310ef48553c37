"""A ViT encoder stage and its projector, tensor-parallel, written as kernel-sized steps.

Megatron-core's layout: activations are [sequence, batch, hidden]; QKV and fc1 are column-parallel,
the attention output projection and fc2 row-parallel, their shards held and initialised by
megatron-core's ``ColumnParallelLinear`` / ``RowParallelLinear`` (only their parameters are used:
the steps apply them, so that every TP collective is a step of its own). The encoder has its own
plan, so its TP group is always passed in; megatron-core's ``parallel_state`` is never read.

TP collectives (explicit adjoints, so a backward collective is an op of its own):
- without sequence parallelism a half-layer's input is copied into the TP region (its adjoint, the
  all-reduce of the partial input gradient, runs right after the qkv/fc1 backward) and its output is
  all-reduced (``tp_ar_*``, adjoint the identity);
- with sequence parallelism (TP > 1) the residual stream holds 1/TP of the tokens: all-gather before
  qkv/fc1 (adjoint reduce-scatter), reduce-scatter after attn_proj/fc2 (adjoint all-gather). The
  parameters then applied to a rank's own tokens (norms, row-parallel biases, patch and position
  embedding) get partial gradients: they carry megatron-core's ``sequence_parallel`` attribute, and
  ``EncoderStage.reduce_sequence_parallel_grads`` sums them over the TP group.

Stage 0 embeds patches given as [batch, seq, in_channels * patch_size**2]; the last stage's projector
(``mlp``: Linear, GELU, Linear; ``linear``: one Linear) returns [seq, batch, llm_hidden], whole on
every TP rank (one all-reduce, ``tp_ar_projector``); under sequence parallelism it first gathers
the tokens (``tp_ag_projector``). Its backward collective follows its first GEMM's backward:
``tp_ar_projector`` (mlp), ``tp_rs_projector`` (mlp, sequence parallel) or ``tp_ag_projector``
(linear), none for a frozen encoder.

Where this differs from ``cost_model.layer_kernels`` (TP > 1 only): the cost model mirrors each
forward collective into the backward, which puts the no-SP backward all-reduces and the projector's
backward collective before the GEMMs whose gradients they reduce, and has no projector gather.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import ModelParallelConfig
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.utils import init_method_normal
from torch import nn
from torch.distributed import ProcessGroup

from optimus_mllm.config import EncoderConfig, OptimusConfig, TransformerSpec
from optimus_mllm.params import stage_layer_bounds
from optimus_mllm.runtime.dropout import dropout, site_seed
from optimus_mllm.runtime.dtypes import ACTIVATIONS
from optimus_mllm.runtime.encoder_ops import Block, Step, run_steps

Tensor = torch.Tensor
InitMethod = Callable[[Tensor], Any]

# torch 2.13 renames the single-tensor collectives; older releases have only the old names
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# ---------------------------------------------------------------------------------------------
# Collectives over the encoder's TP group (dim 0 is the sequence)


def _all_reduce(x: Tensor, group: ProcessGroup) -> Tensor:
    out = x.clone()  # x may still be saved for another op's backward
    dist.all_reduce(out, group=group)
    return out


def _all_gather(x: Tensor, group: ProcessGroup) -> Tensor:
    out = x.new_empty((group.size() * x.shape[0], *x.shape[1:]))
    _all_gather_single(out, x.contiguous(), group=group)
    return out


def _reduce_scatter(x: Tensor, group: ProcessGroup) -> Tensor:
    out = x.new_empty((x.shape[0] // group.size(), *x.shape[1:]))
    _reduce_scatter_single(out, x.contiguous(), group=group)
    return out


def _all_gather_last_dim(x: Tensor, group: ProcessGroup) -> Tensor:
    return torch.cat(_all_gather(x, group).chunk(group.size(), dim=0), dim=-1)


def _own_chunk(x: Tensor, group: ProcessGroup, dim: int) -> Tensor:
    return x.chunk(group.size(), dim=dim)[group.rank()].clone()  # a view would pin the whole tensor


def _collective(forward: Callable[[Tensor], Tensor], adjoint: Callable[[Tensor], Tensor],
                fwd_kernel: str | None, bwd_kernel: str | None) -> Step:
    return Step(forward=lambda x: (forward(x),), adjoint=lambda g: (adjoint(g),),
                fwd_kernel=fwd_kernel, bwd_kernel=bwd_kernel)


def _identity(x: Tensor) -> Tensor:
    return x


def _tp_entry(group: ProcessGroup, sequence_parallel: bool, half: str) -> Step:
    """Into a column-parallel GEMM: gather the tokens (SP), or copy (backward: all-reduce)."""
    if sequence_parallel:
        return _collective(lambda x: _all_gather(x, group), lambda g: _reduce_scatter(g, group),
                           f"tp_ag_{half}", f"tp_rs_{half}")
    return _collective(_identity, lambda g: _all_reduce(g, group), None, f"tp_ar_{half}")


def _tp_exit(group: ProcessGroup, sequence_parallel: bool, half: str) -> Step:
    """Out of a row-parallel GEMM: reduce-scatter (SP) or all-reduce the partial sums."""
    if sequence_parallel:
        return _collective(lambda x: _reduce_scatter(x, group), lambda g: _all_gather(g, group),
                           f"tp_rs_{half}", f"tp_ag_{half}")
    return _collective(lambda x: _all_reduce(x, group), _identity, f"tp_ar_{half}", None)


# ---------------------------------------------------------------------------------------------
# Compute steps


def _compute(kernel: str, fn: Callable[[Tensor], Tensor], *params: Tensor | None) -> Step:
    return Step(forward=lambda x: (fn(x),), fwd_kernel=kernel, bwd_kernel=kernel,
                trainable=_wants_grad(*params))


def _wants_grad(*params: Tensor | None) -> bool:
    return any(p is not None and p.requires_grad for p in params)


def _norm_step(norm: nn.Module, kernel: str) -> Step:
    """Normalise, and keep the input as the residual of the half-layer."""
    return Step(forward=lambda h: (norm(h), h), fwd_kernel=kernel, bwd_kernel=kernel,
                writes=("hidden", "residual"), trainable=_wants_grad(*norm.parameters()))


def _residual_add_step(bias: Tensor | None, p: float, site: str, group: ProcessGroup,
                       sequence_parallel: bool) -> Step:
    """The row-parallel bias, hidden dropout and the residual, after the reduction (megatron-core's
    bias-dropout-add): no kernel of its own. Under sequence parallelism ``x`` holds this rank's tokens,
    otherwise all of them, the same on every TP rank."""
    parts, part = (group.size(), group.rank()) if sequence_parallel else (1, 0)

    def forward(seed: int, x: Tensor, residual: Tensor) -> tuple[Tensor]:
        x = x if bias is None else x + bias
        x = dropout(x, p, site_seed(seed, site), (x.shape[0] * parts, *x.shape[1:]), 0, parts, part)
        return (x + residual,)

    return Step(forward=forward, fwd_kernel=None, bwd_kernel=None, reads=("hidden", "residual"),
                trainable=_wants_grad(bias), seeded=True)


def _bias_step(bias: Tensor | None) -> Step:
    return Step(forward=lambda x: (x if bias is None else x + bias,), fwd_kernel=None, bwd_kernel=None,
                trainable=_wants_grad(bias))


def _norm(spec: TransformerSpec, dtype: torch.dtype) -> nn.Module:
    if spec.normalization == "RMSNorm":
        return nn.RMSNorm(spec.hidden_size, eps=1e-5, dtype=dtype)
    return nn.LayerNorm(spec.hidden_size, eps=1e-5, dtype=dtype)


# ---------------------------------------------------------------------------------------------
# Modules


class PatchEmbedding(nn.Module):
    """Flattened patches -> hidden, plus a learned position embedding; replicated over TP."""

    def __init__(self, encoder: EncoderConfig, init_method: InitMethod, dtype: torch.dtype):
        super().__init__()
        patch_dim = encoder.in_channels * encoder.patch_size**2
        self.weight = nn.Parameter(torch.empty(encoder.hidden_size, patch_dim, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(encoder.hidden_size, dtype=dtype))
        self.position = nn.Parameter(torch.empty(encoder.seq_length, encoder.hidden_size, dtype=dtype))
        init_method(self.weight)
        init_method(self.position)

    def step(self, tokens: slice) -> Step:
        """Embed the patches of ``tokens`` (a rank's own share under sequence parallelism)."""

        def forward(patches: Tensor) -> Tensor:
            # pixels arrive in fp32 (the data loader's); the weights are in the training precision
            x = F.linear(patches[:, tokens].to(self.weight.dtype), self.weight, self.bias) + self.position[tokens]
            return x.transpose(0, 1).contiguous()

        return _compute("patch_embed", forward, self.weight, self.bias, self.position)


class TransformerLayer(nn.Module):
    """Pre-norm ViT layer: attention (grouped-query capable) and a GELU (or GELU-gated) MLP."""

    def __init__(self, spec: TransformerSpec, config: ModelParallelConfig, group: ProcessGroup,
                 init_method: InitMethod):
        super().__init__()
        tp = group.size()
        self.heads, self.groups = spec.num_attention_heads // tp, spec.query_groups // tp
        self.head_dim = spec.head_dim
        self.hidden_dropout, self.attention_dropout = spec.hidden_dropout, spec.attention_dropout
        self.gated, self.act = spec.gated_linear_unit, ACTIVATIONS[spec.activation]
        dims = {"config": config, "init_method": init_method, "bias": spec.add_bias_linear,
                "skip_bias_add": False, "tp_group": group}
        q_width = spec.num_attention_heads * spec.head_dim
        qkv_width = (spec.num_attention_heads + 2 * spec.query_groups) * spec.head_dim
        self.ln_attn = _norm(spec, config.params_dtype)
        self.qkv = ColumnParallelLinear(spec.hidden_size, qkv_width, gather_output=False, **dims)
        self.attn_proj = RowParallelLinear(q_width, spec.hidden_size, input_is_parallel=True, **dims)
        self.ln_mlp = _norm(spec, config.params_dtype)
        # gated: stride 2 gives each rank matching halves of the gate and the up projection
        self.fc1 = ColumnParallelLinear(spec.hidden_size, spec.ffn_hidden_size * (2 if self.gated else 1),
                                        gather_output=False, stride=2 if self.gated else 1, **dims)
        self.fc2 = RowParallelLinear(spec.ffn_hidden_size, spec.hidden_size, input_is_parallel=True, **dims)

    def steps(self, group: ProcessGroup, sequence_parallel: bool, site: str) -> tuple[Step, ...]:
        """The layer's steps; ``site`` (``encoder:global layer``) names its dropout masks."""
        tp = group.size() > 1
        qkv, proj, fc1, fc2 = self.qkv, self.attn_proj, self.fc1, self.fc2
        core = Step(forward=lambda seed, x: (self._attention(x, group, site_seed(seed, f"{site}:attn_core")),),
                    fwd_kernel="attn_core", bwd_kernel="attn_core", seeded=True)
        attention = [
            _compute("qkv", lambda x: F.linear(x, qkv.weight, qkv.bias), qkv.weight, qkv.bias),
            core,
            _compute("attn_proj", lambda x: F.linear(x, proj.weight), proj.weight),
        ]
        mlp = [
            _compute("fc1", lambda x: F.linear(x, fc1.weight, fc1.bias), fc1.weight, fc1.bias),
            _compute("act", self._activation),
            _compute("fc2", lambda x: F.linear(x, fc2.weight), fc2.weight),
        ]
        if tp:
            sp = sequence_parallel
            attention = [_tp_entry(group, sp, "attn"), *attention, _tp_exit(group, sp, "attn")]
            mlp = [_tp_entry(group, sp, "mlp"), *mlp, _tp_exit(group, sp, "mlp")]
        p, sp = self.hidden_dropout, sequence_parallel
        return (
            _norm_step(self.ln_attn, "ln_attn"), *attention,
            _residual_add_step(proj.bias, p, f"{site}:attn", group, sp),
            _norm_step(self.ln_mlp, "ln_mlp"), *mlp,
            _residual_add_step(fc2.bias, p, f"{site}:mlp", group, sp),
        )

    def _attention(self, qkv: Tensor, group: ProcessGroup, seed: int) -> Tensor:
        """Bidirectional softmax attention over this rank's heads; QKV grouped per query group
        (megatron-core's layout, so TP shards split whole groups). With attention dropout the
        probabilities are materialised (as in megatron-core's local attention): their mask is cut
        from the one of all heads."""
        s, b, _ = qkv.shape
        per_group = self.heads // self.groups
        x = qkv.view(s, b, self.groups, per_group + 2, self.head_dim)
        q = x[:, :, :, :per_group].reshape(s, b, self.heads, self.head_dim)
        k, v = x[:, :, :, per_group], x[:, :, :, per_group + 1]
        q, k, v = (y.permute(1, 2, 0, 3) for y in (q, k, v))  # [batch, heads, seq, head_dim]
        if per_group > 1:
            k, v = k.repeat_interleave(per_group, dim=1), v.repeat_interleave(per_group, dim=1)
        p = self.attention_dropout
        if p == 0.0:
            out = F.scaled_dot_product_attention(q, k, v)
        else:
            scores = torch.matmul(q, k.transpose(-2, -1)) * self.head_dim**-0.5
            probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
            tp = group.size()
            probs = dropout(probs, p, seed, (b, self.heads * tp, s, s), 1, tp, group.rank())
            out = torch.matmul(probs, v)
        return out.permute(2, 0, 1, 3).reshape(s, b, self.heads * self.head_dim)

    def _activation(self, x: Tensor) -> Tensor:
        if self.gated:
            gate, up = x.chunk(2, dim=-1)
            return self.act(gate) * up
        return self.act(x)


class Projector(nn.Module):
    """Encoder features -> the LLM's hidden size, TP-sharded with one all-reduce at the end.

    ``mlp``: column-parallel fc1, GELU, row-parallel fc2. ``linear``: one row-parallel GEMM over
    this rank's slice of the features (its input gradient is gathered: ``tp_ag_projector``).
    """

    def __init__(self, encoder: EncoderConfig, llm_hidden_size: int, config: ModelParallelConfig,
                 group: ProcessGroup, init_method: InitMethod):
        super().__init__()
        self.mlp = encoder.projector.type == "mlp"
        dims = {"config": config, "init_method": init_method, "bias": True, "skip_bias_add": False, "tp_group": group}
        if self.mlp:
            self.fc1 = ColumnParallelLinear(encoder.hidden_size, llm_hidden_size, gather_output=False, **dims)
            self.fc2 = RowParallelLinear(llm_hidden_size, llm_hidden_size, input_is_parallel=True, **dims)
        else:
            self.fc1 = RowParallelLinear(encoder.hidden_size, llm_hidden_size, input_is_parallel=True, **dims)

    def steps(self, group: ProcessGroup, sequence_parallel: bool) -> tuple[Step, ...]:
        tp = group.size() > 1
        fc1 = self.fc1
        if self.mlp:
            fc2 = self.fc2
            head = [_tp_entry(group, sequence_parallel, "projector")] if tp else []
            gemms = [
                _compute("projector_fc1", lambda x: F.gelu(F.linear(x, fc1.weight, fc1.bias)), fc1.weight, fc1.bias),
                _compute("projector_fc2", lambda x: F.linear(x, fc2.weight), fc2.weight),
            ]
            bias = fc2.bias
        else:
            head = []
            if sequence_parallel:  # replicated downstream: the adjoint keeps this rank's tokens
                head.append(_collective(lambda x: _all_gather(x, group), lambda g: _own_chunk(g, group, 0),
                                        "tp_ag_projector", None))
            if tp:
                head.append(_collective(lambda x: _own_chunk(x, group, -1), lambda g: _all_gather_last_dim(g, group),
                                        None, "tp_ag_projector"))
            gemms = [_compute("projector_fc1", lambda x: F.linear(x, fc1.weight), fc1.weight)]
            bias = fc1.bias
        tail = [_tp_exit(group, False, "projector")] if tp else []  # whole output on every rank, SP or not
        return (*head, *gemms, *tail, _bias_step(bias))


class VisionStage(nn.Module):
    """One encoder's layers on one encoder pipeline stage: patch embedding on the first stage,
    projector on the last; ``frozen`` freezes everything but the projector."""

    def __init__(self, encoder: EncoderConfig, llm_hidden_size: int, stage: int, num_stages: int,
                 tp_group: ProcessGroup, *, sequence_parallel: bool = False,
                 params_dtype: torch.dtype = torch.float32, init_std: float = 0.02):
        super().__init__()
        tp = tp_group.size()
        self.encoder = encoder
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel and tp > 1
        _check_tp(encoder, llm_hidden_size, tp, self.sequence_parallel)
        self.first_layer, last_layer = stage_layer_bounds(encoder.num_layers, num_stages)[stage]
        config = ModelParallelConfig(tensor_model_parallel_size=tp, use_cpu_initialization=True,
                                     perform_initialization=True, params_dtype=params_dtype)
        init_method = init_method_normal(init_std)
        self.patch_embed = PatchEmbedding(encoder, init_method, params_dtype) if stage == 0 else None
        self.layers = nn.ModuleList(TransformerLayer(encoder, config, tp_group, init_method)
                                    for _ in range(self.first_layer, last_layer))
        last = stage == num_stages - 1
        self.projector = Projector(encoder, llm_hidden_size, config, tp_group, init_method) if last else None
        for name, param in self.named_parameters():
            if encoder.frozen and not name.startswith("projector."):
                param.requires_grad_(False)
            # megatron-core's mark for gradients that are partial sums over the TP group
            if self.sequence_parallel and not name.startswith("projector.") \
                    and not getattr(param, "tensor_model_parallel", False):
                param.sequence_parallel = True

    def blocks(self) -> list[Block]:
        """Patch embedding, layers, projector: the units of the cost model's stage chain."""
        name, group, sp = self.encoder.name, self.tp_group, self.sequence_parallel
        trainable = not self.encoder.frozen
        blocks = []
        if self.patch_embed is not None:
            share = self.encoder.seq_length // group.size() if sp else self.encoder.seq_length
            start = group.rank() * share if sp else 0
            blocks.append(Block(name, -1, (self.patch_embed.step(slice(start, start + share)),), False))
        for i, layer in enumerate(self.layers):
            index = self.first_layer + i
            blocks.append(Block(name, index, layer.steps(group, sp, f"{name}:{index}"), trainable))
        if self.projector is not None:
            blocks.append(Block(name, -1, self.projector.steps(group, sp), trainable))
        return blocks

    def forward(self, x: Tensor, seed: int) -> Tensor:
        """The whole stage as one autograd graph (patches on stage 0, hidden states elsewhere); ``seed``:
        the microbatch's dropout seed."""
        if self.patch_embed is not None and x.shape[1] != self.encoder.seq_length:
            raise ValueError(f"{self.encoder.name}: {x.shape[1]} patches per image, seq_length is "
                             f"{self.encoder.seq_length}")
        return run_steps([step for block in self.blocks() for step in block.steps], x, seed)


class EncoderStage(nn.Module):
    """Every encoder of the config on one encoder pipeline stage, sharing the encoder TP group."""

    def __init__(self, config: OptimusConfig, stage: int, num_stages: int, tp_group: ProcessGroup, *,
                 params_dtype: torch.dtype = torch.float32, init_std: float = 0.02):
        super().__init__()
        self.tp_group = tp_group
        self.encoders = nn.ModuleDict({
            enc.name: VisionStage(enc, config.llm.hidden_size, stage, num_stages, tp_group,
                                  sequence_parallel=config.training.sequence_parallel,
                                  params_dtype=params_dtype, init_std=init_std)
            for enc in config.encoders
        })

    def blocks(self) -> list[Block]:
        return [block for stage in self.encoders.values() for block in stage.blocks()]

    def forward(self, inputs: Mapping[str, Tensor], seed: int) -> dict[str, Tensor]:
        return {name: stage(inputs[name], seed) for name, stage in self.encoders.items()}

    def reduce_sequence_parallel_grads(self) -> None:
        """Sum the partial gradients of sequence-parallel parameters over the TP group; once per
        iteration after the last backward op (megatron-core's finalize_model_grads does the same
        for these parameters when given this TP group). Under megatron-core's DDP the gradient is
        the parameter's ``main_grad``."""
        grads = [getattr(p, "main_grad", p.grad) for p in self.parameters() if getattr(p, "sequence_parallel", False)]
        grads = [g for g in grads if g is not None]
        if not grads or self.tp_group.size() == 1:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.tp_group)
        for g, reduced in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(reduced.view_as(g))


def _check_tp(encoder: EncoderConfig, llm_hidden_size: int, tp: int, sequence_parallel: bool) -> None:
    sizes = {
        "num_attention_heads": encoder.num_attention_heads,
        "num_query_groups": encoder.query_groups,
        "ffn_hidden_size": encoder.ffn_hidden_size,
        "hidden_size": encoder.hidden_size,
        "llm.hidden_size": llm_hidden_size,
    }
    if sequence_parallel:
        sizes["seq_length"] = encoder.seq_length
    for field, size in sizes.items():
        if size % tp:
            raise ValueError(f"encoder {encoder.name}: {field} = {size} is not divisible by its TP size {tp}")
