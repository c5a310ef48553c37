"""The paper's Megatron-LM baselines (§5.1, Appendix B), simulated with Optimus's own cost model.

* Megatron-LM: every encoder (patch embedding, layers, projector) runs in the pre-process of the
  first pipeline stage, tensor-parallel with the LLM's TP: before the forward of (stage 0, chunk 0)
  and after its backward.
* Megatron-LM balanced: encoder and LLM layers form one sequence, split into V*PP contiguous
  virtual stages by Appendix B's dynamic program and run by the interleaved 1F1B schedule, virtual
  stage ``chunk * PP + stage`` on pipeline rank ``stage`` (Megatron's interleaved assignment). Of
  the splits with the DP's slowest stage, it runs Appendix B's own or the one that evens the
  pipeline ranks' totals, whichever the simulated pipeline finishes first (``_balanced_split``).

Both reuse the LLM's pipeline simulator. With a per-microbatch ``workload``, each op that runs
encoder layers takes that microbatch's own encoder work (``simulate``'s ``op_us``); the balanced
split stays the one made for ``split_for`` (by default the iteration's heaviest microbatch): a
job's layers do not move between iterations. Every stage boundary costs the LLM's P2P time (the
LLM's hidden states), also where the balanced split cuts inside the encoder.

Both are also placements the runtime runs (``optimus-train --baseline megatron-lm | balanced``), so
the scheduler takes them as candidates beside its own schedules (``runnable_baselines``), after the
memory model the planner prunes Optimus plans with: model states of the fullest rank's parameters
(``model_state_memory``) plus Korthikanti activations of the microbatches 1F1B keeps in flight.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict
from dataclasses import dataclass, replace

from optimus_mllm.config import EncoderConfig, LLMConfig, OptimusConfig, encoder_tp_problem
from optimus_mllm.config.files import is_webdataset
from optimus_mllm.costing.cost_model import CostModel, Phase
from optimus_mllm.costing.memory_model import (
    GIB,
    MemoryBreakdown,
    interleaving_factor,
    layer_activation_bytes,
    model_state_memory,
    param_bytes,
)
from optimus_mllm.costing.params import (
    encoder_params_per_stage,
    layer_params,
    llm_embedding_params,
    llm_output_params,
    llm_params_per_stage,
    projector_params,
)
from optimus_mllm.costing.workload import EncoderWorkload, IterationWorkload, heaviest
from optimus_mllm.errors import OptimusError
from optimus_mllm.planner.planner import PlannerResult, gpu_memory_bytes, llm_memory
from optimus_mllm.planner.plans import ParallelPlan
from optimus_mllm.scheduler.encoder_costs import EncoderKernel, build_encoder_work
from optimus_mllm.scheduler.llm_costs import llm_op_work, timeline_from_work
from optimus_mllm.scheduler.llm_timeline import KernelItem, LLMTimeline, OpDuration, OpWork

PATCH_EMBED = "patch_embed"  # encoder_costs' name for the patch embedding kernel
_PS_PER_US = 1_000_000  # balanced_partition compares times as whole picoseconds


@dataclass(frozen=True)
class BaselineResult:
    name: str
    runtime: str  # the optimus-train --baseline that runs it
    iteration_us: float
    timeline: LLMTimeline
    memory: MemoryBreakdown  # the fullest GPU, by the planner's memory model
    layer_ranges: tuple[tuple[int, int], ...] | None = None  # balanced: [lo, hi) per virtual stage


@dataclass(frozen=True)
class _Layer:
    """One entry of the layer sequence: its kernels, the parameters it adds to DP collectives, the
    frozen parameters it holds besides, and its activation bytes per microbatch on one TP rank."""

    fwd: tuple[KernelItem, ...]
    bwd: tuple[KernelItem, ...]
    params: float
    frozen_params: float
    activation_bytes: float

    @property
    def time_us(self) -> float:
        return sum(item.stream_us for item in self.fwd + self.bwd)


def megatron_lm_baseline(
    config: OptimusConfig,
    llm_plan: ParallelPlan,
    cost: CostModel,
    workload: IterationWorkload | None = None,
) -> BaselineResult:
    """All encoders in the first stage's pre-process, under the given LLM plan; with a
    ``workload``, each microbatch's own (its op's kernels in the timeline are the heaviest's)."""
    heavy = heaviest(workload) if workload is not None else None
    encoder = _encoder_layers(config, llm_plan, cost, heavy)
    llm_alone = llm_op_work(config, llm_plan, cost)
    work = dict(llm_alone)
    work[(0, 0, "fwd")] = OpWork.sequential(_flatten(encoder, "fwd") + work[(0, 0, "fwd")].items())
    work[(0, 0, "bwd")] = OpWork.sequential(
        work[(0, 0, "bwd")].items() + _flatten(encoder[::-1], "bwd")
    )
    op_us = None
    if workload is not None:
        per_load = _encoder_times(config, llm_plan, cost, workload)

        def op_us(stage: int, chunk: int, mb: int, phase: Phase) -> float:
            own = per_load[workload[mb]][phase] if (stage, chunk) == (0, 0) else 0.0
            return llm_alone[(stage, chunk, phase)].duration_us + own

    stage_params = [float(p) for p in llm_params_per_stage(config.llm, llm_plan.pp)]
    stage_params[0] += sum(layer.params for layer in encoder)
    timeline = timeline_from_work(
        config, llm_plan, cost, work, stage_params=stage_params, op_us=op_us
    )
    memory = llm_memory(config, llm_plan) + _rank_memory(config, llm_plan, encoder)
    return BaselineResult("Megatron-LM", "megatron-lm", timeline.iteration_us, timeline, memory)


