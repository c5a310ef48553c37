"""Checks of a schedule artifact's contents, before any rank connects. Pure Python: no torch.

The typed loader (``artifact_format.artifact_from_json``) has checked every field's type.
``validate_artifact`` checks that the plans, the microbatch partition and global ordering, the
warm-up and the LLM op order, the LLM kernel lists and the encoder stages' op chains fit together as
``schedule_to_artifact`` writes them, and that every stage lists its ops in an order the runtime can
run as written: a chain's kernels in order, hooks never earlier than the op before.
``validate_for_job`` checks what only the job's config knows: its microbatch count and the kernels
its encoder and LLM run. A failure is a ``ConfigError`` naming the field's path in the file
(``encoder_stages[3].ops[17].kernel_index``), in the config's format: a hand-edited or truncated
artifact fails here, in one line, instead of with a traceback, a hang, or a schedule other than the
one written.
"""

from __future__ import annotations

from optimus_mllm.config import OptimusConfig
from optimus_mllm.costing.cost_model import CostModel
from optimus_mllm.errors import ConfigError, OptimusError
from optimus_mllm.planner.plans import ParallelPlan, encoder_stage_gpus
from optimus_mllm.scheduler.artifact_format import (
    EncoderMicrobatch,
    EncoderOp,
    EncoderStageSchedule,
    Hook,
    LLMOp,
    ScheduleArtifact,
)
from optimus_mllm.scheduler.encoder_costs import StageChain, build_encoder_work
from optimus_mllm.scheduler.llm_costs import llm_op_work
from optimus_mllm.scheduler.llm_timeline import KernelItem, OpWork, PipelineDeadlock, simulate
from optimus_mllm.scheduler.pipeline_order import default_warmup, rank_op_order

REMEDY = "re-run optimus-plan --artifact"
PHASES = ("fwd", "bwd")


def validate_artifact(artifact: ScheduleArtifact, where: str) -> None:
    """Refuse an artifact that is not what ``schedule_to_artifact`` writes; ``where`` starts the
    message."""
    try:
        _check_artifact(artifact)
    except ConfigError as exc:
        raise OptimusError(f"{where}: {exc}; {REMEDY}") from None


def validate_for_job(artifact: ScheduleArtifact, config: OptimusConfig, where: str) -> None:
    """Refuse a valid artifact whose microbatches or kernels are not the ones this job runs.

    Call after ``validate_artifact`` and after the job's plans matched the artifact's."""
    try:
        _check_job(artifact, config)
    except ConfigError as exc:
        raise OptimusError(f"{where}: {exc}; {REMEDY}") from None


# -- the artifact on its own ------------------------------------------------------------------


def _check_artifact(a: ScheduleArtifact) -> None:
    llm, enc = a.llm_plan, a.encoder_plan
    for name, plan in (("llm_plan", llm), ("encoder_plan", enc)):
        for key in ("dp", "pp", "tp", "vp"):
            _at_least(getattr(plan, key), 1, f"{name}.{key}")
    num_gpus = _at_least(a.num_gpus, 1, "num_gpus")
    _check_plans(llm, enc, num_gpus)
    n_mb = _at_least(a.num_microbatches, 1, "num_microbatches")
    layout = encoder_stage_gpus(llm, enc)
    _check_llm_order(a.llm_order, n_mb)
    partition = _check_partition(a.partition, len(layout), len(a.assignment))
    llm_microbatch = _check_assignment(a.assignment, a.feeds, partition, n_mb)
    _check_images_per_chain(a.images_per_chain, a.feeds)
    _check_warmup(a.warmup, llm, n_mb)
    _check_length(a.default_warmup, "default_warmup", llm.pp, "the plans need")
    _check_op_order(a.llm_op_order, a.warmup, llm, n_mb)
    _check_predicted(a)
    _check_llm_kernels(a.llm_kernels, llm)
    seen: dict[tuple[int, int], int] = {}
    for i, stage in enumerate(a.encoder_stages):
        field = f"encoder_stages[{i}]"
        j, e = _check_stage_place(stage, field, layout, llm)
        if (j, e) in seen:
            raise ConfigError(
                field, f"encoder pipeline {j} stage {e} again (also encoder_stages[{seen[(j, e)]}])"
            )
        seen[(j, e)] = i
        _check_ops(stage.ops, f"{field}.ops", j, partition[j], llm_microbatch, a, stage.llm_stage)
    for j, stages in enumerate(layout):
        for e in range(len(stages)):
            if (j, e) not in seen:
                raise ConfigError("encoder_stages", f"no entry for encoder pipeline {j} stage {e}")


