"""Model planner (paper §4.1): the LLM plan, the encoder plans colocated with it, memory pruning and
microbatch partitions. Pure Python: the scheduler and the CLI consume the dataclasses it returns."""

from __future__ import annotations

from dataclasses import dataclass

from optimus_mllm.config import (
    MAX_MICROBATCHES_PER_PIPELINE,
    OptimusConfig,
    divisors,
    encoder_tp_problem,
    tp_divisibility_problem,
    tp_mode_problem,
)
from optimus_mllm.costing.memory_model import (
    GIB,
    MemoryBreakdown,
    bytes_per_param_k,
    colocation_overhead,
    encoder_activation_memory_per_microbatch,
    llm_activation_memory,
    model_state_memory,
    param_bytes,
)
from optimus_mllm.costing.params import encoder_params, encoder_params_per_stage, llm_stage_params
from optimus_mllm.errors import ConfigError
from optimus_mllm.planner.partitions import PartitionSet, microbatch_partitions
from optimus_mllm.planner.plans import (
    ParallelPlan,
    encoder_pipelines_per_llm_pipeline,
    symmetry_groups,
)


@dataclass(frozen=True)
class PrunedPlan:
    plan: ParallelPlan
    reason: str
    memory_bytes: float | None = None  # the fullest GPU's need, where memory pruned it


@dataclass(frozen=True)
class EncoderPlanCandidate:
    """An encoder plan that fits, with the memory of the fullest GPU and its microbatch
    partitions."""

    plan: ParallelPlan
    m: int  # encoder pipelines per LLM pipeline
    llm_memory: MemoryBreakdown
    encoder_memory: MemoryBreakdown  # activations for the even partition's largest part
    max_microbatches_per_pipeline: int  # beyond this an encoder pipeline's activations do not fit
    overhead_bytes: float  # paper §4.5: extra average model-state bytes against DP_enc = DP_llm
    partitions: PartitionSet

    @property
    def memory(self) -> MemoryBreakdown:
        return self.llm_memory + self.encoder_memory


@dataclass(frozen=True)
class PlannerResult:
    config_name: str
    num_gpus: int
    gpu_memory_bytes: float
    llm_plan: ParallelPlan
    llm_plan_origin: str  # "config" or "planner"
    llm_rejected: tuple[PrunedPlan, ...]  # smaller LLM plans tried first by the planner
    num_microbatches: int  # per LLM pipeline
    # in enumeration order; the bubble scheduler ranks them
    candidates: tuple[EncoderPlanCandidate, ...]
    pruned: tuple[PrunedPlan, ...]


def plan(config: OptimusConfig) -> PlannerResult:
    """Run the model planner on a validated config."""
    llm_plan, origin, rejected = choose_llm_plan(config)
    candidates, pruned = enumerate_encoder_plans(config, llm_plan)
    return PlannerResult(
        config_name=config.name,
        num_gpus=config.cluster.num_gpus,
        gpu_memory_bytes=gpu_memory_bytes(config),
        llm_plan=llm_plan,
        llm_plan_origin=origin,
        llm_rejected=tuple(rejected),
        num_microbatches=config.num_microbatches_total // llm_plan.dp,
        candidates=tuple(candidates),
        pruned=tuple(pruned),
    )


def gpu_memory_bytes(config: OptimusConfig) -> float:
    return config.cluster.gpu_memory_gib * GIB


# --------------------------------------------------------------------------------------------
# LLM plan


def llm_memory(config: OptimusConfig, plan: ParallelPlan) -> MemoryBreakdown:
    """Model states and activations of the fullest LLM rank (the first pipeline stage)."""
    params_per_rank = llm_stage_params(config.llm, plan.pp) / plan.tp
    states = model_state_memory(config, params_per_rank, plan.dp)
    acts = llm_activation_memory(config, plan.pp, plan.tp, plan.vp, plan.tp_mode)
    return MemoryBreakdown(states.params, states.grads, states.optimizer, acts)


def choose_virtual_stages(config: OptimusConfig, pp: int, num_microbatches: int) -> int:
    """The largest V that splits each stage's layers evenly, within ``planner.max_virtual_stages``.

    More chunks shrink the pipeline bubble by V (Narayanan et al.) at the cost of V times more P2P;
    megatron-core's interleaved schedule needs the microbatch count to be a multiple of PP.
    """
    if pp == 1 or num_microbatches % pp:
        return 1
    layers_per_stage = config.llm.num_layers // pp
    return max(
        v
        for v in range(1, min(layers_per_stage, config.planner.max_virtual_stages) + 1)
        if layers_per_stage % v == 0
    )