def megatron_lm_balanced_baseline(
    config: OptimusConfig,
    llm_plan: ParallelPlan,
    cost: CostModel,
    vp: int | None = None,
    workload: IterationWorkload | None = None,
    split_for: EncoderWorkload | None = None,
) -> BaselineResult:
    """Encoder and LLM layers balanced over V*PP virtual stages (V = ``vp``, default the plan's),
    split for ``split_for`` (default: the ``workload``'s heaviest microbatch, or today's); with a
    ``workload``, each microbatch runs its own encoder work in that split."""
    if len(config.encoders) != 1:
        names = ", ".join(e.name for e in config.encoders)
        raise OptimusError(
            f"Megatron-LM balanced needs a single encoder, the config has {len(config.encoders)} "
            f"({names}): the paper's layer-partition DP (Appendix B) handles a single encoder "
            "only, "
            "as independent encoders do not form one linear layer sequence"
        )
    plan = ParallelPlan(
        llm_plan.dp, llm_plan.pp, llm_plan.tp, vp if vp is not None else llm_plan.vp
    )
    if split_for is None and workload is not None:
        split_for = heaviest(workload)
    llm_layers = _llm_layers(config, plan, cost)
    layers = _encoder_layers(config, plan, cost, split_for) + llm_layers
    _check_balanced_plan(config, plan, len(layers))
    ranges = _balanced_split(config, plan, cost, layers)
    op_us: OpDuration | None = None
    if workload is not None:
        # per distinct workload: each virtual stage's forward and backward time
        stage_us = {}
        for load in set(workload):
            sized = _encoder_layers(config, plan, cost, load) + llm_layers
            stage_us[load] = {
                phase: [sum(_time(layer, phase) for layer in sized[lo:hi]) for lo, hi in ranges]
                for phase in ("fwd", "bwd")
            }

        def op_us(stage: int, chunk: int, mb: int, phase: Phase) -> float:
            return stage_us[workload[mb]][phase][chunk * plan.pp + stage]

    timeline = _balanced_timeline(config, plan, cost, layers, ranges, op_us)
    memory = max(
        (
            _rank_memory(
                config, plan, [layer for lo, hi in ranges[r :: plan.pp] for layer in layers[lo:hi]]
            )
            for r in range(plan.pp)
        ),
        key=lambda m: m.total,
    )
    return BaselineResult(
        "Megatron-LM balanced", "balanced", timeline.iteration_us, timeline, memory, ranges
    )


