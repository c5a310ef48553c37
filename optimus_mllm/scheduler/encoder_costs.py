"""The encoder(s) under an encoder plan: per pipeline stage, the kernel chain of one microbatch.

A chain is priced for one microbatch's ``EncoderWorkload`` (``optimus_mllm/costing/workload.py``):
each encoder's images are the batch its kernels run, at that workload's tokens per image; an encoder
with no image in it runs no kernel. Without a workload, today's: one image per sample at the
encoder's ``seq_length``.

Several encoders are independent of each other, so each stage's chain simply runs the layers of
every encoder in turn: the scheduler treats them as one encoder (paper §4.4). A frozen encoder has
no backward; its projector still trains (paper §6).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

from optimus_mllm.config import EncoderConfig, OptimusConfig
from optimus_mllm.costing.cost_model import (
    CostModel,
    Kernel,
    KernelWork,
    LayerShape,
    Phase,
    PiecePrices,
    group_bandwidth_gbps,
    has_runtime_layer_ops,
    layer_kernels,
    p2p_work,
    runtime_layer_ops,
)
from optimus_mllm.costing.params import (
    encoder_params_per_stage,
    projector_params,
    stage_layer_bounds,
)
from optimus_mllm.costing.workload import EncoderWorkload
from optimus_mllm.planner.plans import ParallelPlan, encoder_stage_gpus
from optimus_mllm.scheduler.llm_costs import (
    activation_dtype_bytes,
    dp_comm_us,
    optimizer_step_us,
    tp_bandwidth,
)


@dataclass(frozen=True)
class EncoderKernel:
    encoder: str
    layer: int  # -1 for the patch embedding and the projector
    name: str
    phase: Phase
    is_comm: bool
    duration_us: float
    # can run as pieces of its tokens (``runtime/encoder_ops``): a transformer layer's compute
    # kernel, not a recomputation, in an encoder without dropout (its masks are drawn whole)
    splittable: bool = False
    # what its pieces take, by their shape (``CostModel.piece_prices``); None: a piece takes its
    # share of the kernel's work plus a launch
    prices: PiecePrices | None = None

    def piece_us(self, lo: float, hi: float, launch_us: float) -> float:
        """The time of its piece [lo, hi) of its tokens (the whole kernel: its duration)."""
        if hi - lo == 1.0:
            return self.duration_us
        if self.prices is not None:
            return self.prices.us[round((hi - lo) * self.prices.blocks)]
        return launch_us + (hi - lo) * (self.duration_us - launch_us)


@dataclass(frozen=True)
class StageChain:
    """One microbatch's kernels on one encoder stage, in order."""

    kernels: tuple[EncoderKernel, ...]

    @cached_property
    def duration_us(self) -> float:
        return sum(k.duration_us for k in self.kernels)

    @cached_property
    def compute_us(self) -> float:
        return sum(k.duration_us for k in self.kernels if not k.is_comm)

    @cached_property
    def steps(self) -> tuple[tuple[float, bool, bool], ...]:
        """(duration, is_comm, splittable) of each kernel: what the bubble scheduler's inner loops
        read."""
        return tuple((k.duration_us, k.is_comm, k.splittable) for k in self.kernels)


@dataclass(frozen=True)
class EncoderWork:
    plan: ParallelPlan
    fwd: tuple[StageChain, ...]  # per encoder stage
    bwd: tuple[StageChain, ...]  # per encoder stage; empty chains when every encoder is frozen
    p2p_us: float  # between consecutive encoder stages
    to_llm_us: tuple[float, ...]  # per encoder pipeline: its last stage to the first LLM stage
    dp_all_gather_us: float  # exposed, before the first encoder forward
    dp_reduce_scatter_us: float  # exposed, after the last encoder backward
    # [pipeline][stage] -> GPUs in the LLM pipeline
    stage_gpus: tuple[tuple[tuple[int, ...], ...], ...]
    llm_tp: int
    # what cutting a kernel into one more piece adds: its launch (kernel_overhead_us)
    launch_us: float = 0.0
    # a rank's optimizer step over its encoder parameters, after their reduce-scatter
    optimizer_step_us: float = 0.0

    def whole(self) -> EncoderWork:
        """The same work with every kernel run whole: the paper's Algorithm 1, which places
        kernels and never cuts one."""

        def whole(chain: StageChain) -> StageChain:
            return StageChain(tuple(replace(k, splittable=False) for k in chain.kernels))

        return replace(self, fwd=tuple(map(whole, self.fwd)), bwd=tuple(map(whole, self.bwd)))

    def llm_stage(self, pipeline: int, stage: int) -> int:
        return self.stage_gpus[pipeline][stage][0] // self.llm_tp

    @property
    def num_pipelines(self) -> int:
        return len(self.stage_gpus)


