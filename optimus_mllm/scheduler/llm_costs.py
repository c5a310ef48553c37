"""Kernels and communication of the LLM under a plan, turned into an ``LLMTimeline``."""

from __future__ import annotations

from optimus_mllm.config import OptimusConfig
from optimus_mllm.costing.cost_model import (
    CostModel,
    Kernel,
    KernelWork,
    LayerShape,
    Phase,
    dp_grad_reduce_scatter_work,
    dp_param_all_gather_work,
    group_bandwidth_gbps,
    p2p_work,
)
from optimus_mllm.costing.memory_model import MAIN_GRAD_BYTES, param_bytes
from optimus_mllm.costing.params import llm_params_per_stage
from optimus_mllm.planner.plans import ParallelPlan
from optimus_mllm.scheduler.llm_timeline import (
    KernelItem,
    LLMTimeline,
    OpDuration,
    OpWork,
    simulate,
)

LLM = "llm"  # the LLM's module name: in kernel profiles and schedule traces


def activation_dtype_bytes(config: OptimusConfig) -> int:
    return 4 if config.training.precision == "fp32" else 2


def llm_layer_shape(config: OptimusConfig, plan: ParallelPlan) -> LayerShape:
    t = config.training
    return LayerShape(
        config.llm,
        plan.tp,
        t.micro_batch_size,
        t.sequence_parallel,
        activation_dtype_bytes(config),
        t.recompute,
        plan.tp_mode,
    )


def tp_bandwidth(config: OptimusConfig, tp: int) -> float:
    return group_bandwidth_gbps(config.cluster, tp, 1)


def llm_op_work(
    config: OptimusConfig, plan: ParallelPlan, cost: CostModel
) -> dict[tuple[int, int, Phase], OpWork]:
    """Kernels of every (stage, chunk, phase): the chunk's layers, plus the embedding on the first
    virtual stage and the output layer on the last (Megatron's interleaved layer assignment)."""
    shape = llm_layer_shape(config, plan)
    bw = tp_bandwidth(config, plan.tp)
    fwd = cost.layer(shape, "fwd", LLM, bw)
    layer = {
        "fwd": [(k.name, k.is_comm, k.duration_us, False) for k in fwd],
        "bwd": megatron_backward(cost.layer(shape, "bwd", LLM, bw), fwd),
    }
    per_chunk = config.llm.num_layers // (plan.pp * plan.vp)
    head = _head_kernels(config, plan, cost)
    work = {}
    for s in range(plan.pp):
        for c in range(plan.vp):
            first_layer = (c * plan.pp + s) * per_chunk
            for phase in ("fwd", "bwd"):
                # layers run backwards in the backward pass
                order = range(per_chunk) if phase == "fwd" else range(per_chunk - 1, -1, -1)
                items = [
                    KernelItem(name, first_layer + i, is_comm, us, hidden)
                    for i in order
                    for name, is_comm, us, hidden in layer[phase]
                ]
                first = s == 0 and c == 0
                last = s == plan.pp - 1 and c == plan.vp - 1
                if phase == "fwd":
                    items = (
                        (head["embedding", "fwd"] if first else [])
                        + items
                        + (head["output_layer", "fwd"] if last else [])
                    )
                else:
                    items = (
                        (head["output_layer", "bwd"] if last else [])
                        + items
                        + (head["embedding", "bwd"] if first else [])
                    )
                work[(s, c, phase)] = OpWork.sequential(items)
    return work


# megatron-core's column-parallel GEMMs of a layer (``cost_model.layer_kernels``' names), and the
# layer half whose collectives they take
COLUMN_PARALLEL = {"qkv": "attn", "fc1": "mlp"}
# (name, is_comm, duration_us, hidden): a layer's kernel as the LLM's ops lay it out
LayerItem = tuple[str, bool, float, bool]