def _balanced_split(
    config: OptimusConfig, plan: ParallelPlan, cost: CostModel, layers: list[_Layer]
) -> tuple[tuple[int, int], ...]:
    """The virtual stages the balanced baseline runs: of Appendix B's split and the split with the
    same slowest stage that evens the pipeline ranks, the one whose simulated iteration is
    shortest (Appendix B's on a tie). Neither rule is the iteration, and neither is always the
    faster: Appendix B minimises the slowest virtual stage as its stand-in for the pipeline's time,
    which is also what it means to shorten."""
    times, stages = [layer.time_us for layer in layers], plan.pp * plan.vp
    splits = dict.fromkeys(
        (
            tuple(balanced_partition(times, stages)),
            tuple(rank_balanced_partition(times, stages, plan.pp)),
        )
    )
    return min(
        splits,
        key=lambda ranges: _balanced_timeline(config, plan, cost, layers, ranges).iteration_us,
    )


def _balanced_timeline(
    config: OptimusConfig,
    plan: ParallelPlan,
    cost: CostModel,
    layers: list[_Layer],
    ranges: tuple[tuple[int, int], ...],
    op_us: OpDuration | None = None,
) -> LLMTimeline:
    """The pipeline running ``layers`` split into the virtual stages ``ranges``."""
    work = {}
    stage_params = [0.0] * plan.pp
    for v, (lo, hi) in enumerate(ranges):
        chunk, stage = divmod(v, plan.pp)
        work[(stage, chunk, "fwd")] = OpWork.sequential(_flatten(layers[lo:hi], "fwd"))
        work[(stage, chunk, "bwd")] = OpWork.sequential(_flatten(layers[lo:hi][::-1], "bwd"))
        stage_params[stage] += sum(layer.params for layer in layers[lo:hi])
    return timeline_from_work(config, plan, cost, work, stage_params=stage_params, op_us=op_us)


def _rank_memory(
    config: OptimusConfig, plan: ParallelPlan, layers: list[_Layer]
) -> MemoryBreakdown:
    """What ``layers`` add to one rank of ``plan``: their model states, and activations of the
    microbatches the (interleaved) 1F1B schedule keeps in flight, as ``llm_activation_memory``."""
    states = model_state_memory(config, sum(layer.params for layer in layers) / plan.tp, plan.dp)
    frozen = param_bytes(config) * sum(layer.frozen_params for layer in layers) / plan.tp
    n_mb = config.num_microbatches_total // plan.dp
    in_flight = min(plan.pp, n_mb) * interleaving_factor(plan.pp, plan.vp)
    acts = sum(layer.activation_bytes for layer in layers) * in_flight
    return MemoryBreakdown(states.params + frozen, states.grads, states.optimizer, acts)


def runnable_baselines(
    config: OptimusConfig, llm_plan: ParallelPlan, cost: CostModel
) -> list[BaselineResult]:
    """Both baselines under the LLM plan (its V), where the runtime can run them and they fit in
    GPU memory."""
    capacity = gpu_memory_bytes(config)
    return [b for b in baseline_placements(config, llm_plan, cost) if b.memory.total <= capacity]


def runnable_megatron_lm_baseline(
    config: OptimusConfig, llm_plan: ParallelPlan, cost: CostModel
) -> BaselineResult | None:
    """Megatron-LM's own placement (the encoders in the first pipeline stage) where the runtime
    can run it and it fits in GPU memory: what ``--optimus-schedule auto`` weighs Optimus against,
    as a Megatron-LM job trains no other baseline."""
    if megatron_lm_problem(config, llm_plan) is not None:
        return None
    baseline = megatron_lm_baseline(config, llm_plan, cost)
    return baseline if baseline.memory.total <= gpu_memory_bytes(config) else None


def baseline_placements(
    config: OptimusConfig, llm_plan: ParallelPlan, cost: CostModel
) -> list[BaselineResult]:
    """Both baselines under the LLM plan (its V), where the runtime can run them, fitting in GPU
    memory or not."""
    found = []
    if megatron_lm_problem(config, llm_plan) is None:
        found.append(megatron_lm_baseline(config, llm_plan, cost))
    if _balanced_split_problem(config, llm_plan) is None:
        balanced = megatron_lm_balanced_baseline(config, llm_plan, cost)
        if tied_embedding_problem(config, llm_plan, balanced.layer_ranges) is None:
            found.append(balanced)
    return found