def build_encoder_work(
    config: OptimusConfig,
    llm_plan: ParallelPlan,
    enc_plan: ParallelPlan,
    cost: CostModel,
    workload: EncoderWorkload | None = None,
) -> EncoderWork:
    """Every encoder stage's chain for one microbatch of ``workload`` (default: today's constant
    one), and the transfers and DP collectives around them."""
    t = config.training
    dtype = activation_dtype_bytes(config)
    bw = tp_bandwidth(config, enc_plan.tp)
    fwd: list[list[EncoderKernel]] = [[] for _ in range(enc_plan.pp)]
    bwd: list[list[EncoderKernel]] = [[] for _ in range(enc_plan.pp)]
    sized = _sized_encoders(config, workload or EncoderWorkload.constant(config))
    for enc, images in sized:
        shape = LayerShape(
            enc, enc_plan.tp, images, t.sequence_parallel, dtype, t.recompute, enc_plan.tp_mode
        )
        layer = {phase: cost.layer(shape, phase, enc.name, bw) for phase in ("fwd", "bwd")}
        if has_runtime_layer_ops(shape.tp_mode):  # the runtime's ops: no pieces (``_splittable``)
            layer = {phase: runtime_layer_ops(shape, phase, ks) for phase, ks in layer.items()}
            prices = {phase: [None] * len(ks) for phase, ks in layer.items()}
        else:
            prices = _piece_prices(shape, layer, cost)
        for e, (lo, hi) in enumerate(stage_layer_bounds(enc.num_layers, enc_plan.pp)):
            if e == 0:
                fwd[e].append(_patch_embed(config, enc, images, cost, enc_plan.tp, "fwd"))
            for i in range(lo, hi):
                fwd[e] += [
                    EncoderKernel(
                        enc.name,
                        i,
                        k.name,
                        "fwd",
                        k.is_comm,
                        k.duration_us,
                        _splittable(enc, k, shape),
                        p,
                    )
                    for k, p in zip(layer["fwd"], prices["fwd"])
                ]
            if e == enc_plan.pp - 1:
                fwd[e] += _projector(config, enc, images, cost, enc_plan.tp, "fwd")
                bwd[e] += _projector(config, enc, images, cost, enc_plan.tp, "bwd")
            if not enc.frozen:
                for i in reversed(range(lo, hi)):
                    bwd[e] += [
                        EncoderKernel(
                            enc.name,
                            i,
                            k.name,
                            "bwd",
                            k.is_comm,
                            k.duration_us,
                            _splittable(enc, k, shape),
                            p,
                        )
                        for k, p in zip(layer["bwd"], prices["bwd"])
                    ]
                if e == 0:
                    bwd[e].append(_patch_embed(config, enc, images, cost, enc_plan.tp, "bwd"))
    layout = encoder_stage_gpus(llm_plan, enc_plan)
    params_per_rank = max(trainable_params_per_stage(config, enc_plan.pp)) / enc_plan.tp
    ag, rs = dp_comm_us(config, params_per_rank, enc_plan.dp, enc_plan.tp, cost)
    return EncoderWork(
        plan=enc_plan,
        fwd=tuple(StageChain(tuple(c)) for c in fwd),
        bwd=tuple(StageChain(tuple(c)) for c in bwd),
        p2p_us=_encoder_p2p_us(config, sized, llm_plan, enc_plan, cost),
        to_llm_us=tuple(
            _to_llm_us(config, sized, llm_plan, stages[-1][0] // llm_plan.tp, cost)
            for stages in layout
        ),
        dp_all_gather_us=ag,
        dp_reduce_scatter_us=rs,
        stage_gpus=tuple(tuple(tuple(g) for g in stages) for stages in layout),
        llm_tp=llm_plan.tp,
        launch_us=config.cost_model.kernel_overhead_us,
        optimizer_step_us=optimizer_step_us(config, params_per_rank, enc_plan.dp, cost),
    )


def _sized_encoders(
    config: OptimusConfig, workload: EncoderWorkload
) -> list[tuple[EncoderConfig, int]]:
    """Each encoder that runs in ``workload``: its config at the workload's tokens per image, and
    its images (the batch its kernels run)."""
    return [
        (replace(enc, seq_length=load.tokens_per_image), load.images)
        for enc, load in zip(config.encoders, workload.loads)
        if load.images
    ]


def _piece_prices(
    shape: LayerShape, layer: dict[Phase, list[Kernel]], cost: CostModel
) -> dict[Phase, list[PiecePrices | None]]:
    """Per phase, per kernel of one layer: its pieces' times (None where it has no pieces). A
    backward piece of a kernel that is not a GEMM recomputes that kernel's forward on its rows."""
    launch = cost.params.kernel_overhead_us
    forward_us = {k.name: k.duration_us - launch for k in layer["fwd"]}
    prices: dict[Phase, list[PiecePrices | None]] = {}
    for phase, kernels in layer.items():
        prices[phase] = []
        for work, k in zip(layer_kernels(shape, phase), kernels):
            if k.is_comm or k.name.startswith("recompute_"):
                prices[phase].append(None)
                continue
            redo = forward_us[k.name] if phase == "bwd" and work.kind != "gemm" else 0.0
            prices[phase].append(cost.piece_prices(work, k.duration_us, redo))
    return prices


def _splittable(enc: EncoderConfig, kernel: Kernel, shape: LayerShape) -> bool:
    # runtime/encoder_ops cuts 1D layers' kernels only
    return not (
        shape.tp_mode != "1d"
        or kernel.is_comm
        or kernel.name.startswith("recompute_")
        or enc.hidden_dropout
        or enc.attention_dropout
    )


def trainable_params_per_stage(config: OptimusConfig, pp: int) -> list[float]:
    """Parameters with gradients per encoder stage: trainable encoders, plus every projector (a
    frozen encoder's projector still trains)."""
    trainable = tuple(e for e in config.encoders if not e.frozen)
    per_stage = (
        [float(p) for p in encoder_params_per_stage(trainable, config.llm, pp)]
        if trainable
        else [0.0] * pp
    )
    per_stage[-1] += sum(projector_params(e, config.llm) for e in config.encoders if e.frozen)
    return per_stage


def _patch_embed(
    config: OptimusConfig, enc: EncoderConfig, images: int, cost: CostModel, tp: int, phase: Phase
) -> EncoderKernel:
    """The patch embedding as a GEMM over flattened patches; with sequence parallelism each TP rank
    embeds its own share of the tokens, otherwise all of them (replicated, like Megatron's CLIP).
    The class token is a learned row put before them, no GEMM: the rank whose share holds it
    embeds one patch fewer than the others, whose share is priced."""
    if config.training.sequence_parallel and tp > 1:
        tokens = enc.layer_tokens // tp * images
    else:
        tokens = enc.seq_length * images
    patch_dim = enc.in_channels * enc.patch_size**2
    dtype = activation_dtype_bytes(config)
    scale = 1 if phase == "fwd" else 2
    work = KernelWork(
        "patch_embed",
        phase,
        "gemm",
        scale * 2.0 * tokens * patch_dim * enc.hidden_size,
        scale
        * (tokens * patch_dim + patch_dim * enc.hidden_size + tokens * enc.hidden_size)
        * dtype,
    )
    return EncoderKernel(
        enc.name, -1, "patch_embed", phase, False, cost.compute_us(work, enc.name, tp)
    )


def _projector(
    config: OptimusConfig, enc: EncoderConfig, images: int, cost: CostModel, tp: int, phase: Phase
) -> list[EncoderKernel]:
    """Projector kernels as the runtime runs them (``runtime/vit.py``).

    ``mlp``: column-parallel fc1 (its activation fused; twice as wide with a gated linear unit),
    row-parallel fc2; ``affine``: one column-parallel GEMM; ``linear``: one row-parallel GEMM. They
    run on the tokens the LLM gets (a dropped class token left out, then
    ``projector.spatial_merge``: fewer, wider), the drop and merge being a slice and a reshape, no
    kernel.
    Forward: with sequence parallelism every token of the layers is gathered first; the output is
    all-reduced (``affine``: its columns all-gathered) so every TP rank holds it whole. Backward:
    the GEMMs in reverse, then the collective that forms the encoder features' gradient (none when
    the encoder is frozen): the input copy's all-reduce, its reduce-scatter over the layers' tokens
    under sequence parallelism (``mlp``, ``affine``), or the all-gather of the row-parallel input
    slices (``linear``).
    """
    t = config.training
    tokens = enc.image_tokens * images
    dtype = activation_dtype_bytes(config)
    h_enc, h_llm = enc.projector_input_size, config.llm.hidden_size
    bw = tp_bandwidth(config, tp)
    sp = t.sequence_parallel and tp > 1
    kind = enc.projector.type
    scale = 1 if phase == "fwd" else 2
    if kind == "mlp":
        ffn = enc.projector.mlp_ffn_hidden_size(h_llm) // tp
        fc1_out = 2 * ffn if enc.projector.gated_linear_unit else ffn
        shapes = [("projector_fc1", h_enc, fc1_out), ("projector_fc2", ffn, h_llm)]
    elif kind == "affine":
        shapes = [("projector_fc1", h_enc, h_llm // tp)]
    else:
        shapes = [("projector_fc1", h_enc // tp, h_llm)]
    gemms = []
    for name, k_in, k_out in shapes:
        work = KernelWork(
            name,
            phase,
            "gemm",
            scale * 2.0 * tokens * k_in * k_out,
            scale * (tokens * k_in + k_in * k_out + tokens * k_out) * dtype,
        )
        gemms.append(
            EncoderKernel(enc.name, -1, name, phase, False, cost.compute_us(work, enc.name, tp))
        )

    def collective(name: str, kind: str, nbytes: float) -> EncoderKernel:
        work = KernelWork(name, phase, "comm", 0.0, nbytes, kind, tp)  # type: ignore[arg-type]
        return EncoderKernel(enc.name, -1, name, phase, True, cost.comm_us(work, bw, enc.name, tp))

    features = tokens * h_enc * dtype
    # the sequence-parallel gather holds every token the layers ran (the class token too)
    gathered = enc.layer_tokens * images * enc.hidden_size * dtype
    if phase == "fwd":
        head = [collective("tp_ag_projector", "all_gather", gathered)] if sp else []
        if tp == 1:
            return head + gemms
        output = tokens * h_llm * dtype
        if kind == "affine":  # its columns gathered
            return head + gemms + [collective("tp_ag_projector_output", "all_gather", output)]
        return head + gemms + [collective("tp_ar_projector", "all_reduce", output)]
    if tp == 1 or enc.frozen:
        return gemms[::-1]
    if kind == "linear":
        return gemms[::-1] + [collective("tp_ag_projector", "all_gather", features)]
    return gemms[::-1] + [
        collective("tp_rs_projector", "reduce_scatter", gathered)
        if sp
        else collective("tp_ar_projector", "all_reduce", features)
    ]


def _encoder_p2p_us(
    config: OptimusConfig,
    sized: list[tuple[EncoderConfig, int]],
    llm_plan: ParallelPlan,
    enc_plan: ParallelPlan,
    cost: CostModel,
) -> float:
    if enc_plan.pp == 1 or not sized:
        return 0.0
    widest, images = max(sized, key=lambda s: s[0].layer_tokens * s[0].hidden_size * s[1])
    work = p2p_work(
        "encoder_p2p", "fwd", widest, images, enc_plan.tp, activation_dtype_bytes(config)
    )
    # consecutive encoder stages sit on consecutive LLM stages
    return cost.comm_us(work, group_bandwidth_gbps(config.cluster, 2, llm_plan.tp * llm_plan.dp))


def _to_llm_us(
    config: OptimusConfig,
    sized: list[tuple[EncoderConfig, int]],
    llm_plan: ParallelPlan,
    llm_stage: int,
    cost: CostModel,
) -> float:
    """Send the projected image tokens (and later their gradient) to/from the first LLM stage."""
    if llm_stage == 0 or not sized:
        return 0.0  # colocated on the first LLM stage: a local copy
    tokens = sum(enc.image_tokens * images for enc, images in sized)
    nbytes = tokens * config.llm.hidden_size * activation_dtype_bytes(config) / llm_plan.tp
    work = KernelWork("encoder_to_llm", "fwd", "comm", 0.0, nbytes, "p2p", 2)
    stride = llm_stage * llm_plan.tp * llm_plan.dp
    return cost.comm_us(work, group_bandwidth_gbps(config.cluster, 2, stride))
