"""METP: memory-efficient tensor parallelism for ``O = f(AB)C`` (Liang et al., 2025; issue 37).

The residual stream holds 1/p of the tokens on each of the p ranks of a TP group (rank i the i-th
contiguous block, as megatron-core's sequence parallelism), and every weight matrix is sharded as
megatron-core's column/row-parallel linears shard it, so a checkpoint's shards are the TP ones.
Nothing is all-gathered: the shards travel instead.

- ``metp_mlp`` (the paper's Algorithms 1-2): rank i computes its tokens' output as the sum over r
  of ``f(X_i W1_r + b1_r) W2_r``, the (W1_r, b1_r, W2_r) shards passed around a ring with P2P
  (rank i sends to i-1 and receives from i+1). The backward recomputes each tile; the shards' weight
  gradients travel with them and reach their owner after the p-th hop.
- ``metp_attention`` (Algorithms 3-6): an outer loop over the heads' shards (rank j's QKV and output
  projection shards broadcast from j at step j, their gradients reduced to j), and for each an inner
  ring of the K/V blocks of every rank's tokens, combined by an online (safe) softmax; causal masks
  skip the blocks of later tokens and mask the diagonal one. The forward keeps the input, each
  step's attention output and its log-sum-exp, nothing of size s x s/p.

The next block's receive (and the next step's broadcast) is posted before the current block's
compute, so on a GPU the transfer runs under it (double buffering); on gloo the ring runs in order.
Biases applied to a rank's own tokens only (fc2's, linear_proj's) are returned apart, as
megatron-core's row-parallel linears return them, and marked ``sequence_parallel`` so that
``finalize_model_grads`` sums their gradients over the group, as it does for the norms.

``MetpMLP`` and ``MetpSelfAttention`` take megatron-core's ``mlp`` and ``self_attention`` submodule
interfaces, so ``metp_layer_spec`` is a ``TransformerLayer`` spec (local norms, bias-dropout-add).
What they refuse, each in one line naming the setting: attention dropout, QK norms, mask types
other than no_mask and causal (config), and a mask tensor or rotary embeddings passed to the
forward.
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules
from torch import nn
from torch.distributed import ProcessGroup

from optimus_mllm.errors import ConfigError
from optimus_mllm.runtime.gpu_status import warn_unverified

Tensor = torch.Tensor
Activation = Callable[[Tensor], Tensor]


# ---------------------------------------------------------------------------------------------
# The ring and its double buffer


class _P2PStream:
    """Where the ring's sends and receives are issued: inline on CPU; on a CUDA device on a side
    stream that first waits for the compute stream (the blocks sent are ready), and that the compute
    stream waits for before it reads a received block."""

    def __init__(self, device: torch.device):
        self.side: Any = None
        if device.type == "cuda":
            warn_unverified("METP's P2P side stream")
            self.side = torch.cuda.Stream(device)

    @contextlib.contextmanager
    def issue(self, sent: Sequence[Tensor]) -> Iterator[None]:
        if self.side is None:
            yield
            return
        self.side.wait_stream(torch.cuda.current_stream(self.side.device))
        for tensor in sent:  # the allocator must not reuse them before the send is done
            tensor.record_stream(self.side)
        with torch.cuda.stream(self.side):
            yield

    def received(self, tensors: list[Tensor]) -> None:
        if self.side is None:
            return
        main = torch.cuda.current_stream(self.side.device)
        main.wait_stream(self.side)
        for tensor in tensors:  # allocated on the side stream, read on the main one
            tensor.record_stream(main)


@dataclass
class _InFlight:
    """Blocks being received (and the sends of the blocks passed on) of one ring hop."""

    blocks: list[Tensor]
    works: list[Any]
    stream: _P2PStream | None = None  # None: a collective, ordered by its own backend

    def wait(self) -> list[Tensor]:
        for work in self.works:
            work.wait()
        if self.stream is not None:
            self.stream.received(self.blocks)
        return self.blocks


class _Ring:
    """Rank i of a group sends to rank i-1 and receives from rank i+1 (the paper's direction)."""

    def __init__(self, group: ProcessGroup, device: torch.device):
        self.group = group
        self.size = group.size()
        self.rank = group.rank()
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.stream = _P2PStream(device)

    def shift(self, blocks: Sequence[Tensor]) -> _InFlight:
        """Post the sends of ``blocks`` to the previous rank and the receives of the next rank's
        into fresh buffers; ``wait()`` on the result returns them. One rank holds every block."""
        if self.size == 1:
            return _InFlight(list(blocks), [])
        blocks = [block.contiguous() for block in blocks]
        with self.stream.issue(blocks):
            received = [torch.empty_like(block) for block in blocks]
            ops = [dist.P2POp(dist.isend, b, self.prev, self.group) for b in blocks]
            ops += [dist.P2POp(dist.irecv, r, self.next, self.group) for r in received]
            works = dist.batch_isend_irecv(ops)
        return _InFlight(received, works, self.stream)

    def source(self, step: int) -> int:
        """Whose block (group rank) this rank holds at ring step ``step``."""
        return (self.rank + step) % self.size


# ---------------------------------------------------------------------------------------------
# FFN: Algorithms 1 and 2


def _with_bias(shards: list[Tensor], has_bias: bool) -> tuple[Tensor, Tensor | None, Tensor]:
    """(first weight, bias or None, second weight) of shards sent as [first, second(, bias)]."""
    first, second = shards[0], shards[1]
    return first, shards[2] if has_bias else None, second


def _each_ring_shards(
    first: Tensor, bias: Tensor | None, second: Tensor, ring: _Ring
) -> Iterator[tuple[Tensor, Tensor | None, Tensor]]:
    """The (first, bias, second) shards of every ring rank in turn, this rank's first; the next
    ones' receive is posted before the current ones are yielded and waited on after their use."""
    shards = [first, second] if bias is None else [first, second, bias]
    for step in range(ring.size):
        pending = ring.shift(shards) if step < ring.size - 1 else None
        yield _with_bias(shards, bias is not None)
        if pending is not None:
            shards = pending.wait()


def _shard_grads(
    grad: Tensor, first: Tensor, rows: Tensor, grad_second: Tensor, has_bias: bool, grad_x: Tensor
) -> list[Tensor]:
    """One shard's first-linear backward from ``grad``, the gradient of that linear's output: adds
    the input gradient to ``grad_x`` and returns the shard's gradients in the order its shards are
    sent, [first weight, second weight(, bias)] (``grad_second`` the second weight's)."""
    grad_x.addmm_(grad, first)
    grads = [grad.t() @ rows, grad_second]
    if has_bias:
        grads.append(grad.sum(0))
    return grads


def _fc1_act(x: Tensor, w1: Tensor, b1: Tensor | None, act: Activation) -> Tensor:
    return act(torch.nn.functional.linear(x, w1, b1))


class _MetpMLP(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        w1: Tensor,
        b1: Tensor | None,
        w2: Tensor,
        group: ProcessGroup,
        act: Activation,
    ) -> Tensor:
        out = x.new_zeros((*x.shape[:-1], w2.shape[0]))
        for w1_r, b1_r, w2_r in _each_ring_shards(w1, b1, w2, _Ring(group, x.device)):
            tile = _fc1_act(x, w1_r, b1_r, act)
            out.view(-1, out.shape[-1]).addmm_(tile.view(-1, tile.shape[-1]), w2_r.t())
            del tile
        ctx.save_for_backward(x, w1, b1, w2)
        ctx.group, ctx.act = group, act
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        x, w1, b1, w2 = ctx.saved_tensors
        ring = _Ring(ctx.group, x.device)
        rows, grad_rows = x.reshape(-1, x.shape[-1]), grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = torch.zeros_like(rows)
        travelling: _InFlight | None = None  # the held shard's gradient, from its earlier visitors
        for w1_r, b1_r, w2_r in _each_ring_shards(w1, b1, w2, ring):
            with torch.enable_grad():  # f' from autograd on this tile only
                pre = torch.nn.functional.linear(rows, w1_r, b1_r).detach().requires_grad_(True)
                tile = ctx.act(pre)
            grad_w2 = grad_rows.t() @ tile.detach()
            (grad_pre,) = torch.autograd.grad(tile, pre, grad_rows @ w2_r)
            del tile, pre
            grads = _shard_grads(grad_pre, w1_r, rows, grad_w2, b1 is not None, grad_x)
            del grad_pre
            if travelling is not None:
                grads = [g.add_(earlier) for g, earlier in zip(grads, travelling.wait())]
            # the gradients follow their shard; the p-th hop brings them home
            travelling = ring.shift(grads)
        return (grad_x.view_as(x), *_with_bias(travelling.wait(), b1 is not None), None, None)


def metp_mlp(
    x: Tensor,
    w1: Tensor,
    b1: Tensor | None,
    w2: Tensor,
    group: ProcessGroup,
    act: Activation,
) -> Tensor:
    """This rank's tokens through ``act(x W1^T + b1) W2^T`` summed over the group's shards.

    Args:
        x: this rank's tokens, [..., hidden].
        w1, b1: this rank's fc1 shard, [ffn/p, hidden] and [ffn/p] (or None), as megatron-core's
            ``ColumnParallelLinear`` holds it.
        w2: this rank's fc2 shard, [hidden, ffn/p], as ``RowParallelLinear`` holds it.
        group: the METP group (the ring).
        act: an activation applied to one shard's fc1 output at a time (elementwise, or a gated
            linear unit over a shard's [gate; up] columns).

    Returns:
        [..., hidden], without fc2's bias.
    """
    return _MetpMLP.apply(x, w1, b1, w2, group, act)


# ---------------------------------------------------------------------------------------------
# Attention: Algorithms 3-6


@dataclass(frozen=True)
class HeadLayout:
    """How one rank's QKV shard splits (megatron-core's layout: per query group, its queries'
    channels then the key's then the value's)."""

    groups: int  # query groups per rank
    queries_per_group: int
    head_dim: int
    causal: bool
    scale: float

    def split(self, qkv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """[s, b, g * (r + 2) * d] -> q [b, g, r, s, d], k and v [b, g, s, d] (contiguous)."""
        s, b, _ = qkv.shape
        g, r, d = self.groups, self.queries_per_group, self.head_dim
        q, k, v = qkv.view(s, b, g, (r + 2) * d).split([r * d, d, d], dim=-1)
        q = q.reshape(s, b, g, r, d).permute(1, 2, 3, 0, 4).contiguous()
        return q, k.permute(1, 2, 0, 3).contiguous(), v.permute(1, 2, 0, 3).contiguous()

    def join(self, dq: Tensor, dk: Tensor, dv: Tensor) -> Tensor:
        """The inverse of ``split``, for gradients."""
        b, g, r, s, d = dq.shape
        dq = dq.permute(3, 0, 1, 2, 4).contiguous().view(s, b, g, r * d)
        parts = (dq, dk.permute(2, 0, 1, 3), dv.permute(2, 0, 1, 3))
        return torch.cat(parts, dim=-1).view(s, b, -1)

    def context(self, out: Tensor) -> Tensor:
        """[b, g, r, s, d] -> [s, b, g * r * d], megatron-core's core-attention output layout."""
        b, g, r, s, d = out.shape
        return out.permute(3, 0, 1, 2, 4).contiguous().view(s, b, g * r * d)

    def heads(self, context: Tensor) -> Tensor:
        s, b, _ = context.shape
        g, r, d = self.groups, self.queries_per_group, self.head_dim
        return context.view(s, b, g, r, d).permute(1, 2, 3, 0, 4)

    def scores(self, q: Tensor, k: Tensor, query_block: int, key_block: int) -> Tensor | None:
        """Scaled scores of a query block against a key block; None when the mask hides all."""
        if self.causal and key_block > query_block:
            return None
        scores = torch.einsum("bgrqd,bgkd->bgrqk", q, k).mul_(self.scale)
        if self.causal and key_block == query_block:
            hidden = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu_(1)
            scores.masked_fill_(hidden, float("-inf"))
        return scores


def _ring_attention_forward(
    q: Tensor, k: Tensor, v: Tensor, ring: _Ring, layout: HeadLayout
) -> tuple[Tensor, Tensor]:
    """Algorithm 3 with a running maximum: (attention output [b, g, r, s, d], log-sum-exp)."""
    row_max = q.new_full(q.shape[:-1], float("-inf"))
    row_sum = q.new_zeros(q.shape[:-1])
    acc = torch.zeros_like(q)
    blocks = [k, v]
    for step in range(ring.size):
        pending = ring.shift(blocks) if step < ring.size - 1 else None
        scores = layout.scores(q, blocks[0], ring.rank, ring.source(step))
        if scores is not None:
            new_max = torch.maximum(row_max, scores.amax(-1))
            rescale = torch.exp(row_max - new_max)
            probs = scores.sub_(new_max.unsqueeze(-1)).exp_()
            row_sum.mul_(rescale).add_(probs.sum(-1))
            acc.mul_(rescale.unsqueeze(-1)).add_(
                torch.einsum("bgrqk,bgkd->bgrqd", probs, blocks[1])
            )
            row_max = new_max
            del scores, probs
        if pending is not None:
            blocks = pending.wait()
    return acc.div_(row_sum.unsqueeze(-1)), row_max.add_(row_sum.log_())


def _ring_attention_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    grad_out: Tensor,
    ring: _Ring,
    layout: HeadLayout,
) -> tuple[Tensor, Tensor, Tensor]:
    """Algorithm 4: (dq, dk, dv) of this rank's tokens; dk and dv travel with their block."""
    delta = (grad_out * out).sum(-1, keepdim=True)
    grad_q = torch.zeros_like(q)
    blocks = [k, v]
    travelling: _InFlight | None = None
    for step in range(ring.size):
        pending = ring.shift(blocks) if step < ring.size - 1 else None
        key, value = blocks
        scores = layout.scores(q, key, ring.rank, ring.source(step))
        if scores is None:
            grads = [torch.zeros_like(key), torch.zeros_like(value)]
        else:
            probs = scores.sub_(lse.unsqueeze(-1)).exp_()
            grad_value = torch.einsum("bgrqk,bgrqd->bgkd", probs, grad_out)
            grad_scores = torch.einsum("bgrqd,bgkd->bgrqk", grad_out, value)
            grad_scores.sub_(delta).mul_(probs).mul_(layout.scale)
            del probs, scores
            grad_q.add_(torch.einsum("bgrqk,bgkd->bgrqd", grad_scores, key))
            grads = [torch.einsum("bgrqk,bgrqd->bgkd", grad_scores, q), grad_value]
            del grad_scores
        if travelling is not None:
            grads = [g.add_(earlier) for g, earlier in zip(grads, travelling.wait())]
        travelling = ring.shift(grads)
        if pending is not None:
            blocks = pending.wait()
    grad_k, grad_v = travelling.wait()
    return grad_q, grad_k, grad_v


def _broadcast(shards: list[Tensor | None], owner: int, group: ProcessGroup) -> _InFlight:
    """Start broadcasting group rank ``owner``'s shards (its own tensors; buffers elsewhere)."""
    src = dist.get_global_rank(group, owner)
    mine = group.rank() == owner
    tensors = [s if mine else torch.empty_like(s) for s in shards if s is not None]
    works = [dist.broadcast(t, src, group=group, async_op=True) for t in tensors]
    return _InFlight(tensors, works)


def _each_owners_shards(
    first: Tensor, bias: Tensor | None, second: Tensor, group: ProcessGroup
) -> Iterator[tuple[Tensor, Tensor | None, Tensor]]:
    """Every group rank's (first, bias, second) shards in rank order, broadcast from it; the next
    rank's broadcast is posted before the current shards are yielded, so it runs under their use."""
    pending = _broadcast([first, second, bias], 0, group)
    for owner in range(group.size()):
        shards = pending.wait()
        if owner < group.size() - 1:
            pending = _broadcast([first, second, bias], owner + 1, group)
        yield _with_bias(shards, bias is not None)


class _MetpAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        w_qkv: Tensor,
        b_qkv: Tensor | None,
        w_proj: Tensor,
        group: ProcessGroup,
        layout: HeadLayout,
    ) -> Tensor:
        ring = _Ring(group, x.device)
        out = x.new_zeros((*x.shape[:-1], w_proj.shape[0]))
        contexts, lses = [], []
        for w_qkv_j, b_qkv_j, w_proj_j in _each_owners_shards(w_qkv, b_qkv, w_proj, group):
            q, k, v = layout.split(torch.nn.functional.linear(x, w_qkv_j, b_qkv_j))
            attended, lse = _ring_attention_forward(q, k, v, ring, layout)
            del q, k, v
            context = layout.context(attended)
            del attended
            out.view(-1, out.shape[-1]).addmm_(context.view(-1, context.shape[-1]), w_proj_j.t())
            contexts.append(context)
            lses.append(lse)
        ctx.save_for_backward(x, w_qkv, b_qkv, w_proj, *contexts, *lses)
        ctx.group, ctx.layout = group, layout
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        x, w_qkv, b_qkv, w_proj, *saved = ctx.saved_tensors
        group, layout = ctx.group, ctx.layout
        ring = _Ring(group, x.device)
        contexts, lses = saved[: ring.size], saved[ring.size :]
        rows, grad_rows = x.reshape(-1, x.shape[-1]), grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = torch.zeros_like(rows)
        reducing: list[Any] = []  # the previous step's, waited on under this step's compute
        mine: list[Tensor] = []
        owners_shards = _each_owners_shards(w_qkv, b_qkv, w_proj, group)
        for owner, (w_qkv_j, b_qkv_j, w_proj_j) in enumerate(owners_shards):
            context = contexts[owner]
            grad_w_proj = grad_rows.t() @ context.view(-1, context.shape[-1])
            grad_attended = layout.heads((grad_rows @ w_proj_j).view_as(context))
            q, k, v = layout.split(torch.nn.functional.linear(x, w_qkv_j, b_qkv_j))
            dq, dk, dv = _ring_attention_backward(
                q, k, v, layout.heads(context), lses[owner], grad_attended, ring, layout
            )
            del q, k, v, grad_attended
            grad_qkv = layout.join(dq, dk, dv).view(-1, w_qkv_j.shape[0])
            del dq, dk, dv
            grads = _shard_grads(grad_qkv, w_qkv_j, rows, grad_w_proj, b_qkv is not None, grad_x)
            for work in reducing:
                work.wait()
            dst = dist.get_global_rank(group, owner)
            reducing = [dist.reduce(g, dst, group=group, async_op=True) for g in grads]
            if group.rank() == owner:
                mine = grads
        for work in reducing:
            work.wait()
        return (grad_x.view_as(x), *_with_bias(mine, b_qkv is not None), None, None)