def no_placement_problem(config: OptimusConfig, planned: PlannerResult, cost: CostModel) -> str:
    """Why neither an Optimus schedule nor a baseline can run, in one line: the smallest memory
    shortfall where memory is what rules them out, then every placement pruned and why."""
    capacity = gpu_memory_bytes(config)
    # (bytes, what, its short name)
    needs = [
        (p.memory_bytes, f"encoder plan {p.plan}", str(p.plan))
        for p in planned.pruned
        if p.memory_bytes
    ]
    needs += [
        (b.memory.total, f"the {b.name} baseline", b.name)
        for b in baseline_placements(config, planned.llm_plan, cost)
        if b.memory.total > capacity
    ]
    others = "; ".join(f"{p.plan}: {p.reason}" for p in planned.pruned if not p.memory_bytes)
    if needs:
        need, what, _ = min(needs)
        listed = ", ".join(f"{name} {size / GIB:.4g}" for size, _, name in needs)
        return (
            f"cluster.gpu_memory_gib: nothing fits in {config.cluster.gpu_memory_gib:g} GiB per "
            f"GPU under LLM plan {planned.llm_plan}: the smallest, {what}, needs "
            f"{need / GIB:.4g} GiB ({(need - capacity) / GIB:.4g} GiB short); give more GPU "
            f"memory or GPUs, or enable training.recompute; out of memory (GiB): {listed}"
            + (f"; pruned otherwise: {others}" if others else "")
        )
    return (
        f"no encoder plan could be scheduled under LLM plan {planned.llm_plan} and no baseline "
        f"runs there; pruned encoder plans: {others or 'none'}"
    )


def megatron_lm_problem(config: OptimusConfig, llm_plan: ParallelPlan) -> str | None:
    """Why the encoders cannot run at the LLM's TP, as both baselines run them, or None."""
    for enc in config.encoders:
        problem = encoder_tp_problem(
            enc, config.llm.hidden_size, config.training.sequence_parallel, llm_plan.tp
        )
        if problem:
            return (
                f"Megatron-LM baselines run encoder '{enc.name}' with the LLM's tp={llm_plan.tp}, "
                f"but its {problem}"
            )
    return None


def balanced_layer_ranges(
    config: OptimusConfig, llm_plan: ParallelPlan
) -> tuple[tuple[int, int], ...]:
    """The balanced split the runtime runs: [lo, hi) of every virtual stage (``chunk * PP + stage``)
    over
    encoder layers, then LLM layers, by the config's cost model.

    Raises:
        OptimusError: the runtime cannot run the balanced baseline under ``llm_plan``
        (``balanced_problem``).
    """
    problem = _balanced_split_problem(config, llm_plan)
    if problem is None:
        ranges = megatron_lm_balanced_baseline(
            config, llm_plan, CostModel.from_config(config)
        ).layer_ranges
        problem = tied_embedding_problem(config, llm_plan, ranges)
    if problem:
        raise OptimusError(problem)
    return ranges


def balanced_problem(config: OptimusConfig, llm_plan: ParallelPlan) -> str | None:
    """Why the runtime cannot run the balanced baseline under ``llm_plan``, or None."""
    try:
        balanced_layer_ranges(config, llm_plan)
    except OptimusError as exc:
        return str(exc)
    return None


def _balanced_split_problem(config: OptimusConfig, llm_plan: ParallelPlan) -> str | None:
    """Why the layers cannot be split, or their encoders not run, as the balanced baseline does; or
    None."""
    if is_webdataset(config.data.path):
        return (
            "its pipeline buffers carry one image per sample, and a webdataset's microbatches "
            "(data.path) vary in images; train it under Optimus or --baseline megatron-lm"
        )
    problem = megatron_lm_problem(config, llm_plan)
    if problem:
        return problem
    if len(config.encoders) != 1:
        return (
            "the balanced baseline splits one encoder's layers with the LLM's; give a single "
            "encoder"
        )
    mode = config.parallel.encoder_tp_mode
    if mode != "1d":
        # its stages hold encoder and LLM layers alike, in megatron-core's 1D TP
        return f"the balanced baseline splits 1d encoder layers with the LLM's, not {mode} ones"
    try:
        _check_balanced_plan(
            config, llm_plan, sum(e.num_layers for e in config.encoders) + config.llm.num_layers
        )
    except OptimusError as exc:
        return str(exc)
    return None


