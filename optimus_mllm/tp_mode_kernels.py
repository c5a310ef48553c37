"""The kernel chain of one transformer layer under the TP modes that partition activations
(issues 36, 37): 2D SUMMA, 3D and METP, on one rank of a group of total degree t, for one
microbatch; ``cost_model.layer_kernels`` calls it for a ``LayerShape`` whose ``tp_mode`` is not
1d.

Compute kernels run at the rank's shapes (each does 1/t of the layer's FLOPs); communication is
comm kernels with the papers' volumes, so the scheduler places them like megatron-core's TP
collectives. Each chain sums its algorithm's steps per kind (the q SUMMA steps of a linear are one
broadcast kernel and one GEMM; the p ring steps one P2P kernel and one GEMM per matrix): the chain
prices the layer and its communication, not the interleaving of steps.

- ``2d`` (Xu et al., Algorithms 1-3; Table 1): every linear C = A B broadcasts A's and B's blocks
  over q steps along the grid's rows and columns, each broadcast a binomial tree of log2 q hops
  (the paper's Eq. 4), so (n k_in + k_in k_out) / q elements, log2 q times. Its backward
  broadcasts the same blocks again (A B^T and A^T B) and reduces the gradients' blocks, the same
  volume: twice the forward's, and three times with full recomputation, which is the paper's table
  (backward (21 bsh + 36 h^2) log(p) / (2 sqrt p) against forward (7 bsh + 12 h^2)). Attention
  runs on the rank's b/q sequences and heads/q heads, no communication.
- ``3d`` (Bian et al., Algorithms 1-2): every linear all-gathers its input's block along one
  direction and its weight's along another and reduce-scatters the output along the third, each
  a tensor of 1/p^2 over p ranks: (p - 1) (MN + NK + MK) / p^3 elements a rank sends. Its backward
  all-gathers the output gradient and reduce-scatters the input's and the weight's gradients (the
  gathered input and weight were kept), the same volume.
- ``metp`` (Liang et al., Algorithms 1-6; Tables 1-2): the MLP's fc1/fc2 shards travel the ring,
  p - 1 hops; its backward sends them again (it recomputes the tiles) and sends their gradients:
  24 (p - 1) / p h^2 in all at an FFN of 4h. Attention broadcasts the QKV and output projection
  shards (log2 p hops each) and rings K and V; its backward broadcasts the shards again, reduces
  their gradients and rings K, V and their gradients: 12 log2(p) h^2 + 6 (p - 1) / p bsh in all.
  The backward recomputes the QKV projection and fc1 (the forward keeps neither).

Biases and norm weights (O(h) per layer) move too and are left out, as the papers' tables leave
them out; the norms' per-token statistics in 2D and 3D likewise.
"""

from __future__ import annotations

from collections.abc import Callable

from optimus_mllm.cost_model import Collective, KernelWork, LayerShape, Phase
from optimus_mllm.tp_memory import mode_degree

Linear = Callable[[str, int, int, Phase], list[KernelWork]]


def mode_layer_kernels(shape: LayerShape, phase: Phase) -> list[KernelWork]:
    """The kernels of one layer's forward or backward under ``shape.tp_mode``, in order."""
    build = {"2d": _summa_2d, "3d": _cube_3d, "metp": _metp}[shape.tp_mode]
    forward, backward = build(_Rank(shape))
    if phase == "fwd":
        return forward
    if shape.recompute == "full":
        return [_recomputed(k) for k in forward] + backward
    return backward