def metp_attention(
    x: Tensor,
    w_qkv: Tensor,
    b_qkv: Tensor | None,
    w_proj: Tensor,
    group: ProcessGroup,
    layout: HeadLayout,
) -> Tensor:
    """Self-attention of the group's tokens for this rank's tokens, two-level METP.

    Args:
        x: this rank's tokens, [s/p, b, hidden] (rank i holds the i-th block of the sequence).
        w_qkv, b_qkv: this rank's ``linear_qkv`` shard, [groups/p * (r + 2) * d, hidden] and its
            bias (or None), as megatron-core's ``ColumnParallelLinear`` holds it.
        w_proj: this rank's ``linear_proj`` shard, [hidden, heads/p * d].
        group: the METP group.
        layout: the shard's heads and the mask.

    Returns:
        [s/p, b, hidden], without linear_proj's bias.
    """
    return _MetpAttention.apply(x, w_qkv, b_qkv, w_proj, group, layout)


# ---------------------------------------------------------------------------------------------
# megatron-core submodules


def _shard(
    config: TransformerConfig,
    rows: int,
    columns: int,
    dim: int,
    group: ProcessGroup,
    init: Callable[[Tensor], Any],
) -> nn.Parameter:
    """This rank's shard of a [rows, columns] matrix split along ``dim``, drawn whole and split as
    megatron-core's CPU initialization does (so shards agree with a 1-rank model's seed)."""
    full = torch.empty(rows, columns, dtype=config.params_dtype)
    if config.perform_initialization:
        init(full)
    shard = full.chunk(group.size(), dim=dim)[group.rank()].clone()
    param = nn.Parameter(shard)
    param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, dim, 1
    return param