def embedding_stage(ranges: tuple[tuple[int, int], ...], encoder_layers: int) -> int:
    """The balanced split's virtual stage that holds the first LLM layer (and so the word
    embedding)."""
    return next(v for v, (_, hi) in enumerate(ranges) if hi > encoder_layers)


def tied_embedding_problem(
    config: OptimusConfig, llm_plan: ParallelPlan, ranges: tuple[tuple[int, int], ...]
) -> str | None:
    """Why the balanced split's tied word embedding cannot be kept in sync, or None: the runtime
    sums its
    two copies' gradients over the pipeline ranks holding them, which must differ unless one virtual
    stage holds both."""
    if config.llm.untie_embeddings_and_output_weights or llm_plan.pp == 1:
        return None
    first, last = embedding_stage(ranges, config.encoders[0].num_layers), len(ranges) - 1
    if first != last and first % llm_plan.pp == last % llm_plan.pp:
        return (
            f"the balanced split puts the tied word embedding (virtual stage {first}) and the "
            "output layer "
            f"(virtual stage {last}) in two chunks of pipeline rank {last % llm_plan.pp}, whose "
            "copies this "
            "runtime does not sync; set model.llm.untie_embeddings_and_output_weights: true or "
            "another "
            "parallel.llm"
        )
    return None


def balanced_partition(layer_times: list[float], num_stages: int) -> list[tuple[int, int]]:
    """Appendix B: contiguous [lo, hi) stages of >= 1 layer each that minimise the slowest stage.

    F(l, m), the slowest of m stages over the first l layers, is min over j < l of
    max(F(j, m - 1), t_{j+1} + ... + t_l); ties keep the smallest j. F(j, m - 1) grows with j and
    the stage (j, l] shrinks, so the best j is where they cross, found by bisection. Times are
    compared as whole picoseconds, so that two sums of the same layers tie exactly wherever they sit
    (with floats the last bit decided, and the same job a little faster could be split otherwise).
    """
    prefix = _prefix_ps(layer_times, num_stages)
    n = len(layer_times)
    slowest = prefix[:]  # F(l, 1)
    cuts: list[list[int]] = []  # cuts[m - 2][l]: the best j of F(l, m)
    for m in range(2, num_stages + 1):
        row, cut = [0] * (n + 1), [0] * (n + 1)
        for layers in range(m, n + 1):
            row[layers], cut[layers] = _best_cut(slowest, prefix, m - 1, layers)
        slowest = row
        cuts.append(cut)
    ranges, hi = [], n
    for cut in reversed(cuts):
        ranges.append((cut[hi], hi))
        hi = cut[hi]
    ranges.append((0, hi))
    return ranges[::-1]


def _best_cut(slowest: list[int], prefix: list[int], lo: int, layers: int) -> tuple[int, int]:
    """min over lo <= j < layers of max(slowest[j], prefix[layers] - prefix[j]), and the smallest
    j that gives it."""
    # the first j whose F(j, m - 1) is at least the stage (j, layers]
    cross = (
        bisect_left(range(lo, layers), True, key=lambda j: slowest[j] >= prefix[layers] - prefix[j])
        + lo
    )
    best = (slowest[cross], cross) if cross < layers else None
    if cross > lo:
        stage = prefix[layers] - prefix[cross - 1]
        if best is None or stage <= best[0]:
            # the stage is the same from every j whose prefix is the same (layers taking no time)
            best = (stage, bisect_left(prefix, prefix[cross - 1], lo, cross))
    assert best is not None
    return best