def _check_predicted(a: ScheduleArtifact) -> None:
    """The scheduler's per-microbatch predictions: one per encoder microbatch."""
    count = len(a.assignment)
    for name in (
        "forward_dependency_us",
        "backward_dependency_us",
        "encoder_forward_end_us",
        "encoder_backward_start_us",
    ):
        entries = getattr(a.predicted, name)
        if len(entries) != count:
            raise ConfigError(
                f"predicted.{name}",
                f"{len(entries)} entries, but assignment lists {count} encoder microbatches",
            )


def _check_plans(llm: ParallelPlan, enc: ParallelPlan, num_gpus: int) -> None:
    for name, plan in (("llm_plan", llm), ("encoder_plan", enc)):
        if plan.world_size != num_gpus:
            raise ConfigError(name, f"dp*pp*tp = {plan.world_size}, but num_gpus is {num_gpus}")
    if enc.vp != 1:
        raise ConfigError(
            "encoder_plan.vp", f"{enc.vp}, but the encoder has no virtual stages: must be 1"
        )
    if llm.pp % enc.pp:
        raise ConfigError("encoder_plan.pp", f"{enc.pp} does not divide llm_plan.pp={llm.pp}")
    if llm.tp % enc.tp:
        raise ConfigError("encoder_plan.tp", f"{enc.tp} does not divide llm_plan.tp={llm.tp}")


def _check_llm_order(value: tuple[int, ...], n_mb: int) -> None:
    """The data microbatch each LLM microbatch runs: every one of them once."""
    _check_length(value, "llm_order", n_mb, "num_microbatches is")
    seen: dict[int, int] = {}
    for i, data in enumerate(value):
        _within(data, 0, n_mb - 1, f"llm_order[{i}]")
        if data in seen:
            raise ConfigError(
                f"llm_order[{i}]",
                f"data microbatch {data} again (also llm_order[{seen[data]}]): must be a "
                "permutation",
            )
        seen[data] = i


def _check_partition(value: tuple[int, ...], pipelines: int, count: int) -> tuple[int, ...]:
    """Encoder microbatches per encoder pipeline: every pipeline gets at least one, all of them
    together."""
    _check_length(value, "partition", pipelines, "the plans need")
    for j, n in enumerate(value):
        _at_least(n, 1, f"partition[{j}]")
    if sum(value) != count:
        raise ConfigError(
            "partition",
            f"{list(value)} adds up to {sum(value)}, but assignment lists {count} encoder "
            "microbatches",
        )
    return value


def _check_assignment(
    value: tuple[EncoderMicrobatch, ...],
    feeds: tuple[int, ...],
    partition: tuple[int, ...],
    n_mb: int,
) -> dict[EncoderMicrobatch, int]:
    """The global ordering: every encoder microbatch once, each feeding one LLM microbatch."""
    _check_length(feeds, "feeds", len(value), "assignment lists")
    llm_microbatch: dict[EncoderMicrobatch, int] = {}
    listed: dict[EncoderMicrobatch, int] = {}
    for s, (pair, i) in enumerate(zip(value, feeds)):
        field = f"assignment[{s}]"
        j = _within(pair.encoder_pipeline, 0, len(partition) - 1, f"{field}.encoder_pipeline")
        k = _within(pair.local_microbatch, 0, partition[j] - 1, f"{field}.local_microbatch")
        if pair in listed:
            raise ConfigError(
                field,
                f"encoder pipeline {j}'s local microbatch {k} again (also assignment"
                f"[{listed[pair]}]): must be a permutation",
            )
        listed[pair] = s
        llm_microbatch[pair] = _within(i, 0, n_mb - 1, f"feeds[{s}]")
    # len(value) distinct pairs out of sum(partition) == len(value): each one exactly once
    return llm_microbatch


