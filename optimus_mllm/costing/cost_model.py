"""Per-kernel work and durations of transformer layers, TP/PP/DP communication.

Every kernel has a stable name (``qkv``, ``attn_core``, ``tp_rs_attn`` ...), so durations can come
either from a roofline over the kernel's FLOPs and bytes or from a measured JSON profile
(``optimus-profile`` writes one on a GPU or on CPU ranks) keyed by (module, kernel, phase, tp).
Communication comes from the profile's fits where it measured the collective at the group's size
(latency plus bytes over a rate, on the job's own groups), from the link bandwidths otherwise.

Shapes follow Megatron's tensor parallelism: column-parallel QKV and fc1, row-parallel output
projection and fc2; with sequence parallelism each half-layer starts with an all-gather and ends
with a reduce-scatter, without it ends with an all-reduce (and its backward all-reduce sits before
the QKV/fc1 input gradient). A layer under another TP mode (2d, 3d, metp) is
its paper's chain (the section at the end).
"""

from __future__ import annotations

import copy
import math
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, NoReturn

from optimus_mllm.config import (
    ClusterConfig,
    CostModelConfig,
    OptimusConfig,
    TPMode,
    TransformerSpec,
)
from optimus_mllm.config.files import read_versioned_json
from optimus_mllm.costing.tp_memory import mode_degree
from optimus_mllm.errors import ConfigError, OptimusError

Phase = Literal["fwd", "bwd"]
KernelClass = Literal["gemm", "attention", "memory", "comm"]
# broadcast and reduce: the 2D and METP papers' binomial trees (SUMMA's steps, METP's projection
# shards)
Collective = Literal["all_gather", "reduce_scatter", "all_reduce", "p2p", "broadcast", "reduce"]

PROFILE_FORMAT = "optimus-kernel-profile"
PROFILE_VERSION = 2
# The kernels the runtime runs, so the ones a profile must have timed: megatron-core's local layers
# with torch's scaled_dot_product_attention as the core attention (runtime/llm.py) and the encoder's
# own steps, SDPA too (runtime/layer_ops.py). transformer-engine and flash-attn layers are not run
# yet.
KERNEL_SET = "torch-sdpa"

# A layer's compute kernels, and the pieces of them (a share of their token rows, cut to fit a short
# bubble), are priced as an H100-class GPU runs them. A GEMM computes its output in TILE x TILE
# tiles, one per SM at a time, in waves of SMS tiles: a kernel whose tiles fill its last wave only
# in part takes that whole wave's time for a fraction of its work (tile and wave quantization:
# ``wave_factor``), and a piece of a few rows fills only part of a wave; flash-style attention does
# the same per (batch, head, TILE queries). A calibration's efficiencies are those of full waves. A
# GEMM with fewer tiles than SMs splits its inner dimension over the idle SMs (cuBLAS's split-K;
# the partial sums' reduction is not charged), attention does not. Every piece also streams what
# it cannot share with the other pieces (a GEMM's weights) from HBM. cuBLAS picks its tile per
# shape; 128 x 128 is its usual bf16 tile on Hopper and what the model assumes. A measured profile
# times whole kernels only, so the pieces of a measured kernel keep this shape, scaled to the
# measured time; kernels without a ``PieceShape`` (the LLM's embedding and output layer, the patch
# embedding, other TP modes' kernels) are priced at full waves.
# a backward's rerun of a forward kernel (activation recomputation) is named this plus its name
RECOMPUTE_PREFIX = "recompute_"
SMS = 132  # streaming multiprocessors of an H100 SXM
TILE = 128  # rows and columns of one output tile; pieces are whole blocks of TILE token rows