def rank_balanced_partition(
    layer_times: list[float], num_stages: int, pipeline_ranks: int
) -> list[tuple[int, int]]:
    """Of the splits with Appendix B's slowest stage (``balanced_partition``), one whose pipeline
    ranks (virtual stage v on rank v % pipeline_ranks, Megatron's interleaved assignment) carry
    even totals.

    Many splits share that minimum (identical LLM layers can swap stages freely), and Appendix B's
    tie rule (smallest j) can pile the longer virtual stages onto a few ranks, while the interleaved
    schedule's steady state runs at the pace of its slowest rank, the sum of that rank's virtual
    stages. A pass over the splits whose every stage is within F(L, V*PP) keeps, per (l, m), the
    one with the lightest slowest rank so far, then the smallest sum of squared rank totals: a
    greedy choice, exact on the slowest stage, not a proof of the lightest rank.
    """
    prefix = _prefix_ps(layer_times, num_stages)
    n = len(layer_times)
    bound = max(prefix[hi] - prefix[lo] for lo, hi in balanced_partition(layer_times, num_stages))
    # best[l]: over the first l layers in m stages, (slowest rank, sum of squared rank totals,
    # rank totals, j); only splits whose stages all fit in ``bound``
    best: dict[int, tuple[int, int, tuple[int, ...], int]] = {0: (0, 0, (0,) * pipeline_ranks, 0)}
    cuts: list[dict[int, int]] = []  # cuts[m - 1][l]: where stage m of that split starts
    for m in range(1, num_stages + 1):
        rank = (m - 1) % pipeline_ranks
        row: dict[int, tuple[int, int, tuple[int, ...], int]] = {}
        for layers in range(m, n - (num_stages - m) + 1):
            for j in range(layers - 1, m - 2, -1):
                stage = prefix[layers] - prefix[j]
                if stage > bound:
                    break  # longer stages only grow
                if j not in best:
                    continue
                slowest, squares, totals, _ = best[j]
                total = totals[rank] + stage
                candidate = (
                    max(slowest, total),
                    squares + 2 * totals[rank] * stage + stage * stage,
                    totals[:rank] + (total,) + totals[rank + 1 :],
                    j,
                )
                if layers not in row or candidate[:2] < row[layers][:2]:
                    row[layers] = candidate
        best = row
        cuts.append({layers: entry[3] for layers, entry in row.items()})
    ranges, hi = [], n
    for cut in reversed(cuts):
        ranges.append((cut[hi], hi))
        hi = cut[hi]
    return ranges[::-1]


def _prefix_ps(layer_times: list[float], num_stages: int) -> list[int]:
    """Running sums of the layer times in whole picoseconds, for exact ties."""
    n = len(layer_times)
    if not 1 <= num_stages <= n:
        raise ValueError(f"cannot split {n} layers into {num_stages} non-empty stages")
    prefix = [0]
    for t in layer_times:
        prefix.append(prefix[-1] + round(t * _PS_PER_US))
    return prefix


def max_virtual_stage_us(timeline: LLMTimeline) -> float:
    """The slowest virtual stage: one chunk's forward plus backward on one rank."""
    return max(
        timeline.work[(s, c, "fwd")].duration_us + timeline.work[(s, c, "bwd")].duration_us
        for s in range(timeline.pp)
        for c in range(timeline.vp)
    )


def _check_balanced_plan(config: OptimusConfig, plan: ParallelPlan, num_layers: int) -> None:
    stages = plan.pp * plan.vp
    if plan.vp < 1 or stages > num_layers:
        raise OptimusError(
            f"Megatron-LM balanced: V*PP = {plan.vp}*{plan.pp} = {stages} virtual stages need "
            f"1 <= V and at most {num_layers} (encoder plus LLM layers), one layer each at least"
        )
    n_mb = config.num_microbatches_total // plan.dp
    if plan.vp > 1 and n_mb % plan.pp:
        raise OptimusError(
            f"Megatron-LM balanced: the interleaved schedule needs the {n_mb} microbatches per "
            f"pipeline to be a multiple of pp={plan.pp}; use vp=1"
        )


def _encoder_layers(
    config: OptimusConfig,
    llm_plan: ParallelPlan,
    cost: CostModel,
    workload: EncoderWorkload | None = None,
) -> list[_Layer]:
    """Every encoder's layers at the LLM's TP for one microbatch of ``workload`` (default:
    today's): the patch embedding joins the first, the projector the last. An encoder without
    images in it has its layers, and no kernels."""
    problem = megatron_lm_problem(config, llm_plan)
    if problem:
        raise OptimusError(problem)
    workload = workload or EncoderWorkload.constant(config)
    # One encoder stage at the LLM's TP gives the whole chain, as the first LLM stage runs it.
    single_stage = ParallelPlan(llm_plan.dp, 1, llm_plan.tp)
    work = build_encoder_work(config, llm_plan, single_stage, cost, workload)
    fwd, bwd = _by_layer(config, work.fwd[0].kernels), _by_layer(config, work.bwd[0].kernels)
    t = config.training
    layers = []
    for enc, load in zip(config.encoders, workload.loads):
        params = _encoder_layer_params(enc, config.llm)
        held = encoder_params_per_stage((enc,), config.llm, enc.num_layers)
        acts = (
            0.0  # forward only, or no image: nothing is kept for a backward pass
            if enc.frozen or not load.images
            else layer_activation_bytes(
                replace(enc, seq_length=load.tokens_per_image),
                load.images,
                llm_plan.tp,
                t.sequence_parallel,
                t.recompute,
            )
        )
        for i in range(enc.num_layers):
            key = (enc.name, i)
            layers.append(
                _Layer(
                    tuple(fwd.get(key, ())),
                    tuple(bwd.get(key, ())),
                    params[i],
                    held[i] - params[i],
                    acts,
                )
            )
    return layers