def _check_images_per_chain(value: int | None, feeds: tuple[int, ...]) -> None:
    """Where an LLM microbatch is fed by several encoder microbatches, how many images each runs."""
    if value is not None:
        _at_least(value, 1, "images_per_chain")
        return
    first: dict[int, int] = {}
    for s, i in enumerate(feeds):
        if i in first:
            raise ConfigError(
                "images_per_chain",
                f"null, but LLM microbatch {i} is fed by feeds[{first[i]}] and feeds[{s}]: give "
                "the images each encoder microbatch runs",
            )
        first[i] = s


def _check_warmup(warmup: tuple[int, ...], llm: ParallelPlan, n_mb: int) -> None:
    _check_length(warmup, "warmup", llm.pp, "the plans need")
    for s, w in enumerate(warmup):
        _at_least(w, 0, f"warmup[{s}]")
        if w > n_mb * llm.vp:
            raise ConfigError(
                f"warmup[{s}]",
                f"{w} forwards, but a stage runs {n_mb * llm.vp} (num_microbatches * vp)",
            )
    default = [default_warmup(llm.pp, llm.vp, n_mb, s) for s in range(llm.pp)]
    if llm.vp == 1 and list(warmup) != default:
        # megatron-core's non-interleaved schedule computes its warm-up inline: it cannot be
        # adjusted
        raise ConfigError(
            "warmup", f"{list(warmup)}, but without virtual stages megatron-core runs {default}"
        )
    unit = OpWork.sequential([KernelItem("unit", 0, False, 1.0)])
    work = {(s, c, phase): unit for s in range(llm.pp) for c in range(llm.vp) for phase in PHASES}
    try:
        simulate(llm.pp, llm.vp, n_mb, work, 0.0, list(warmup))
    except PipelineDeadlock:
        raise ConfigError(
            "warmup",
            f"{list(warmup)} deadlocks the LLM pipeline (pp={llm.pp}, vp={llm.vp}, {n_mb} "
            f"microbatches); megatron-core's default is {default}",
        ) from None


def _check_op_order(
    order: tuple[tuple[LLMOp, ...], ...], warmup: tuple[int, ...], llm: ParallelPlan, n_mb: int
) -> None:
    """Each LLM stage's ops are the ones megatron-core's schedule runs there, in its order, under
    the artifact's warm-up: the runtime sets the warm-up, megatron-core the order that follows."""
    _check_length(order, "llm_op_order", llm.pp, "the plans need")
    for s, ops in enumerate(order):
        runs = [LLMOp(*op) for op in rank_op_order(n_mb, llm.vp, warmup[s], llm.pp)]
        for k, (written, run) in enumerate(zip(ops, runs)):
            if written != run:
                raise ConfigError(
                    f"llm_op_order[{s}][{k}]",
                    f"{_op_text(written)}, but with warmup[{s}]={warmup[s]} megatron-core runs "
                    f"{_op_text(run)} there; the runtime can run only megatron-core's order",
                )
        if len(ops) != len(runs):
            raise ConfigError(
                f"llm_op_order[{s}]",
                f"{len(ops)} ops, but megatron-core runs {len(runs)} on a stage "
                "(num_microbatches * vp forwards and as many backwards)",
            )


def _check_llm_kernels(value: dict[str, tuple[str, ...]], llm: ParallelPlan) -> None:
    """Kernel names of every (stage, chunk, phase) op."""
    expected = [
        f"{s}/{c}/{phase}" for s in range(llm.pp) for c in range(llm.vp) for phase in PHASES
    ]
    for key in value:
        if key not in expected:
            raise ConfigError(
                f"llm_kernels[{key!r}]", f"unknown key; valid keys: {', '.join(expected)}"
            )
    for key in expected:
        if key not in value:
            raise ConfigError(f"llm_kernels[{key!r}]", "is required but missing")


def _check_stage_place(
    stage: EncoderStageSchedule, field: str, layout: list[list[list[int]]], llm: ParallelPlan
) -> tuple[int, int]:
    """(encoder pipeline, encoder stage) of an ``encoder_stages`` entry on the GPUs the plans give
    it."""
    j = _within(stage.encoder_pipeline, 0, len(layout) - 1, f"{field}.encoder_pipeline")
    e = _within(stage.encoder_stage, 0, len(layout[j]) - 1, f"{field}.encoder_stage")
    gpus = layout[j][e]
    if list(stage.gpus) != gpus:
        raise ConfigError(
            f"{field}.gpus",
            f"{list(stage.gpus)}, but the plans put encoder pipeline {j} stage {e} on GPUs {gpus}",
        )
    if stage.llm_stage != gpus[0] // llm.tp:
        raise ConfigError(
            f"{field}.llm_stage",
            f"{stage.llm_stage}, but GPUs {gpus} hold LLM stage {gpus[0] // llm.tp}",
        )
    return j, e