def choose_llm_plan(config: OptimusConfig) -> tuple[ParallelPlan, str, list[PrunedPlan]]:
    """The fixed plan from the config, or Megatron's guidance (Narayanan et al. 2021, §3.3):
    tensor parallelism inside a node, pipeline parallelism across nodes, and the smallest
    model-parallel size TP*PP whose LLM plus cheapest encoder plan fits in GPU memory."""
    fixed = config.parallel.llm
    if fixed is not None:
        n_mb = config.num_microbatches_total // fixed.dp
        vp = fixed.vp if fixed.vp is not None else choose_virtual_stages(config, fixed.pp, n_mb)
        return ParallelPlan(fixed.dp, fixed.pp, fixed.tp, vp, fixed.tp_mode), "config", []

    n, llm = config.cluster.num_gpus, config.llm
    node = min(n, config.cluster.gpus_per_node)
    rejected: list[PrunedPlan] = []
    options = []
    for tp in divisors(node):
        for pp in divisors(n // tp):
            options.append((tp * pp, -tp, tp, pp))
    for _, _, tp, pp in sorted(options):
        dp = n // (tp * pp)
        n_mb, remainder = divmod(config.num_microbatches_total, dp)
        candidate = ParallelPlan(dp, pp, tp, 1)
        problem = tp_divisibility_problem(llm, tp)
        if problem is None and llm.num_layers % pp:
            problem = f"pp={pp} does not divide num_layers={llm.num_layers}"
        if problem is None and remainder:
            problem = (
                f"global batch does not split over dp={dp} with "
                f"micro_batch_size={config.training.micro_batch_size}"
            )
        if problem is None and n_mb > MAX_MICROBATCHES_PER_PIPELINE:
            problem = (
                f"{n_mb} microbatches per pipeline, above the scheduler's "
                f"{MAX_MICROBATCHES_PER_PIPELINE}"
            )
        if problem is None and config.training.sequence_parallel and tp > 1 and llm.seq_length % tp:
            problem = f"seq_length={llm.seq_length} is not divisible by tp={tp}"
        if problem is None:
            candidate = ParallelPlan(dp, pp, tp, choose_virtual_stages(config, pp, n_mb))
            cheapest = _colocated_memory(
                config, candidate, _cheapest_encoder_plan(config, dp, pp, tp)
            )
            if cheapest.total <= gpu_memory_bytes(config):
                return candidate, "planner", rejected
            problem = f"needs {cheapest.total / GIB:.1f} GiB per GPU with its cheapest encoder plan"
        rejected.append(PrunedPlan(candidate, problem))
    last = rejected[-1].reason if rejected else "no candidate"
    raise ConfigError(
        "cluster.num_gpus",
        f"no LLM plan fits {config.cluster.num_gpus} GPUs of "
        f"{config.cluster.gpu_memory_gib:g} GiB (largest tried: {last}); add GPUs or memory, "
        "or enable training.recompute",
    )


def _cheapest_encoder_plan(config: OptimusConfig, dp: int, pp: int, tp: int) -> ParallelPlan:
    """The encoder plan an LLM plan is priced with: on all its stages and TP ranks, in the
    config's encoder TP mode where that mode takes the degree (1d where it does not)."""
    mode = config.parallel.encoder_tp_mode
    if any(tp_mode_problem(enc, mode, tp) for enc in config.encoders):
        mode = "1d"
    return ParallelPlan(dp, pp, tp, 1, mode)


# --------------------------------------------------------------------------------------------
# Encoder plans


def encoder_memory(
    config: OptimusConfig, enc: ParallelPlan, microbatches_in_flight: int
) -> MemoryBreakdown:
    """Encoder model states of the fullest encoder stage, plus activations of its in-flight
    microbatches.

    A frozen encoder keeps its 16-bit parameters only; its projector is counted with it (it is
    small).
    """
    trainable = tuple(e for e in config.encoders if not e.frozen)
    frozen = tuple(e for e in config.encoders if e.frozen)
    states = (
        model_state_memory(
            config, max(encoder_params_per_stage(trainable, config.llm, enc.pp)) / enc.tp, enc.dp
        )
        if trainable
        else MemoryBreakdown(0, 0, 0, 0)
    )
    frozen_params = (
        max(encoder_params_per_stage(frozen, config.llm, enc.pp)) / enc.tp if frozen else 0.0
    )
    acts = (
        encoder_activation_memory_per_microbatch(config, enc.pp, enc.tp, enc.tp_mode)
        * microbatches_in_flight
    )
    return MemoryBreakdown(
        states.params + param_bytes(config) * frozen_params, states.grads, states.optimizer, acts
    )


def _colocated_memory(
    config: OptimusConfig, llm_plan: ParallelPlan, enc: ParallelPlan
) -> MemoryBreakdown:
    """Upper bound for the fullest GPU: the fullest LLM rank plus the fullest encoder rank."""
    m = encoder_pipelines_per_llm_pipeline(llm_plan, enc)
    n_mb = config.num_microbatches_total // llm_plan.dp
    return llm_memory(config, llm_plan) + encoder_memory(config, enc, -(-n_mb // m))


def enumerate_encoder_plans(
    config: OptimusConfig, llm_plan: ParallelPlan
) -> tuple[list[EncoderPlanCandidate], list[PrunedPlan]]:
    """Every (DP_enc, PP_enc, TP_enc) with PP_enc | PP_llm and TP_enc | TP_llm, in the config's
    encoder TP mode (``parallel.encoder.tp_mode``, 1d without it), kept or pruned with a reason."""
    n = config.cluster.num_gpus
    n_mb = config.num_microbatches_total // llm_plan.dp
    capacity = gpu_memory_bytes(config)
    fixed = config.parallel.fixed_encoder
    pp_options = [fixed.pp] if fixed else divisors(llm_plan.pp)
    tp_options = [fixed.tp] if fixed else divisors(llm_plan.tp)
    mode = config.parallel.encoder_tp_mode
    llm_mem = llm_memory(config, llm_plan)
    k = bytes_per_param_k(config)
    phi_enc = sum(encoder_params(e) for e in config.encoders)

    candidates, pruned = [], []
    for pp in pp_options:
        for tp in tp_options:
            enc = ParallelPlan(n // (pp * tp), pp, tp, 1, mode)
            m = encoder_pipelines_per_llm_pipeline(llm_plan, enc)
            reason = _structural_problem(config, enc, m, n_mb)
            if reason:
                pruned.append(PrunedPlan(enc, reason))
                continue
            enc_mem = encoder_memory(config, enc, -(-n_mb // m))
            mem = llm_mem + enc_mem
            if mem.total > capacity:
                pruned.append(
                    PrunedPlan(
                        enc,
                        f"out of memory: needs {mem.total / GIB:.1f} GiB per GPU "
                        f"(LLM {llm_mem.total / GIB:.1f} + encoder "
                        f"{enc_mem.total / GIB:.1f}) > "
                        f"{config.cluster.gpu_memory_gib:g} GiB",
                        mem.total,
                    )
                )
                continue
            per_mb = encoder_activation_memory_per_microbatch(config, pp, tp, mode)
            states = encoder_memory(config, enc, 0)
            room = capacity - llm_mem.total - states.total
            max_per_pipeline = n_mb if per_mb == 0 else min(n_mb, int(room // per_mb))
            partitions = microbatch_partitions(
                n_mb,
                symmetry_groups(llm_plan, enc),
                max_per_pipeline,
                config.planner.max_partitions,
            )
            candidates.append(
                EncoderPlanCandidate(
                    plan=enc,
                    m=m,
                    llm_memory=llm_mem,
                    encoder_memory=enc_mem,
                    max_microbatches_per_pipeline=max_per_pipeline,
                    overhead_bytes=colocation_overhead(k, enc.dp, llm_plan.dp, phi_enc, n),
                    partitions=partitions,
                )
            )
    return candidates, pruned


def _structural_problem(config: OptimusConfig, enc: ParallelPlan, m: int, n_mb: int) -> str | None:
    for enc_cfg in config.encoders:
        problem = encoder_tp_problem(
            enc_cfg, config.llm.hidden_size, config.training.sequence_parallel, enc.tp
        )
        problem = problem or tp_mode_problem(enc_cfg, enc.tp_mode, enc.tp)
        if problem:
            return f"encoder '{enc_cfg.name}': {problem}"
        if enc.tp_mode == "2d" and enc.pp > 1:
            # the runtime trains a 2d encoder in one stage (its stages would pass grid blocks),
            # and a plan the planner keeps is one the runtime can train
            return f"encoder '{enc_cfg.name}': a 2d encoder trains in one pipeline stage yet"
        if enc_cfg.num_layers < enc.pp:
            return (
                f"encoder '{enc_cfg.name}' has {enc_cfg.num_layers} layers, fewer than "
                f"PP_enc={enc.pp}"
            )
    if m > n_mb:
        return (
            f"m={m} encoder pipelines per LLM pipeline but only {n_mb} microbatches: "
            "every encoder pipeline needs at least one"
        )
    return None