def megatron_backward(bwd: list[Kernel], fwd: list[Kernel]) -> list[LayerItem]:
    """A layer's backward as megatron-core runs it: the column-parallel GEMMs' TP collectives
    under their own GEMMs.

    ``LinearWithGradAccumulationAndAsyncCommunication.backward`` (and Transformer Engine's Linear)
    computes a column-parallel GEMM's backward (qkv, fc1) as the input gradient (dgrad), then the
    weight gradient (wgrad): equal FLOPs, so each takes half of what the cost model prices the
    backward at. Under sequence parallelism it all-gathers the layer input again for wgrad
    (the forward did not keep it), launched before dgrad and waited for after it, and launches the
    input gradient's reduce-scatter before wgrad, waited for after it; without sequence parallelism
    the input gradient's all-reduce runs under wgrad the same way. A collective longer than its
    GEMM holds the compute stream for the rest: a TP bubble that short. The row-parallel GEMMs'
    all-gathers of the output gradient (sequence parallelism) stay blocking. ``fwd``: the layer's
    forward, whose input all-gathers the backward runs again.
    """
    gather_us = {k.name: k.duration_us for k in fwd if k.is_comm}
    out: list[LayerItem] = []
    i = 0
    while i < len(bwd):
        k, after = bwd[i], bwd[i + 1] if i + 1 < len(bwd) else None
        half = COLUMN_PARALLEL.get(k.name)
        if half is None or after is None or after.name not in (f"tp_rs_{half}", f"tp_ar_{half}"):
            out.append((k.name, k.is_comm, k.duration_us, False))
            i += 1
            continue
        gemm_us = k.duration_us / 2
        if after.name == f"tp_rs_{half}":  # sequence parallelism
            gather = f"tp_ag_{half}"
            out += _under(f"{gather}_input", gather_us[gather], f"{k.name}_dgrad", gemm_us)
        else:
            out.append((f"{k.name}_dgrad", False, gemm_us, False))
        out += _under(after.name, after.duration_us, f"{k.name}_wgrad", gemm_us)
        i += 2
    return out


def _under(comm: str, comm_us: float, gemm: str, gemm_us: float) -> list[LayerItem]:
    """A collective launched before a GEMM and waited for after it: the part under the GEMM holds
    the link only, the rest (0 when the GEMM is longer) the compute stream too."""
    return [
        (comm, True, min(comm_us, gemm_us), True),
        (gemm, False, gemm_us, False),
        (comm, True, max(0.0, comm_us - gemm_us), False),
    ]


def _head_kernels(config: OptimusConfig, plan: ParallelPlan, cost: CostModel) -> dict:
    """Embedding lookup (memory-bound) and the vocabulary-parallel output GEMM.

    With TP > 1 the vocabulary-parallel embedding ends in a TP collective of its own (all-reduce, or
    reduce-scatter under sequence parallelism), a TP bubble like the layers' and a hook point the
    runtime observes; its backward needs none.
    """
    llm, t = config.llm, config.training
    tokens = llm.seq_length * t.micro_batch_size
    b = activation_dtype_bytes(config)
    vocab = llm.vocab_size // plan.tp
    emb = KernelWork("embedding", "fwd", "memory", 0.0, 2 * tokens * llm.hidden_size * b)
    out = KernelWork(
        "output_layer",
        "fwd",
        "gemm",
        2.0 * tokens * llm.hidden_size * vocab,
        (tokens * llm.hidden_size + llm.hidden_size * vocab + tokens * vocab) * b,
    )
    kernels = {}
    for work in (emb, out):
        for phase, scale in (("fwd", 1), ("bwd", 2)):
            scaled = KernelWork(work.name, phase, work.kind, work.flops * scale, work.bytes * scale)
            kernels[(work.name, phase)] = [
                KernelItem(work.name, -1, False, cost.compute_us(scaled, LLM, plan.tp))
            ]
    if plan.tp > 1:
        # all-reduced even under sequence parallelism: the image tokens are spliced into the whole
        # sequence before it is scattered (runtime/llm.py, as megatron-core's LLaVA does)
        name, collective = "tp_ar_embed", "all_reduce"
        reduce = KernelWork(
            name, "fwd", "comm", 0.0, tokens * llm.hidden_size * b, collective, plan.tp
        )
        kernels[("embedding", "fwd")].append(
            KernelItem(
                name, -1, True, cost.comm_us(reduce, tp_bandwidth(config, plan.tp), LLM, plan.tp)
            )
        )
    return kernels