def _check_ops(
    ops: tuple[EncoderOp, ...],
    field: str,
    j: int,
    count: int,
    llm_microbatch: dict[EncoderMicrobatch, int],
    a: ScheduleArtifact,
    llm_stage: int,
) -> None:
    """Every (phase, local microbatch, kernel_index) once, or as pieces that tile [0, 1]; each
    chain's kernel indexes 0..n-1; a forward chain for every local microbatch, and a backward chain
    for all of them or (frozen encoders) none; chains of the same phase equally long; the ops listed
    in an order the runtime runs as written."""
    order = {op: k for k, op in enumerate(a.llm_op_order[llm_stage])}
    # (phase, local microbatch) -> kernel_index -> its pieces: (lo, hi, op)
    chains: dict[tuple[str, int], dict[int, list[tuple[float, float, int]]]] = {}
    for n, op in enumerate(ops):
        _check_op(op, f"{field}[{n}]", j, count, llm_microbatch, a, llm_stage, order)
        chains.setdefault((op.phase, op.local_microbatch), {}).setdefault(
            op.kernel_index, []
        ).append((*op.piece, n))
    for (phase, k), chain in chains.items():
        for index, pieces in chain.items():
            reached = 0.0
            for lo, hi, n in sorted(pieces):
                if lo != reached:
                    raise ConfigError(
                        f"{field}[{n}].piece",
                        f"[{lo}, {hi}], but the pieces of kernel_index {index} "
                        f"in the {phase} chain of local microbatch {k} must tile [0, 1]: the next "
                        f"starts at {reached}",
                    )
                reached = hi
            if reached != 1.0:
                raise ConfigError(
                    f"{field}[{max(pieces)[2]}].piece",
                    f"the pieces of kernel_index {index} in the "
                    f"{phase} chain of local microbatch {k} end at {reached}, not 1",
                )
    for k in range(count):
        if ("fwd", k) not in chains:
            raise ConfigError(field, f"no fwd op of local microbatch {k}")
    with_backward = sorted(k for phase, k in chains if phase == "bwd")
    if with_backward and len(with_backward) != count:
        k = min(set(range(count)) - set(with_backward))
        raise ConfigError(
            field,
            f"no bwd op of local microbatch {k}, but local microbatch {with_backward[0]} has some",
        )
    for (phase, k), chain in sorted(chains.items()):
        for position, index in enumerate(sorted(chain)):
            if index != position:
                raise ConfigError(
                    f"{field}[{chain[index][0][2]}].kernel_index",
                    f"{index}, but the {phase} chain of "
                    f"local microbatch {k} has no kernel_index {position}",
                )
    for phase in PHASES:
        lengths = {k: len(chain) for (p, k), chain in sorted(chains.items()) if p == phase}
        whole = max(lengths, key=lengths.get, default=None)
        for k, length in lengths.items():
            if length < lengths[whole]:
                raise ConfigError(
                    field,
                    f"no {phase} op of local microbatch {k} with kernel_index {length}, but local "
                    f"microbatch {whole} has one",
                )
    _check_run_order(ops, field, order)


def _check_run_order(ops: tuple[EncoderOp, ...], field: str, order: dict[LLMOp, int]) -> None:
    """The runtime runs a stage's ops in the order listed, each at its hook: so a chain's kernels
    (and a kernel's pieces) must be listed in order, and no op hooked earlier than the one before
    it."""
    last: dict[tuple[str, int], tuple[int, tuple[float, float], int]] = {}
    previous = None
    for n, op in enumerate(ops):
        chain = (op.phase, op.local_microbatch)
        if chain in last and last[chain][:2] > (op.kernel_index, op.piece):
            index, piece, m = last[chain]
            raise ConfigError(
                f"{field}[{n}]",
                f"kernel_index {op.kernel_index} (piece {list(op.piece)}) of the {op.phase} chain "
                f"of local microbatch {op.local_microbatch} is listed after its kernel_index "
                f"{index} (piece {list(piece)}, ops[{m}]); a chain runs in kernel order: list the "
                "stage's ops in the order they run",
            )
        last[chain] = (op.kernel_index, op.piece, n)
        moment = _hook_moment(op.hook, order)
        if previous is not None and moment < previous:
            raise ConfigError(
                f"{field}[{n}].hook",
                f"{_hook_text(op.hook)}, earlier than the hook of ops[{n - 1}]; the runtime runs a "
                "stage's ops in the order listed: list them in the order of their hooks",
            )
        previous = moment