@dataclass(frozen=True)
class PieceShape:
    """How a splittable kernel's work divides over its token rows (see ``CostModel.piece_us``).

    ``in_tiles`` / ``out_tiles``: the output tiles one block of TILE rows makes in backward (a
    GEMM's input gradient, as wide as its input) and forward (as wide as its output); attention's
    are its (batch, head) pairs both ways; 0 for a memory-bound kernel, whose time is its rows'
    share. ``fixed_bytes``: the HBM traffic every piece repeats in forward, whatever its rows (a
    GEMM's weights, attention's keys and values); a backward piece repeats it twice (a GEMM also
    writes its weight gradient).
    """

    rows: int
    in_tiles: int = 0
    out_tiles: int = 0
    fixed_bytes: float = 0.0

    @property
    def blocks(self) -> int:
        return -(-self.rows // TILE)


@dataclass(frozen=True)
class PiecePrices:
    """What the pieces of one splittable kernel take: ``us[k]`` a piece of k of its ``blocks`` row
    blocks, for 0 < k < blocks, launch and any recomputation included (``us[0]`` is 0). Found once
    per kernel, so the scheduler's inner loop only looks them up; a piece is never the whole kernel,
    whose time is its own duration."""

    us: tuple[float, ...]

    @property
    def blocks(self) -> int:
        return len(self.us)

    def most_blocks(self, room_us: float) -> int:
        """The most blocks a piece of at most ``room_us`` holds (0: not even one)."""
        return bisect_right(self.us, room_us) - 1


@dataclass(frozen=True)
class RingStep:
    """A METP ring P2P (Liang et al. §3.3): while a rank multiplies its ``rows_per_rank`` rows
    (m / p) by the shards it holds, it sends them on (double buffering); ``element_bytes`` of the
    shards' elements."""

    rows_per_rank: float
    element_bytes: int


def overlap_rows_threshold(
    peak_flops_per_s: float, link_bytes_per_s: float, element_bytes: int
) -> float:
    """The rows per rank (m / p) above which METP's ring hides its P2P under its GEMMs (Liang et
    al. §3.3, Eq. 5).

    A ring step multiplies the rank's m/p rows by k1 x k2 and k2 x n shards (2 (m/p) (k1 k2 + k2 n)
    / p FLOPs) while it sends those shards on (e (k1 k2 + k2 n) / p bytes at e bytes an element):
    an arithmetic intensity of 2 (m/p) / e FLOPs a byte, m/p itself at 16 bits. The GEMMs outlast
    the send when that is above the device's FLOP/s over the link's bytes/s (the A100's 312 TFLOPS
    over NVLink's 300 GB/s: 1040 rows at 16 bits). The backward's intensity is higher (Eq. 6), so
    the forward's bounds both.

    Args:
        peak_flops_per_s: the GEMMs' rate.
        link_bytes_per_s: the ring link's rate, one direction.
        element_bytes: bytes of one element of the shards sent.

    Returns:
        The threshold in rows per rank.
    """
    return peak_flops_per_s / link_bytes_per_s * element_bytes / 2


def ring_exposed_share(rows_per_rank: float, threshold: float) -> float:
    """The share of a ring step's send its GEMMs leave exposed: none at or above ``threshold``
    rows per rank, else what the send outlasts the GEMMs by, as a share of the send (the GEMMs
    take rows / threshold of its time)."""
    return max(0.0, 1.0 - rows_per_rank / threshold)


@dataclass(frozen=True)
class KernelWork:
    """What one kernel does, before it is turned into time.

    For compute kernels ``bytes`` is HBM traffic; for communication kernels it is the size of the
    whole (gathered / reduced) tensor, and ``group_size`` the ranks taking part.
    """

    name: str
    phase: Phase
    kind: KernelClass
    flops: float = 0.0
    bytes: float = 0.0
    collective: Collective | None = None
    group_size: int = 1
    piece: PieceShape | None = None  # a layer's compute kernel: how its rows can be cut
    ring: RingStep | None = None  # a METP ring P2P: the GEMMs it runs under

    @property
    def is_comm(self) -> bool:
        return self.kind == "comm"


@dataclass(frozen=True)
class Kernel:
    """A costed kernel: the unit the bubble scheduler places."""

    name: str
    phase: Phase
    is_comm: bool
    duration_us: float
    flops: float


@dataclass(frozen=True)
class LayerShape:
    """A transformer layer as one TP rank runs it for one microbatch."""

    spec: TransformerSpec
    tp: int
    micro_batch_size: int
    sequence_parallel: bool
    dtype_bytes: int
    recompute: Literal["none", "selective", "full"] = "none"
    tp_mode: TPMode = "1d"

    @property
    def tokens(self) -> int:
        return self.spec.layer_tokens * self.micro_batch_size


def layer_kernels(shape: LayerShape, phase: Phase) -> list[KernelWork]:
    """The kernels of one layer's forward or backward, in execution order."""
    if shape.tp_mode != "1d":
        return _mode_layer_kernels(shape, phase)
    fwd = _forward_kernels(shape)
    if phase == "fwd":
        return fwd
    bwd: list[KernelWork] = []
    if shape.recompute == "full":
        bwd += [_renamed(k, RECOMPUTE_PREFIX + k.name, "bwd") for k in fwd]
    mlp_starts = next(i for i, k in enumerate(fwd) if k.name == "ln_mlp")
    for half in (fwd[mlp_starts:], fwd[:mlp_starts]):  # the MLP half first, backwards
        bwd += _half_backward(half, shape.recompute)
    return bwd


def _half_backward(half: list[KernelWork], recompute: str) -> list[KernelWork]:
    """Backward of [norm, (all-gather), GEMM, ..., GEMM, reduce]: the adjoint collectives in place.

    With sequence parallelism the output reduce-scatter's adjoint all-gathers the gradient first and
    the input all-gather's adjoint reduce-scatters it before the norm. Without it, the output
    all-reduce's adjoint is free and the input copy's adjoint all-reduces the partial input gradient
    of the first GEMM, so it follows that GEMM's backward.
    """
    norm, body = half[0], half[1:]
    comm = [k for k in body if k.is_comm]
    compute = [k for k in body if not k.is_comm]
    out: list[KernelWork] = []
    if any(k.collective == "reduce_scatter" for k in comm):
        out.append(
            _adjoint(next(k for k in comm if k.collective == "reduce_scatter"), "all_gather")
        )
    for k in reversed(compute):
        # Korthikanti: recompute the core only
        if k.kind == "attention" and recompute == "selective":
            out.append(_renamed(k, RECOMPUTE_PREFIX + k.name, "bwd"))
        scale = 2 if k.kind in ("gemm", "attention") else 1  # dgrad + wgrad
        out.append(KernelWork(k.name, "bwd", k.kind, scale * k.flops, 2 * k.bytes, piece=k.piece))
    if any(k.collective == "all_gather" for k in comm):
        out.append(
            _adjoint(next(k for k in comm if k.collective == "all_gather"), "reduce_scatter")
        )
    elif any(k.collective == "all_reduce" for k in comm):
        out.append(_adjoint(next(k for k in comm if k.collective == "all_reduce"), "all_reduce"))
    out.append(
        KernelWork(norm.name, "bwd", norm.kind, norm.flops, 2 * norm.bytes, piece=norm.piece)
    )
    return out


def _renamed(k: KernelWork, name: str, phase: Phase) -> KernelWork:
    return KernelWork(
        name, phase, k.kind, k.flops, k.bytes, k.collective, k.group_size, k.piece, k.ring
    )


def _adjoint(k: KernelWork, collective: Collective) -> KernelWork:
    name = {
        "all_gather": k.name.replace("_rs_", "_ag_"),
        "reduce_scatter": k.name.replace("_ag_", "_rs_"),
        "all_reduce": k.name,
    }[collective]
    return KernelWork(name, "bwd", "comm", 0.0, k.bytes, collective, k.group_size)


def _forward_kernels(shape: LayerShape) -> list[KernelWork]:
    s, t, b = shape.spec, shape.tp, shape.dtype_bytes
    n, h, d = shape.tokens, s.hidden_size, s.head_dim
    q_width, kv_width = s.num_attention_heads * d // t, s.query_groups * d // t
    ffn = s.ffn_hidden_size // t
    fc1_out = 2 * ffn if s.gated_linear_unit else ffn
    sp = shape.sequence_parallel and t > 1
    local_tokens = n // t if sp else n  # sequence-parallel regions hold 1/t of the tokens
    act = n * h * b  # one full activation tensor

    def gemm(name: str, k_in: int, k_out: int) -> KernelWork:
        piece = PieceShape(n, -(-k_in // TILE), -(-k_out // TILE), k_in * k_out * b)
        return KernelWork(
            name,
            "fwd",
            "gemm",
            2.0 * n * k_in * k_out,
            (n * k_in + k_in * k_out + n * k_out) * b,
            piece=piece,
        )

    def norm(name: str) -> KernelWork:
        return KernelWork(
            name,
            "fwd",
            "memory",
            8.0 * local_tokens * h,
            2 * local_tokens * h * b,
            piece=PieceShape(local_tokens),
        )

    def tp_comm(name: str, collective: Collective) -> KernelWork:
        return KernelWork(name, "fwd", "comm", 0.0, act, collective, t)

    heads = s.num_attention_heads // t
    pairs = shape.micro_batch_size * heads  # a piece takes some queries of every sequence
    attn_core = KernelWork(
        "attn_core",
        "fwd",
        "attention",
        4.0 * shape.micro_batch_size * heads * s.layer_tokens**2 * d,  # QK^T and PV
        (n * (q_width + 2 * kv_width) + n * q_width) * b,  # flash-style: no s^2 tensor in HBM
        piece=PieceShape(s.layer_tokens, pairs, pairs, 2 * n * kv_width * b),  # every key, value
    )
    kernels = [norm("ln_attn")]
    if t > 1 and sp:
        kernels.append(tp_comm("tp_ag_attn", "all_gather"))
    kernels += [gemm("qkv", h, q_width + 2 * kv_width), attn_core, gemm("attn_proj", q_width, h)]
    if t > 1:
        kernels.append(
            tp_comm("tp_rs_attn", "reduce_scatter") if sp else tp_comm("tp_ar_attn", "all_reduce")
        )
    kernels.append(norm("ln_mlp"))
    if t > 1 and sp:
        kernels.append(tp_comm("tp_ag_mlp", "all_gather"))
    kernels += [
        gemm("fc1", h, fc1_out),
        KernelWork(
            "act",
            "fwd",
            "memory",
            8.0 * n * fc1_out,
            (n * fc1_out + n * ffn) * b,
            piece=PieceShape(n),
        ),
        gemm("fc2", ffn, h),
    ]
    if t > 1:
        kernels.append(
            tp_comm("tp_rs_mlp", "reduce_scatter") if sp else tp_comm("tp_ar_mlp", "all_reduce")
        )
    return kernels


def collective_bytes_on_wire(collective: Collective, tensor_bytes: float, group_size: int) -> float:
    """Bytes each rank sends in a ring collective over a tensor of ``tensor_bytes``; a tree
    broadcast or reduce takes log2(group) hops of the whole tensor (Eq. 4 of the 2D paper)."""
    if collective == "p2p":
        return tensor_bytes
    if group_size <= 1:
        return 0.0
    if collective in ("broadcast", "reduce"):
        return math.log2(group_size) * tensor_bytes
    factor = (group_size - 1) / group_size
    return 2 * factor * tensor_bytes if collective == "all_reduce" else factor * tensor_bytes


def group_bandwidth_gbps(cluster: ClusterConfig, group_size: int, rank_stride: int) -> float:
    """NVLink when the group's ranks (``rank_stride`` apart) fit in one node, else the network."""
    span = (group_size - 1) * rank_stride + 1
    return (
        cluster.intra_node_bandwidth_gbps
        if span <= cluster.gpus_per_node
        else cluster.inter_node_bandwidth_gbps
    )


class CostModel:
    """Turns kernel work into microseconds: measured profile first, roofline otherwise."""

    def __init__(
        self,
        cluster: ClusterConfig,
        params: CostModelConfig,
        profile: dict[tuple, float] | None = None,
        comm_fits: dict[tuple[str, int], CommFit] | None = None,
        device_kind: str = "cuda",
        step_noise: float = 0.0,
        optimizer_us_per_param: float = 0.0,
        layer_host_us: dict[tuple[str, Phase], float] | None = None,
        profile_shapes: dict[tuple, tuple[float, float]] | None = None,
        microbatch_host_us: float = 0.0,
    ):
        self.cluster = cluster
        self.params = params
        self.profile = profile or {}
        # per profile key, where the profile records it: the (FLOPs, bytes) its time was taken at
        self.profile_shapes = profile_shapes or {}
        self.comm_fits = comm_fits or {}
        self.device_kind = device_kind  # what the profile measured; the roofline's is a GPU
        # the share by which a step's time varies run to run (the profile's); 0 for the roofline
        self.step_noise = step_noise
        # the optimizer step's host time per parameter (the profile's); 0 for the roofline, which
        # prices only a step's kernels and collectives
        self.optimizer_us_per_param = optimizer_us_per_param
        # per (module, phase): the host work one layer adds to its kernels (the profile's); none
        # for the roofline, whose kernels are a GPU's, launched ahead of the host
        self.layer_host_us = layer_host_us or {}
        # the host work megatron-core's pipeline schedule adds to each LLM op (one chunk's forward
        # or backward of one microbatch) beyond its layers: the step around the forward and
        # backward, its P2P, data and gradient hooks (the profile's ``step_host``); 0 for the
        # roofline
        self.microbatch_host_us = microbatch_host_us

    def with_microbatch_host(self, microbatch_host_us: float) -> CostModel:
        """This cost model with another host cost per LLM op (the profile's fit tries several)."""
        other = copy.copy(self)
        other.microbatch_host_us = microbatch_host_us
        return other

    @classmethod
    def from_config(cls, config: OptimusConfig) -> CostModel:
        path = config.cost_model.profile
        if not path:
            return cls(config.cluster, config.cost_model)
        machine = read_machine_profile(path)
        return cls(
            config.cluster,
            config.cost_model,
            {m.key: m.time_us for m in machine.kernels},
            machine.comm_fits,
            machine.device_kind,
            machine.step_noise,
            machine.optimizer_us_per_param,
            machine.layer_host_us,
            {
                m.key: (float(m.flops), float(m.bytes))
                for m in machine.kernels
                if m.flops is not None and m.bytes is not None
            },
            machine.microbatch_host_us,
        )

    def optimizer_us(self, params: float) -> float:
        """One optimizer step over ``params`` parameters on one rank."""
        return self.optimizer_us_per_param * params

    @property
    def encoder_runs_beside_the_llm(self) -> bool:
        """A GPU runs the encoder's kernels on a side stream while the LLM's stream waits; CPU
        ranks run them inline, on the thread that does the LLM's work and waits."""
        return self.device_kind == "cuda"

    def measured_us(self, work: KernelWork, module: str, tp: int) -> float | None:
        """The profile's time for ``work``, or None where it has none. A profile times each kernel
        at the config's shape, one image a sample; the same kernel at another size (an encoder
        microbatch of more images, other tokens per image) is priced as that time scaled by its
        work: FLOPs for GEMMs and attention, bytes for the rest (unscaled where the profile does
        not record its shape)."""
        key = (module, work.name, work.phase, tp)
        measured = self.profile.get(key)
        if measured is None or key not in self.profile_shapes:
            return measured
        flops, nbytes = self.profile_shapes[key]
        if work.kind in ("gemm", "attention") and flops > 0:
            return measured * work.flops / flops
        return measured * work.bytes / nbytes if nbytes > 0 else measured

    def compute_us(self, work: KernelWork, module: str, tp: int) -> float:
        measured = self.measured_us(work, module, tp)
        if measured is not None:
            return measured
        p = self.params
        peak = self.cluster.peak_tflops * 1e12
        eff_field = "attention_efficiency" if work.kind == "attention" else "gemm_efficiency"
        eff = getattr(p, eff_field)
        flop_time = (
            work.flops / (peak * eff) * wave_factor(work)
            if work.kind in ("gemm", "attention")
            else 0.0
        )
        if not math.isfinite(flop_time * 1e6):
            _raise_not_finite(work, f"cost_model.{eff_field}", eff, work.flops / peak * 1e6)
        bandwidth = self.cluster.hbm_bandwidth_gbps * 1e9
        mem_time = work.bytes / (bandwidth * p.memory_efficiency)
        if not math.isfinite(mem_time * 1e6):
            _raise_not_finite(
                work,
                "cost_model.memory_efficiency",
                p.memory_efficiency,
                work.bytes / bandwidth * 1e6,
            )
        return max(flop_time, mem_time) * 1e6 + p.kernel_overhead_us

    def comm_us(
        self, work: KernelWork, bandwidth_gbps: float, module: str = "", tp: int = 0
    ) -> float:
        measured = self.measured_us(work, module, tp)
        if measured is not None:
            return measured
        assert work.collective is not None
        fit = self.comm_fits.get((work.collective, work.group_size))
        if fit is not None and work.ring is None:  # a METP ring step hides under its GEMMs
            return fit.us(work.bytes)
        wire = collective_bytes_on_wire(work.collective, work.bytes, work.group_size)
        exposed = self._ring_exposed_share(work, bandwidth_gbps)
        if wire == 0 or exposed == 0:
            return 0.0
        eff = self._link_efficiency(bandwidth_gbps)
        us = exposed * wire / (bandwidth_gbps * 1e9 * eff) * 1e6
        if not math.isfinite(us):
            field = (
                "cost_model.nvlink_efficiency"
                if eff != self.params.network_efficiency
                else "cost_model.network_efficiency"
            )
            _raise_not_finite(work, field, eff, wire / bandwidth_gbps / 1e3)
        return us + self.params.kernel_overhead_us

    def _ring_exposed_share(self, work: KernelWork, bandwidth_gbps: float) -> float:
        """The share of a METP ring step's P2P that its GEMMs do not hide (1 for any other comm
        kernel), at the rates this model gives GEMMs and the link (``ring_exposed_share``)."""
        if work.ring is None:
            return 1.0
        threshold = overlap_rows_threshold(
            self.cluster.peak_tflops * 1e12 * self.params.gemm_efficiency,
            bandwidth_gbps * 1e9 * self._link_efficiency(bandwidth_gbps),
            work.ring.element_bytes,
        )
        return ring_exposed_share(work.ring.rows_per_rank, threshold)

    def _link_efficiency(self, bandwidth_gbps: float) -> float:
        """NVLink's own efficiency where one is set (a group inside a node gets the node's
        bandwidth from ``group_bandwidth_gbps``), else the one for every link."""
        nvlink = self.params.nvlink_efficiency
        if nvlink is not None and bandwidth_gbps == self.cluster.intra_node_bandwidth_gbps:
            return nvlink
        return self.params.network_efficiency

    def piece_us(
        self, work: KernelWork, whole_us: float, lo: float, hi: float, recompute_us: float = 0.0
    ) -> float:
        """A piece [lo, hi) (fractions of its row blocks) of a kernel whose whole run takes
        ``whole_us`` (launch included: the roofline's or a measured time).

        Compute: the whole kernel's time (less its launch) over the waves its tiles fill, times the
        waves the piece's tiles fill; a backward GEMM's weight gradient (half its FLOPs, its share
        of the time ``wave_factor``'s) reduces over the rows, so that part scales with the piece's
        rows instead. Memory: the piece's share
        of the kernel's traffic plus what every piece repeats (``PieceShape.fixed_bytes``). A
        backward piece of a kernel that is not a GEMM first recomputes its forward on the piece's
        rows (``runtime/encoder_ops``), ``recompute_us`` being that whole forward, launch excluded.
        """
        piece = work.piece
        assert piece is not None, f"{work.name} cannot run as pieces"
        share = hi - lo
        body = whole_us - self.params.kernel_overhead_us
        if piece.out_tiles == 0:  # memory-bound: its rows' share
            compute = body * share
        else:
            tiles, depth = (
                (piece.in_tiles, piece.out_tiles)
                if work.phase == "bwd"
                else (piece.out_tiles, piece.in_tiles)
            )
            depth = depth if work.kind == "gemm" else 1  # split-K is a GEMM's
            blocks = round(share * piece.blocks)
            quantized = _waves(blocks * tiles, depth) / _waves(piece.blocks * tiles, depth)
            weight_grad = _weight_grad_share(work) if work.kind == "gemm" else 0.0
            compute = body * ((1 - weight_grad) * quantized + weight_grad * share)
        repeated = piece.fixed_bytes * (2 if work.phase == "bwd" else 1)
        memory = ((work.bytes - repeated) * share + repeated) / self._hbm_bytes_per_us()
        return max(compute, memory) + self.params.kernel_overhead_us + recompute_us * share

    def piece_prices(
        self, work: KernelWork, whole_us: float, recompute_us: float = 0.0
    ) -> PiecePrices | None:
        """Every piece of the kernel, by its number of row blocks; None if it has fewer than two."""
        if work.piece is None or work.piece.blocks < 2:
            return None
        n = work.piece.blocks
        return PiecePrices(
            (0.0,)
            + tuple(self.piece_us(work, whole_us, 0.0, k / n, recompute_us) for k in range(1, n))
        )

    def _hbm_bytes_per_us(self) -> float:
        return self.cluster.hbm_bandwidth_gbps * 1e3 * self.params.memory_efficiency

    def layer(
        self, shape: LayerShape, phase: Phase, module: str, tp_bandwidth_gbps: float
    ) -> list[Kernel]:
        """Costed kernels of one layer's forward or backward on one TP rank: each compute kernel
        its time plus an even share of the layer's measured host work (``layer_host_us``), which
        does not shrink with the TP shard."""
        works = layer_kernels(shape, phase)
        computes = sum(not work.is_comm for work in works)
        host_us = self.layer_host_us.get((module, phase), 0.0) / max(computes, 1)
        kernels = []
        for work in works:
            if work.is_comm:
                us = self.comm_us(work, tp_bandwidth_gbps, module, shape.tp)
            else:
                us = self.compute_us(work, module, shape.tp) + host_us
            kernels.append(Kernel(work.name, work.phase, work.is_comm, us, work.flops))
        return kernels


def _raise_not_finite(
    work: KernelWork, field: str, efficiency: float, at_peak_us: float
) -> NoReturn:
    """A kernel time overflowed: name the efficiency that did it, or the cluster figure (peak
    FLOP/s or bandwidth) when the time overflows at efficiency 1 already."""
    if math.isfinite(at_peak_us):
        raise ConfigError(
            field,
            f"{efficiency:g} makes kernel '{work.name}' ({work.phase}) take an infinite time "
            f"({at_peak_us:.3g} us at efficiency 1); use a realistic efficiency, e.g. 0.5",
        )
    raise ConfigError(
        "cluster",
        f"kernel '{work.name}' ({work.phase}) takes an infinite time even at efficiency 1: the "
        "cluster's peak_tflops or bandwidths are too small for this model",
    )


def wave_factor(work: KernelWork) -> float:
    """How much longer a layer's GEMM or attention kernel takes than its FLOPs at full waves: the
    waves its output tiles take over the waves they would fill exactly (1 for a kernel with no
    ``PieceShape``). A backward GEMM is its input gradient (tiles as wide as its input, reducing
    over its output width) and its weight gradient (in x out tiles, reducing over the rows), half
    the FLOPs each."""
    piece = work.piece
    if piece is None or piece.out_tiles == 0:
        return 1.0
    if work.kind == "attention":  # (batch, head, query block) tiles, no split of the keys
        return _occupancy(piece.blocks * piece.out_tiles, 1)
    if work.phase == "fwd" or work.name.startswith(RECOMPUTE_PREFIX):  # a recompute is a forward
        return _occupancy(piece.blocks * piece.out_tiles, piece.in_tiles)
    return 0.5 * (_input_grad_occupancy(piece) + _weight_grad_occupancy(piece))


def _input_grad_occupancy(piece: PieceShape) -> float:
    return _occupancy(piece.blocks * piece.in_tiles, piece.out_tiles)


def _weight_grad_occupancy(piece: PieceShape) -> float:
    return _occupancy(piece.in_tiles * piece.out_tiles, piece.blocks)


def _weight_grad_share(work: KernelWork) -> float:
    """The share of a backward GEMM's time its weight gradient takes (0 in forward)."""
    if work.phase != "bwd" or work.piece is None:
        return 0.0
    weight = _weight_grad_occupancy(work.piece)
    return weight / (_input_grad_occupancy(work.piece) + weight)


def _occupancy(tiles: int, depth_tiles: int) -> float:
    """The waves ``tiles`` output tiles take over the waves they fill exactly (at least 1)."""
    return _waves(tiles, depth_tiles) * SMS / tiles


def _waves(tiles: int, depth_tiles: int) -> float:
    """The waves of SMS tiles that ``tiles`` output tiles take; fewer than one wave's split their
    ``depth_tiles`` inner steps over the idle SMs, so take a fraction of a wave."""
    if tiles >= SMS:
        return -(-tiles // SMS)
    return 1 / max(1, min(SMS // tiles, depth_tiles))


def p2p_work(
    name: str, phase: Phase, spec: TransformerSpec, micro_batch_size: int, tp: int, dtype_bytes: int
) -> KernelWork:
    """A pipeline send/receive of one microbatch's hidden states between adjacent stages.

    Megatron's scatter/gather optimisation (and sequence parallelism) sends 1/tp of the tensor per
    rank.
    """
    tensor = spec.layer_tokens * micro_batch_size * spec.hidden_size * dtype_bytes / tp
    return KernelWork(name, phase, "comm", 0.0, tensor, "p2p", 2)


def dp_param_all_gather_work(params_per_rank: int, dp: int, param_bytes: int) -> KernelWork:
    """Distributed optimizer: gather the updated (bf16) parameter shards at the start of a step."""
    return KernelWork(
        "dp_all_gather", "fwd", "comm", 0.0, params_per_rank * param_bytes, "all_gather", dp
    )


def dp_grad_reduce_scatter_work(params_per_rank: int, dp: int, grad_bytes: int) -> KernelWork:
    """Distributed optimizer: reduce-scatter the (fp32) gradients at the end of a step."""
    return KernelWork(
        "dp_reduce_scatter", "bwd", "comm", 0.0, params_per_rank * grad_bytes, "reduce_scatter", dp
    )


@dataclass(frozen=True)
class MeasuredKernel:
    """One entry of a profile file, with the shape (the cost model's FLOPs and bytes) it was timed
    at, where the file records it."""

    key: tuple[str, str, str, int]  # (module, kernel, phase, tp)
    time_us: float
    flops: float | None = None
    bytes: float | None = None


def read_profile(path: str | Path, what: str = "cost_model.profile:") -> list[MeasuredKernel]:
    """Every entry of a kernel profile file; ``what`` starts the error messages."""
    data = read_versioned_json(
        path, what, PROFILE_FORMAT, PROFILE_VERSION, "run optimus-profile to create it"
    )
    if data.get("kernel_set") != KERNEL_SET:
        raise OptimusError(
            f"{what} {path} timed the kernel set {str(data.get('kernel_set'))[:40]!r}, but the "
            f"runtime runs {KERNEL_SET!r}; re-run optimus-profile with this release"
        )
    measured = []
    for i, entry in enumerate(data.get("kernels", [])):
        try:
            key = (entry["module"], entry["kernel"], entry["phase"], int(entry["tp"]))
            measured.append(
                MeasuredKernel(key, float(entry["time_us"]), entry.get("flops"), entry.get("bytes"))
            )
        except (KeyError, TypeError, ValueError):
            raise OptimusError(
                f"{what} kernels[{i}] in {path} needs module, kernel, phase, tp and time_us"
            ) from None
    return measured


def load_profile(path: str | Path) -> dict[tuple, float]:
    """Read a kernel profile: {(module, kernel, phase, tp): microseconds}."""
    return {m.key: m.time_us for m in read_profile(path)}


@dataclass(frozen=True)
class CommFit:
    """A collective measured on one group size: ``latency_us + us_per_byte * bytes``, ``bytes``
    being the whole tensor as ``KernelWork.bytes`` counts it (gathered, reduced or sent)."""

    collective: str
    group_size: int
    latency_us: float
    us_per_byte: float

    def us(self, tensor_bytes: float) -> float:
        return self.latency_us + self.us_per_byte * tensor_bytes


def fit_comm(
    collective: str, group_size: int, sizes: list[float], times_us: list[float]
) -> CommFit:
    """Least squares of ``times_us`` over ``sizes`` (bytes) as latency + bytes x rate, both held
    non-negative: a line with a negative latency would price small messages below zero."""
    if len(sizes) != len(times_us) or len(sizes) < 2:
        raise OptimusError(f"fit_comm: {collective} needs two or more sizes with a time each")
    n = len(sizes)
    mean_x, mean_y = sum(sizes) / n, sum(times_us) / n
    var = sum((x - mean_x) ** 2 for x in sizes)
    if var == 0:
        raise OptimusError(f"fit_comm: {collective} was measured at one size only")
    slope = max(0.0, sum((x - mean_x) * (y - mean_y) for x, y in zip(sizes, times_us)) / var)
    latency = mean_y - slope * mean_x
    if latency < 0:  # refit through the origin
        latency = 0.0
        slope = sum(x * y for x, y in zip(sizes, times_us)) / sum(x * x for x in sizes)
    return CommFit(collective, group_size, latency, slope)


def profile_device_problem(
    path: str | None, device_kind: str, field: str = "cost_model.profile"
) -> str | None:
    """Why a job on ``device_kind`` cannot be costed by the profile at ``path``: a CPU's kernel
    times say nothing of a GPU's, and the other way round. ``field`` names where the path was
    given, in the line and in a file's own errors."""
    if not path:
        return None
    measured = read_machine_profile(path, f"{field}:").device_kind
    if measured == device_kind:
        return None
    return (
        f"{field}: {path} was measured on a {measured} device, this job runs on "
        f"{device_kind}; profile this machine with optimus-profile, or drop {field}"
    )


@dataclass(frozen=True)
class MachineProfile:
    """Everything a profile says about the machine: kernel times, each layer's host work around
    its kernels, communication fits, the device kind and the step-to-step noise."""

    kernels: list[MeasuredKernel]
    comm_fits: dict[tuple[str, int], CommFit]
    device_kind: str  # cuda or cpu
    step_noise: float
    optimizer_us_per_param: float  # 0 where the profile did not measure the optimizer
    layer_host_us: dict[tuple[str, Phase], float]  # (module, phase) -> per layer; none on a GPU
    microbatch_host_us: float = 0.0  # per LLM op; 0 where the profile did not fit it


def read_machine_profile(path: str | Path, what: str = "cost_model.profile:") -> MachineProfile:
    """Read a profile; one written before a field existed came from optimus-profile on one GPU:
    a ``cuda`` device, no communication fits, no spreads. ``what`` starts the error messages."""
    data = read_versioned_json(
        path, what, PROFILE_FORMAT, PROFILE_VERSION, "run optimus-profile to create it"
    )
    kind = data.get("device_kind", "cuda")
    if kind not in ("cuda", "cpu"):
        raise OptimusError(
            f"{what} {path} has device_kind {str(kind)[:20]!r}; this release reads profiles of "
            "'cuda' or 'cpu' devices"
        )
    fits = {}
    for i, entry in enumerate(data.get("communication", [])):
        try:
            fit = CommFit(
                str(entry["collective"]),
                int(entry["group_size"]),
                float(entry["latency_us"]),
                float(entry["us_per_byte"]),
            )
        except (KeyError, TypeError, ValueError):
            raise OptimusError(
                f"{what} communication[{i}] in {path} needs collective, group_size, latency_us "
                "and us_per_byte"
            ) from None
        if (
            not (math.isfinite(fit.latency_us) and math.isfinite(fit.us_per_byte))
            or min(fit.latency_us, fit.us_per_byte) < 0
        ):
            raise OptimusError(
                f"{what} communication[{i}] in {path} has a negative or non-finite latency_us "
                "or us_per_byte; re-run optimus-profile"
            )
        fits[(fit.collective, fit.group_size)] = fit
    kernels = read_profile(path, what)
    try:
        spreads = [float(k.get("spread_us", 0.0)) for k in data["kernels"]]
    except (TypeError, ValueError, AttributeError):
        spreads = [math.nan]
    if not all(math.isfinite(s) and s >= 0 for s in spreads):
        raise OptimusError(
            f"{what} a kernel's spread_us in {path} is negative or not a number; re-run "
            "optimus-profile"
        )
    host = _layer_host(data, path, what)
    noise = step_noise([k.time_us for k in kernels], spreads)
    optimizer = data.get("optimizer_us_per_param", 0.0)
    _check_non_negative(optimizer, "optimizer_us_per_param", path, what)
    step_host = data.get("step_host", {})
    microbatch_host = (
        step_host.get("microbatch_host_us", 0.0) if isinstance(step_host, dict) else None
    )
    _check_non_negative(microbatch_host, "step_host.microbatch_host_us", path, what)
    return MachineProfile(
        kernels, fits, kind, noise, float(optimizer), host, float(microbatch_host)
    )


def _check_non_negative(value: object, field: str, path: str | Path, what: str) -> None:
    """A profile's ``field`` is a finite number of at least 0, or one line saying it is not."""
    if not isinstance(value, (int, float)) or not (math.isfinite(value) and value >= 0):
        raise OptimusError(
            f"{what} {field} in {path} is not a non-negative number; re-run optimus-profile"
        )


def _layer_host(data: dict, path: str | Path, what: str) -> dict[tuple[str, Phase], float]:
    """The profile's host work per layer by (module, phase) (``tools/layer_profiler.py``); none in
    a profile measured on a GPU."""
    if "layer_scales" in data:  # the first CPU profiles scaled kernels instead: not comparable
        raise OptimusError(
            f"{what} {path} has layer_scales, which this release no longer reads (it adds each "
            "layer's host work instead); re-run optimus-profile"
        )
    host: dict[tuple[str, Phase], float] = {}
    for i, entry in enumerate(data.get("layer_host", [])):
        try:
            phase = entry["phase"]
            key, us = (str(entry["module"]), phase), float(entry["host_us"])
        except (KeyError, TypeError, ValueError):
            raise OptimusError(
                f"{what} layer_host[{i}] in {path} needs module, phase and host_us"
            ) from None
        if phase not in ("fwd", "bwd") or not (math.isfinite(us) and us >= 0):
            raise OptimusError(
                f"{what} layer_host[{i}] in {path} needs phase fwd or bwd and host_us a "
                "non-negative number; re-run optimus-profile"
            )
        host[key] = us
    return host


def step_noise(times_us: list[float], spreads_us: list[float]) -> float:
    """How far a step's time lands from its prediction run to run, as a share: the kernels' typical
    deviations (half their interquartile ranges) added up over their medians added up. Adding
    them treats the kernels' noise as one (a busy machine slows them all at once), the cautious
    reading for deciding whether a predicted speed-up is real."""
    total = sum(times_us)
    return sum(spreads_us) / total if total > 0 else 0.0


def load_comm_fits(path: str | Path) -> dict[tuple[str, int], CommFit]:
    """The profile's communication fits by (collective, group size)."""
    return read_machine_profile(path).comm_fits


# --------------------------------------------------------------------------------------------
# TP modes that partition activations (issues 36, 37)
#
# The kernel chain of one layer under 2D SUMMA, 3D and METP, on one rank of a group of total
# degree t, for one microbatch: ``layer_kernels`` for a ``LayerShape`` whose ``tp_mode`` is not 1d.
#
# Compute kernels run at the rank's shapes (each does 1/t of the layer's FLOPs); communication is
# comm kernels with the papers' volumes, so the scheduler places them like megatron-core's TP
# collectives. Each chain sums its algorithm's steps per kind (the q SUMMA steps of a linear are one
# broadcast kernel and one GEMM; the p ring steps one P2P kernel and one GEMM per matrix): the chain
# prices the layer and its communication, not the interleaving of steps.
#
# - ``2d`` (Xu et al., Algorithms 1-3; Table 1): every linear C = A B broadcasts A's and B's blocks
#   over q steps along the grid's rows and columns, each broadcast a binomial tree of log2 q hops
#   (the paper's Eq. 4), so (n k_in + k_in k_out) / q elements, log2 q times. Its backward
#   broadcasts the same blocks again (A B^T and A^T B) and reduces the gradients' blocks, the same
#   volume: twice the forward's, and three times with full recomputation, which is the paper's table
#   (backward (21 bsh + 36 h^2) log(p) / (2 sqrt p) against forward (7 bsh + 12 h^2)). Attention
#   runs on the rank's b/q sequences and heads/q heads, no communication.
# - ``3d`` (Bian et al., Algorithms 1-2): every linear all-gathers its input's block along one
#   direction and its weight's along another and reduce-scatters the output along the third, each
#   a tensor of 1/p^2 over p ranks: (p - 1) (MN + NK + MK) / p^3 elements a rank sends. Its backward
#   all-gathers the output gradient and reduce-scatters the input's and the weight's gradients (the
#   gathered input and weight were kept), the same volume.
# - ``metp`` (Liang et al., Algorithms 1-6; Tables 1-2): the MLP's fc1/fc2 shards travel the ring,
#   p - 1 hops; its backward sends them again (it recomputes the tiles) and sends their gradients:
#   24 (p - 1) / p h^2 in all at an FFN of 4h. Attention broadcasts the QKV and output projection
#   shards (log2 p hops each) and rings K and V; its backward broadcasts the shards again, reduces
#   their gradients and rings K, V and their gradients: 12 log2(p) h^2 + 6 (p - 1) / p bsh in all.
#   The backward recomputes the QKV projection and fc1 (the forward keeps neither). The ring's
#   P2P runs double-buffered under its GEMMs (§3.3), so a ring kernel costs only the share of its
#   send that the GEMMs do not hide: none when the rank's m/p rows are above
#   ``overlap_rows_threshold`` at this model's GEMM and link rates. The broadcasts and reduces stay
#   exposed: the paper's first broadcast and last reduce of a layer cannot overlap (§5.6), and the
#   chain does not model the outer loop's overlap of the others.
#
# Biases and norm weights (O(h) per layer) move too and are left out, as the papers' tables leave
# them out; the norms' per-token statistics in 2D and 3D likewise.

# a linear layer's kernels by (name, input width, output width, phase)
_Linear = Callable[[str, int, int, Phase], list[KernelWork]]


def _mode_layer_kernels(shape: LayerShape, phase: Phase) -> list[KernelWork]:
    """The kernels of one layer's forward or backward under ``shape.tp_mode``, in order."""
    build = {"2d": _summa_2d, "3d": _cube_3d, "metp": _metp}[shape.tp_mode]
    forward, backward = build(_Rank(shape))
    if phase == "fwd":
        return forward
    if shape.recompute == "full":
        return [_recompute(k) for k in forward] + backward
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
        self,
        name: str,
        phase: Phase,
        elements: float,
        collective: Collective,
        group: int,
        ring: RingStep | None = None,
    ) -> KernelWork:
        return KernelWork(name, phase, "comm", 0.0, elements * self.e, collective, group, ring=ring)

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


def _recompute(k: KernelWork) -> KernelWork:
    return _renamed(k, RECOMPUTE_PREFIX + k.name, "bwd")


def _layer(rank: _Rank, linear: _Linear) -> tuple[list[KernelWork], list[KernelWork]]:
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

    def ring(name: str, phase: Phase, elements: float) -> KernelWork:
        return r.comm(name, phase, elements, "p2p", p, RingStep(tokens, r.e))

    forward = [
        r.memory("ln_attn", "fwd", tokens * r.h),
        r.comm("metp_bcast_attn", "fwd", attn_shards, "broadcast", p),
        gemm("qkv", "fwd"),
        ring("metp_p2p_kv", "fwd", kv_ring),
        r.attention("fwd"),
        gemm("attn_proj", "fwd"),
        r.memory("ln_mlp", "fwd", tokens * r.h),
        ring("metp_p2p_mlp", "fwd", mlp_ring),
        gemm("fc1", "fwd"),
        r.memory("act", "fwd", tokens * r.fc1),
        gemm("fc2", "fwd"),
    ]
    backward = [
        ring("metp_p2p_mlp", "bwd", mlp_ring),
        _recompute(gemm("fc1", "fwd")),
        _recompute(r.memory("act", "fwd", tokens * r.fc1)),
        gemm("fc2", "bwd"),
        r.memory("act", "bwd", tokens * r.fc1),
        gemm("fc1", "bwd"),
        ring("metp_p2p_mlp_grad", "bwd", mlp_ring),
        r.memory("ln_mlp", "bwd", tokens * r.h),
        r.comm("metp_bcast_attn", "bwd", attn_shards, "broadcast", p),
        _recompute(gemm("qkv", "fwd")),
        gemm("attn_proj", "bwd"),
        ring("metp_p2p_kv", "bwd", kv_ring),
        r.attention("bwd"),
        ring("metp_p2p_kv_grad", "bwd", kv_ring),
        gemm("qkv", "bwd"),
        r.comm("metp_reduce_attn_grad", "bwd", attn_shards, "reduce", p),
        r.memory("ln_attn", "bwd", tokens * r.h),
    ]
    return forward, backward


# The encoder's ops for a METP or 2D layer: the runtime's ops, which the scheduler places.
#
# The runtime runs METP's attention and its MLP each as one autograd function (``runtime/metp``),
# whose broadcasts and ring hops interleave with its GEMMs, one owner's shards or one K/V block at a
# time; the kinds the chain above sums cannot run apart. So the encoder's chain for a METP layer
# holds four ops, ``ln_attn, metp_attn, ln_mlp, metp_mlp`` (the backward in reverse, all four again
# as ``recompute_`` ops first under full recomputation), each half's op a compute op of the sum of
# its kernels' times: its ring and broadcasts run inside it, not beside the LLM's compute.
#
# A 2D linear (``tp_modes.summa.SummaLinear``) interleaves its q broadcasts with its q GEMMs, and
# its backward its reduces, in one autograd function: its op is the linear's name, its broadcasts
# and reduces summed into it (``ln_attn, qkv, attn_core, attn_proj, ln_mlp, fc1, act, fc2``).
METP_OPS = {
    "metp_attn": frozenset(
        {
            "metp_bcast_attn",
            "qkv",
            "metp_p2p_kv",
            "attn_core",
            "attn_proj",
            "metp_p2p_kv_grad",
            "metp_reduce_attn_grad",
        }
    ),
    "metp_mlp": frozenset({"metp_p2p_mlp", "fc1", "act", "fc2", "metp_p2p_mlp_grad"}),
}


def _metp_op(kernel: str) -> str:
    return next((op for op, members in METP_OPS.items() if kernel in members), kernel)


def _summa_op(kernel: str) -> str:
    return kernel.removeprefix("summa_bcast_").removeprefix("summa_reduce_")


# per mode whose encoder layers the runtime trains, the op a kernel of its chain belongs to
_OP_OF: dict[TPMode, Callable[[str], str]] = {"metp": _metp_op, "2d": _summa_op}


def runtime_layer_ops(shape: LayerShape, phase: Phase, kernels: list[Kernel]) -> list[Kernel]:
    """A METP or 2D layer's costed kernels (``CostModel.layer``'s, in ``layer_kernels`` order) as
    the runtime's ops: consecutive kernels of one op summed into a compute op of its name; under
    full recomputation the backward's rerun of the forward first, named ``recompute_`` + op."""
    op_of = _OP_OF[shape.tp_mode]
    rerun = len(layer_kernels(shape, "fwd")) if phase == "bwd" and shape.recompute == "full" else 0
    return _fused(kernels[:rerun], RECOMPUTE_PREFIX, op_of) + _fused(kernels[rerun:], "", op_of)


def has_runtime_layer_ops(mode: TPMode) -> bool:
    """Whether ``runtime_layer_ops`` takes a layer in ``mode``."""
    return mode in _OP_OF


def _fused(kernels: list[Kernel], prefix: str, op_of: Callable[[str], str]) -> list[Kernel]:
    ops: list[Kernel] = []
    for k in kernels:
        name = prefix + op_of(k.name.removeprefix(RECOMPUTE_PREFIX))
        if ops and ops[-1].name == name:
            last = ops[-1]
            ops[-1] = Kernel(
                name, last.phase, False, last.duration_us + k.duration_us, last.flops + k.flops
            )
        else:
            ops.append(Kernel(name, k.phase, False, k.duration_us, k.flops))
    return ops