def llm_p2p_us(config: OptimusConfig, plan: ParallelPlan, cost: CostModel) -> float:
    """One pipeline send/receive between adjacent stages (ranks tp*dp apart in Megatron's order)."""
    if plan.pp == 1:
        return 0.0
    work = p2p_work(
        "p2p",
        "fwd",
        config.llm,
        config.training.micro_batch_size,
        plan.tp,
        activation_dtype_bytes(config),
    )
    return cost.comm_us(work, group_bandwidth_gbps(config.cluster, 2, plan.tp * plan.dp))


def dp_comm_us(
    config: OptimusConfig, params_per_rank: float, dp: int, tp: int, cost: CostModel
) -> tuple[float, float]:
    """Exposed (all-gather, reduce-scatter) time of ``params_per_rank`` over ``dp`` replicas.

    Without Megatron's --overlap-param-gather / --overlap-grad-reduce (its defaults) the whole
    rank's parameters are gathered before the first computation and its gradients reduced after the
    last; without the distributed optimizer the gradients are all-reduced instead.
    """
    if dp == 1:
        return 0.0, 0.0
    bw = group_bandwidth_gbps(config.cluster, dp, tp)
    if not config.training.distributed_optimizer:
        rs = KernelWork(
            "dp_all_reduce", "bwd", "comm", 0.0, params_per_rank * MAIN_GRAD_BYTES, "all_reduce", dp
        )
        return 0.0, cost.comm_us(rs, bw)
    ag = dp_param_all_gather_work(int(params_per_rank), dp, param_bytes(config))
    rs = dp_grad_reduce_scatter_work(int(params_per_rank), dp, MAIN_GRAD_BYTES)
    return cost.comm_us(ag, bw), cost.comm_us(rs, bw)


def optimizer_step_us(
    config: OptimusConfig, params_per_rank: float, dp: int, cost: CostModel
) -> float:
    """One rank's optimizer step over ``params_per_rank``: the distributed optimizer updates its
    1/dp shard, Megatron's plain one every parameter."""
    shard = params_per_rank / dp if config.training.distributed_optimizer else params_per_rank
    return cost.optimizer_us(shard)


def build_llm_timeline(
    config: OptimusConfig, plan: ParallelPlan, cost: CostModel, warmup: list[int] | None = None
) -> LLMTimeline:
    """Simulate one LLM pipeline under ``plan``; ``warmup`` overrides megatron-core's warm-up
    counts."""
    work = llm_op_work(config, plan, cost)
    return timeline_from_work(config, plan, cost, work, warmup)


def timeline_from_work(
    config: OptimusConfig,
    plan: ParallelPlan,
    cost: CostModel,
    work: dict[tuple[int, int, Phase], OpWork],
    warmup: list[int] | None = None,
    stage_params: list[float] | None = None,
    op_us: OpDuration | None = None,
) -> LLMTimeline:
    """Simulate ``work``; ``stage_params`` (per stage, before TP sharding) replaces the LLM's own
    parameter counts in the DP collectives, for layouts that move layers between stages
    (baselines); ``op_us`` gives ops whose duration differs by microbatch (``simulate``)."""
    n_mb = config.num_microbatches_total // plan.dp
    p2p = llm_p2p_us(config, plan, cost)
    stages = simulate(
        plan.pp, plan.vp, n_mb, work, p2p, warmup, op_us=op_us, op_host_us=cost.microbatch_host_us
    )
    per_stage = (
        stage_params if stage_params is not None else llm_params_per_stage(config.llm, plan.pp)
    )
    dp = [dp_comm_us(config, p / plan.tp, plan.dp, plan.tp, cost) for p in per_stage]
    optimizer = [optimizer_step_us(config, p / plan.tp, plan.dp, cost) for p in per_stage]
    return LLMTimeline(
        plan.pp,
        plan.vp,
        n_mb,
        stages,
        work,
        p2p,
        [a for a, _ in dp],
        [r for _, r in dp],
        tp_comm_is_busy=not cost.encoder_runs_beside_the_llm,
        optimizer_step_us=optimizer,
        op_host_us=cost.microbatch_host_us,
    )