def _hook_moment(hook: Hook, order: dict[LLMOp, int]) -> tuple[int, ...]:
    """Where a hook falls in the stage's execution, to compare hooks by."""
    if hook.at == "before_first_compute":
        return (0,)
    if hook.at == "after_last_compute":
        return (2,)
    kernel = hook.llm_kernel
    return (1, order[kernel.op], kernel.kernel_index, kernel.after)


def _check_op(
    op: EncoderOp,
    at: str,
    j: int,
    count: int,
    llm_microbatch: dict[EncoderMicrobatch, int],
    a: ScheduleArtifact,
    llm_stage: int,
    order: dict[LLMOp, int],
) -> None:
    k = _within(op.local_microbatch, 0, count - 1, f"{at}.local_microbatch")
    feeds = llm_microbatch[EncoderMicrobatch(j, k)]
    if op.microbatch != feeds:
        raise ConfigError(
            f"{at}.microbatch",
            f"{op.microbatch}, but feeds gives LLM microbatch {feeds} to encoder pipeline {j}'s "
            f"local microbatch {k}",
        )
    _at_least(op.kernel_index, 0, f"{at}.kernel_index")
    lo, hi = op.piece
    if not 0.0 <= lo < hi <= 1.0:
        raise ConfigError(f"{at}.piece", f"{list(op.piece)}, but must have 0 <= lo < hi <= 1")
    _at_least(op.layer, -1, f"{at}.layer")
    _check_hook(op.hook, f"{at}.hook", a.llm_kernels, llm_stage, order)


def _check_hook(
    hook: Hook,
    at: str,
    llm_kernels: dict[str, tuple[str, ...]],
    llm_stage: int,
    order: dict[LLMOp, int],
) -> None:
    """A hook names a moment of this stage's LLM ops; ``llm_kernel`` names an op of the stage and
    one of its kernels."""
    kernel = hook.llm_kernel
    if hook.at != "llm_kernel":
        if kernel is not None:
            raise ConfigError(
                f"{at}.llm_kernel", f"set, but a {hook.at} hook names no LLM kernel: must be null"
            )
        return
    if kernel is None:
        raise ConfigError(f"{at}.llm_kernel", "is required for at: llm_kernel")
    if kernel.op not in order:
        raise ConfigError(
            f"{at}.llm_kernel.op",
            f"{_op_text(kernel.op)}, but this LLM stage runs no such op (llm_op_order)",
        )
    names = llm_kernels[f"{llm_stage}/{kernel.op.chunk}/{kernel.op.phase}"]
    _at_least(kernel.kernel_index, 0, f"{at}.llm_kernel.kernel_index")
    if kernel.kernel_index >= len(names):
        raise ConfigError(
            f"{at}.llm_kernel.kernel_index",
            f"{kernel.kernel_index}, but the LLM's {kernel.op.phase} of chunk {kernel.op.chunk} on "
            f"this stage has {len(names)} kernels (llm_kernels)",
        )
    _at_least(kernel.layer, -1, f"{at}.llm_kernel.layer")


# -- the artifact against the job -------------------------------------------------------------