def _encoder_times(
    config: OptimusConfig, llm_plan: ParallelPlan, cost: CostModel, workload: IterationWorkload
) -> dict[EncoderWorkload, dict[Phase, float]]:
    """Per distinct microbatch workload: its encoders' forward and backward time at the LLM's
    TP."""
    times = {}
    for load in set(workload):
        layers = _encoder_layers(config, llm_plan, cost, load)
        times[load] = {
            phase: sum(_time(layer, phase) for layer in layers) for phase in ("fwd", "bwd")
        }
    return times


def _time(layer: _Layer, phase: Phase) -> float:
    return sum(item.stream_us for item in (layer.fwd if phase == "fwd" else layer.bwd))


def _by_layer(
    config: OptimusConfig, kernels: tuple[EncoderKernel, ...]
) -> dict[tuple[str, int], list[KernelItem]]:
    """Encoder kernels grouped by (encoder, layer); names carry the encoder, layer is -1 (not an LLM
    layer)."""
    last = {enc.name: enc.num_layers - 1 for enc in config.encoders}
    groups: dict[tuple[str, int], list[KernelItem]] = defaultdict(list)
    for k in kernels:
        layer = k.layer if k.layer >= 0 else (0 if k.name == PATCH_EMBED else last[k.encoder])
        groups[(k.encoder, layer)].append(
            KernelItem(f"{k.encoder}.{k.name}", -1, k.is_comm, k.duration_us)
        )
    return groups


def _encoder_layer_params(enc: EncoderConfig, llm: LLMConfig) -> list[float]:
    """Trained parameters per layer (embeddings with the first, final norm and projector with the
    last);
    a frozen encoder trains its projector only."""
    if enc.frozen:
        return [0.0] * (enc.num_layers - 1) + [float(projector_params(enc, llm))]
    return [float(p) for p in encoder_params_per_stage((enc,), llm, enc.num_layers)]


def _llm_layers(config: OptimusConfig, plan: ParallelPlan, cost: CostModel) -> list[_Layer]:
    """The LLM's layers with the embedding joined to the first and the output layer to the last."""
    llm = config.llm
    # With one layer per stage, llm_op_work gives each layer's kernels, heads attached as in the
    # LLM's timeline.
    work = llm_op_work(config, ParallelPlan(plan.dp, llm.num_layers, plan.tp, 1), cost)
    params = _llm_layer_params(llm, plan.pp)
    t = config.training
    acts = layer_activation_bytes(
        llm, t.micro_batch_size, plan.tp, t.sequence_parallel, t.recompute
    )
    return [
        _Layer(
            tuple(work[(i, 0, "fwd")].items()),
            tuple(work[(i, 0, "bwd")].items()),
            params[i],
            0.0,
            acts,
        )
        for i in range(llm.num_layers)
    ]


def _llm_layer_params(llm: LLMConfig, pp: int) -> list[float]:
    params = [float(layer_params(llm))] * llm.num_layers
    params[0] += llm_embedding_params(llm)
    params[-1] += llm_output_params(llm)
    if pp > 1 and not llm.untie_embeddings_and_output_weights:
        # the last stage's copy of the tied word embedding, as in params.llm_params_per_stage
        params[-1] += llm.vocab_size * llm.hidden_size
    return params


def _flatten(layers: list[_Layer], phase: Phase) -> list[KernelItem]:
    return [item for layer in layers for item in (layer.fwd if phase == "fwd" else layer.bwd)]