def _bias(config: TransformerConfig, size: int, sequence_parallel: bool) -> nn.Parameter | None:
    if not config.add_bias_linear:
        return None
    param = nn.Parameter(torch.zeros(size, dtype=config.params_dtype))
    if sequence_parallel:  # applied to this rank's tokens only: summed over the group
        param.sequence_parallel = True
    else:
        param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, 0, 1
    return param


class _Linear(nn.Module):
    """A weight (and bias) under megatron-core's submodule name, so state-dict keys match TP's,
    and checkpointed as megatron-core's TP linears are: sharded over ``group`` along each
    parameter's ``partition_dim`` (the others replicated), so a METP checkpoint and a 1D one hold
    the same tensors."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, group: ProcessGroup):
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.tp_group = group

    def sharded_state_dict(
        self,
        prefix: str = "",
        sharded_offsets: tuple[tuple[int, int, int], ...] = (),
        metadata: dict | None = None,
    ) -> dict[str, Any]:
        from megatron.core.transformer.utils import (
            ensure_metadata_has_dp_cp_group,
            make_sharded_tensors_for_checkpoint,
        )

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        axes = {
            name: param.partition_dim
            for name, param in self.named_parameters()
            if getattr(param, "tensor_model_parallel", False)
        }
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True),
            prefix,
            axes,
            sharded_offsets,
            tp_group=self.tp_group,
            dp_cp_group=metadata["dp_cp_group"],
        )


def _group_size(config: TransformerConfig, group: ProcessGroup) -> int:
    if group.size() != config.tensor_model_parallel_size:
        raise ConfigError(
            "tensor_model_parallel_size",
            f"{config.tensor_model_parallel_size} differs from the METP group's {group.size()} "
            "ranks; set it to the group's size",
        )
    return group.size()


def _experimental(what: str) -> None:
    warnings.warn(f"{what} is experimental (issue 37)", stacklevel=3)


def _gated(act: Activation, x: Tensor) -> Tensor:
    """megatron-core's gated linear unit on a shard's [gate; up] columns: elementwise per shard."""
    gate, up = x.chunk(2, dim=-1)
    return act(gate) * up


class MetpMLP(MegatronModule):
    """megatron-core's ``MLP`` interface computed by ``metp_mlp`` on this rank's tokens."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: Any = None,
        tp_group: ProcessGroup | None = None,
        **_: Any,
    ):
        super().__init__(config=config)
        _experimental("METP MLP")
        self.group = tp_group if tp_group is not None else _default_group()
        self.tp_group = self.group  # megatron-core's sharded_state_dict reads it
        p = _group_size(config, self.group)
        h, ffn = config.hidden_size, config.ffn_hidden_size
        fc1 = 2 * ffn if config.gated_linear_unit else ffn  # a shard: [gate_r; up_r], as TP's
        self.linear_fc1 = _Linear(
            _shard(config, fc1, h, 0, self.group, config.init_method),
            _bias(config, fc1 // p, sequence_parallel=False),
            self.group,
        )
        self.linear_fc2 = _Linear(
            _shard(config, h, ffn, 1, self.group, config.output_layer_init_method),
            _bias(config, h, sequence_parallel=True),
            self.group,
        )
        self.activation_func: Activation = config.activation_func
        if config.gated_linear_unit:
            self.activation_func = functools.partial(_gated, config.activation_func)

    def forward(self, hidden_states: Tensor, **_: Any) -> tuple[Tensor, Tensor | None]:
        """[s/p, b, h] -> ([s/p, b, h], fc2's bias), as megatron-core's MLP returns them."""
        out = metp_mlp(
            hidden_states,
            self.linear_fc1.weight,
            self.linear_fc1.bias,
            self.linear_fc2.weight,
            self.group,
            self.activation_func,
        )
        return out, self.linear_fc2.bias


def _default_group() -> ProcessGroup:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


class MetpSelfAttention(MegatronModule):
    """megatron-core's ``SelfAttention`` interface computed by ``metp_attention``."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: Any = None,
        layer_number: int = 1,
        attn_mask_type: AttnMaskType = AttnMaskType.no_mask,
        pg_collection: Any = None,
        **_: Any,
    ):
        super().__init__(config=config)
        _experimental("METP attention")
        if config.attention_dropout:
            raise ConfigError("attention_dropout", "METP attention has no dropout; set it to 0.0")
        if config.qk_layernorm:
            raise ConfigError("qk_layernorm", "METP attention has no QK norms; set it False")
        if attn_mask_type not in (AttnMaskType.no_mask, AttnMaskType.causal):
            raise ConfigError("attn_mask_type", "METP attention takes no_mask or causal only")
        group = getattr(pg_collection, "tp", None) if pg_collection is not None else None
        self.group = group if group is not None else _default_group()
        self.tp_group = self.group  # megatron-core's sharded_state_dict reads it
        p = _group_size(config, self.group)
        heads, d = config.num_attention_heads, config.kv_channels
        groups = config.num_query_groups or heads
        if groups % p:
            raise ConfigError("num_query_groups", f"{groups} is not divisible by the {p} ranks")
        self.layout = HeadLayout(
            groups=groups // p,
            queries_per_group=heads // groups,
            head_dim=d,
            causal=attn_mask_type == AttnMaskType.causal,
            scale=config.softmax_scale or 1.0 / math.sqrt(d),
        )
        h, qkv = config.hidden_size, (heads + 2 * groups) * d
        with_qkv_bias = config.add_bias_linear or config.add_qkv_bias
        # drawn in megatron-core's order (its Attention builds linear_proj, then SelfAttention
        # linear_qkv), so that a model seeded like its 1D twin starts from the same weights
        self.linear_proj = _Linear(
            _shard(config, h, heads * d, 1, self.group, config.output_layer_init_method),
            _bias(config, h, sequence_parallel=True),
            self.group,
        )
        self.linear_qkv = _Linear(
            _shard(config, qkv, h, 0, self.group, config.init_method),
            _bias(config, qkv // p, sequence_parallel=False) if with_qkv_bias else None,
            self.group,
        )

    def forward(
        self,
        hidden_states: Tensor,
        attention_mask: Tensor | None = None,
        rotary_pos_emb: Any = None,
        **_: Any,
    ) -> tuple[Tensor, Tensor | None]:
        """[s/p, b, h] -> ([s/p, b, h], linear_proj's bias); the mask is the spec's mask type."""
        if attention_mask is not None:
            raise ValueError(
                "attention_mask: METP attention applies its spec's mask type; pass None"
            )
        if rotary_pos_emb is not None:
            raise ValueError("rotary_pos_emb: METP attention has no rotary embeddings yet")
        out = metp_attention(
            hidden_states,
            self.linear_qkv.weight,
            self.linear_qkv.bias,
            self.linear_proj.weight,
            self.group,
            self.layout,
        )
        return out, self.linear_proj.bias


def metp_layer_spec(
    tp_group: ProcessGroup, attn_mask_type: AttnMaskType = AttnMaskType.no_mask
) -> ModuleSpec:
    """A ``TransformerLayer`` whose attention and MLP are METP's, on sequence-sharded tokens.

    Build it with a config of ``sequence_parallel=True`` and ``tensor_model_parallel_size`` the
    group's size (the norms then mark their parameters for the gradient sum over the group).
    ``TransformerLayer`` hands a TP group only to megatron-core's own MLP classes, so the MLP's
    comes in the spec."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add

    from optimus_mllm.runtime.llm import SequenceParallelTorchNorm

    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=SequenceParallelTorchNorm,
            self_attention=ModuleSpec(
                module=MetpSelfAttention, params={"attn_mask_type": attn_mask_type}
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=SequenceParallelTorchNorm,
            mlp=ModuleSpec(module=MetpMLP, params={"tp_group": tp_group}),
            mlp_bda=get_bias_dropout_add,
        ),
    )