def _check_job(a: ScheduleArtifact, config: OptimusConfig) -> None:
    llm, enc = a.llm_plan, a.encoder_plan
    n_mb = config.num_microbatches_total // llm.dp
    if a.num_microbatches != n_mb:
        raise ConfigError(
            "num_microbatches",
            f"{a.num_microbatches}, but this job runs {n_mb} per LLM pipeline "
            "(training.global_batch_size / micro_batch_size / dp)",
        )
    # a job's schedule runs every iteration, whatever its images: every LLM microbatch fed, by
    # one encoder microbatch that runs all of its images
    fed = set(a.feeds)
    for i in range(n_mb):
        if i not in fed:
            raise ConfigError(
                "feeds",
                f"no encoder microbatch feeds LLM microbatch {i}, but a job's schedule runs every "
                "iteration's images, in any microbatch: feed each one",
            )
    if a.images_per_chain is not None:
        raise ConfigError(
            "images_per_chain",
            f"{a.images_per_chain}, but a job's schedule runs every iteration's images, however "
            "many: must be null (one encoder microbatch runs all of its LLM microbatch's images)",
        )
    # kernel names and order only: no profile needed
    cost = CostModel(config.cluster, config.cost_model)
    for (s, c, phase), work in llm_op_work(config, llm, cost).items():
        key, names = f"{s}/{c}/{phase}", [k.name for k in work.kernels]
        have = list(a.llm_kernels[key])
        if have != names:
            n = next((n for n, (x, y) in enumerate(zip(have, names)) if x != y), None)
            if n is None:
                raise ConfigError(
                    f"llm_kernels[{key!r}]",
                    f"{len(have)} kernels, but this job's LLM runs {len(names)}",
                )
            raise ConfigError(
                f"llm_kernels[{key!r}][{n}]",
                f"{have[n]!r}, but this job's LLM runs {names[n]!r} there",
            )
    work = build_encoder_work(config, llm, enc, cost)
    for i, stage in enumerate(a.encoder_stages):
        e = stage.encoder_stage
        _check_chains(
            stage.ops, f"encoder_stages[{i}].ops", e, {"fwd": work.fwd[e], "bwd": work.bwd[e]}
        )


def _check_chains(
    ops: tuple[EncoderOp, ...], field: str, e: int, chains: dict[str, StageChain]
) -> None:
    """Each op is the kernel this job's encoder stage runs at its kernel_index, a piece of it only
    if it can be split, and each chain is whole (``validate_artifact`` made the chains of a phase
    contiguous and equally long)."""
    length = {phase: 0 for phase in PHASES}
    names_of = {phase: [k.name for k in chain.kernels] for phase, chain in chains.items()}
    for n, op in enumerate(ops):
        kernels, names, index = chains[op.phase].kernels, names_of[op.phase], op.kernel_index
        if index >= len(names):
            raise ConfigError(
                f"{field}[{n}].kernel_index",
                f"{index}, but encoder stage {e}'s {op.phase} chain has "
                f"{len(names)} kernels"
                + (" (frozen encoders have no backward)" if not names else ""),
            )
        if op.kernel != names[index]:
            raise ConfigError(
                f"{field}[{n}].kernel",
                f"{op.kernel!r}, but kernel {index} of encoder stage {e}'s "
                f"{op.phase} chain is {names[index]!r}",
            )
        if op.piece != (0.0, 1.0) and not kernels[index].splittable:
            raise ConfigError(
                f"{field}[{n}].piece",
                f"{list(op.piece)}, but this job's encoder runs kernel "
                f"{index} ({names[index]!r}) whole: only a layer's compute kernels without dropout "
                "split",
            )
        length[op.phase] = max(length[op.phase], index + 1)
    for phase, chain in chains.items():
        if length[phase] != len(chain.kernels):
            raise ConfigError(
                field,
                f"the {phase} chains have {length[phase]} kernels, but encoder stage {e}'s "
                f"{phase} chain has {len(chain.kernels)}",
            )


# -- values -------------------------------------------------------------------------------------


def _at_least(value: int, lo: int, field: str) -> int:
    if value < lo:
        raise ConfigError(field, f"{value}, but must be >= {lo}")
    return value


def _within(value: int, lo: int, hi: int, field: str) -> int:
    if not lo <= value <= hi:
        raise ConfigError(field, f"{value}, but must be in {lo}..{hi}")
    return value


def _check_length(value: tuple, field: str, length: int, who: str) -> None:
    if len(value) != length:
        raise ConfigError(field, f"{len(value)} entries, but {who} {length}")


def _op_text(op: LLMOp) -> str:
    return f"the {op.phase} of microbatch {op.microbatch}, chunk {op.chunk}"


def _hook_text(hook: Hook) -> str:
    if hook.llm_kernel is None:
        return hook.at
    k = hook.llm_kernel
    when = "after" if k.after else "under"
    return f"{when} kernel {k.kernel_index} of {_op_text(k.op)}"