class _Rank:
    """One rank's view of a layer: the microbatch's tokens, the linears' widths, and the kernels
    at its element size."""

    def __init__(self, shape: LayerShape):
        s = shape.spec
        self.shape = shape
        self.t = shape.tp
        self.tokens = shape.tokens
        self.h = s.hidden_size
        self.context = s.num_attention_heads * s.head_dim
        self.kv = s.query_groups * s.head_dim
        self.qkv = self.context + 2 * self.kv
        self.ffn = s.ffn_hidden_size
        self.fc1 = 2 * self.ffn if s.gated_linear_unit else self.ffn
        self.e = shape.dtype_bytes

    def widths(self, name: str) -> tuple[int, int]:
        """(input width, output width) of a linear."""
        return {
            "qkv": (self.h, self.qkv),
            "attn_proj": (self.context, self.h),
            "fc1": (self.h, self.fc1),
            "fc2": (self.ffn, self.h),
        }[name]

    def gemm(self, name: str, phase: Phase, rows: float, k_in: float, k_out: float) -> KernelWork:
        """A GEMM of ``rows`` rows; its backward the input's and the weight's gradients."""
        scale = 2 if phase == "bwd" else 1
        traffic = (rows * k_in + k_in * k_out + rows * k_out) * self.e
        return KernelWork(name, phase, "gemm", scale * 2.0 * rows * k_in * k_out, scale * traffic)

    def comm(
        self, name: str, phase: Phase, elements: float, collective: Collective, group: int
    ) -> KernelWork:
        return KernelWork(name, phase, "comm", 0.0, elements * self.e, collective, group)

    def memory(self, name: str, phase: Phase, elements: float) -> KernelWork:
        """An elementwise kernel (a norm, the activation) over ``elements`` elements."""
        scale = 2 if phase == "bwd" else 1
        return KernelWork(name, phase, "memory", 8.0 * elements, scale * 2 * elements * self.e)

    def attention(self, phase: Phase) -> KernelWork:
        """The core attention's 1/t share of the microbatch's QK^T and PV, flash-style (no s^2
        tensor in HBM); its backward twice the FLOPs, as ``cost_model`` counts it."""
        s, scale = self.shape.spec, 2 if phase == "bwd" else 1
        flops = 4.0 * self.shape.micro_batch_size * s.num_attention_heads * s.layer_tokens**2
        traffic = self.tokens * (self.qkv + self.context) * self.e / self.t
        return KernelWork(
            "attn_core", phase, "attention", scale * flops * s.head_dim / self.t, scale * traffic
        )


def _recomputed(k: KernelWork) -> KernelWork:
    return KernelWork(
        "recompute_" + k.name, "bwd", k.kind, k.flops, k.bytes, k.collective, k.group_size
    )


def _layer(rank: _Rank, linear: Linear) -> tuple[list[KernelWork], list[KernelWork]]:
    """Forward and backward chains of a layer whose linears are ``linear``'s kernels, its norms,
    attention and activation running on the rank's 1/t of the elements."""
    per_rank = rank.tokens / rank.t

    def lin(name: str, phase: Phase) -> list[KernelWork]:
        return linear(name, *rank.widths(name), phase)

    def elementwise(name: str, phase: Phase, width: int) -> KernelWork:
        return rank.memory(name, phase, per_rank * width)

    forward = [
        elementwise("ln_attn", "fwd", rank.h),
        *lin("qkv", "fwd"),
        rank.attention("fwd"),
        *lin("attn_proj", "fwd"),
        elementwise("ln_mlp", "fwd", rank.h),
        *lin("fc1", "fwd"),
        elementwise("act", "fwd", rank.fc1),
        *lin("fc2", "fwd"),
    ]
    backward = [
        *lin("fc2", "bwd"),
        elementwise("act", "bwd", rank.fc1),
        *lin("fc1", "bwd"),
        elementwise("ln_mlp", "bwd", rank.h),
        *lin("attn_proj", "bwd"),
        rank.attention("bwd"),
        *lin("qkv", "bwd"),
        elementwise("ln_attn", "bwd", rank.h),
    ]
    return forward, backward


def _summa_2d(rank: _Rank) -> tuple[list[KernelWork], list[KernelWork]]:
    q, n = mode_degree("2d", rank.t), rank.tokens

    def linear(name: str, k_in: int, k_out: int, phase: Phase) -> list[KernelWork]:
        blocks = (n * k_in + k_in * k_out) / q  # A's and B's blocks over the q steps
        bcast = rank.comm(f"summa_bcast_{name}", phase, blocks, "broadcast", q)
        # q steps of a (n/q x k_in/q) by (k_in/q x k_out/q) product: one of k_in
        gemm = rank.gemm(name, phase, n / q, k_in, k_out / q)
        if phase == "fwd":
            return [bcast, gemm]
        return [bcast, gemm, rank.comm(f"summa_reduce_{name}", phase, blocks, "reduce", q)]

    return _layer(rank, linear)


def _cube_3d(rank: _Rank) -> tuple[list[KernelWork], list[KernelWork]]:
    p, n = mode_degree("3d", rank.t), rank.tokens

    def linear(name: str, k_in: int, k_out: int, phase: Phase) -> list[KernelWork]:
        x, weight, y = n * k_in / p**2, k_in * k_out / p**2, n * k_out / p**2
        gemm = rank.gemm(name, phase, n / p, k_in / p, k_out / p)
        if phase == "fwd":
            return [
                rank.comm(f"cube_ag_in_{name}", phase, x, "all_gather", p),
                rank.comm(f"cube_ag_w_{name}", phase, weight, "all_gather", p),
                gemm,
                rank.comm(f"cube_rs_out_{name}", phase, y, "reduce_scatter", p),
            ]
        return [
            rank.comm(f"cube_ag_out_{name}", phase, y, "all_gather", p),
            gemm,
            rank.comm(f"cube_rs_in_{name}", phase, x, "reduce_scatter", p),
            rank.comm(f"cube_rs_w_{name}", phase, weight, "reduce_scatter", p),
        ]

    return _layer(rank, linear)


def _metp(rank: _Rank) -> tuple[list[KernelWork], list[KernelWork]]:
    p, r = rank.t, rank
    tokens = r.tokens / p  # the rank's own tokens, as megatron-core's sequence parallelism
    attn_shards = r.qkv * r.h + r.h * r.context  # broadcast over the p outer steps
    mlp_ring = (p - 1) / p * (r.fc1 * r.h + r.h * r.ffn)  # every shard but the rank's own
    kv_ring = (p - 1) * tokens * 2 * r.kv  # each outer step's K and V blocks, p - 1 hops

    def gemm(name: str, phase: Phase) -> KernelWork:
        return r.gemm(name, phase, tokens, *r.widths(name))

    forward = [
        r.memory("ln_attn", "fwd", tokens * r.h),
        r.comm("metp_bcast_attn", "fwd", attn_shards, "broadcast", p),
        gemm("qkv", "fwd"),
        r.comm("metp_p2p_kv", "fwd", kv_ring, "p2p", p),
        r.attention("fwd"),
        gemm("attn_proj", "fwd"),
        r.memory("ln_mlp", "fwd", tokens * r.h),
        r.comm("metp_p2p_mlp", "fwd", mlp_ring, "p2p", p),
        gemm("fc1", "fwd"),
        r.memory("act", "fwd", tokens * r.fc1),
        gemm("fc2", "fwd"),
    ]
    backward = [
        r.comm("metp_p2p_mlp", "bwd", mlp_ring, "p2p", p),
        _recomputed(gemm("fc1", "fwd")),
        _recomputed(r.memory("act", "fwd", tokens * r.fc1)),
        gemm("fc2", "bwd"),
        r.memory("act", "bwd", tokens * r.fc1),
        gemm("fc1", "bwd"),
        r.comm("metp_p2p_mlp_grad", "bwd", mlp_ring, "p2p", p),
        r.memory("ln_mlp", "bwd", tokens * r.h),
        r.comm("metp_bcast_attn", "bwd", attn_shards, "broadcast", p),
        _recomputed(gemm("qkv", "fwd")),
        gemm("attn_proj", "bwd"),
        r.comm("metp_p2p_kv", "bwd", kv_ring, "p2p", p),
        r.attention("bwd"),
        r.comm("metp_p2p_kv_grad", "bwd", kv_ring, "p2p", p),
        gemm("qkv", "bwd"),
        r.comm("metp_reduce_attn_grad", "bwd", attn_shards, "reduce", p),
        r.memory("ln_attn", "bwd", tokens * r.h),
    ]
    return forward, backward
