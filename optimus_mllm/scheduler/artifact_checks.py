"""Checks of a schedule artifact's contents, before any rank connects. Pure Python: no torch.

``validate_artifact`` checks the file on its own: every field's type, and that the plans, the
microbatch partition and global ordering, the warm-up, the LLM kernel lists and the encoder stages'
op chains fit together as ``schedule_to_artifact`` writes them. ``validate_for_job`` checks what
only the job's config knows: its microbatch count and the kernels its encoder and LLM run. A failure
names the field's path in the file (``encoder_stages[3].ops[17].kernel_index``): a hand-edited or
truncated artifact fails here, in one line, instead of with a traceback or a hang after the ranks
connect.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from optimus_mllm.config import OptimusConfig
from optimus_mllm.cost_model import CostModel
from optimus_mllm.errors import OptimusError
from optimus_mllm.planner.plans import ParallelPlan, encoder_stage_gpus
from optimus_mllm.scheduler.encoder_costs import StageChain, build_encoder_work
from optimus_mllm.scheduler.llm_costs import llm_op_work
from optimus_mllm.scheduler.llm_timeline import OpWork, PipelineDeadlock, default_warmup, simulate

REMEDY = "write a new one with optimus-plan --artifact"
PHASES = ("fwd", "bwd")
HOOK_KINDS = ("before_first_compute", "llm_kernel", "after_last_compute")

_TOP_LEVEL = {
    "format": str,
    "version": int,
    "config": str,
    "num_gpus": int,
    "llm_plan": dict,
    "encoder_plan": dict,
    "num_microbatches": int,
    "partition": list,
    "assignment": list,
    "warmup": list,
    "default_warmup": list,
    "predicted": dict,
    "llm_kernels": dict,
    "encoder_stages": list,
    "fingerprint": dict,
}
_PLAN_KEYS = tuple(f.name for f in dataclasses.fields(ParallelPlan))
_STAGE_KEYS = ("encoder_pipeline", "encoder_stage", "llm_stage", "gpus", "ops")
_OP_KEYS = (
    "phase",
    "microbatch",
    "local_microbatch",
    "encoder",
    "layer",
    "kernel",
    "kernel_index",
    "piece",
    "is_comm",
    "window",
    "start_us",
    "end_us",
    "hook",
)
_LLM_HOOK_KEYS = ("at", "phase", "chunk", "microbatch", "kernel_index", "kernel", "layer", "after")


class _Invalid(Exception):
    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")


def validate_artifact(data: dict[str, Any], where: str) -> None:
    """Refuse an artifact that is not what ``schedule_to_artifact`` writes; ``where`` starts the
    message."""
    try:
        _check_artifact(data)
    except _Invalid as exc:
        raise OptimusError(f"{where}: {exc}; {REMEDY}") from None


def validate_for_job(data: dict[str, Any], config: OptimusConfig, where: str) -> None:
    """Refuse a valid artifact whose microbatches or kernels are not the ones this job runs.

    Call after ``validate_artifact`` and after the job's plans matched the artifact's."""
    try:
        _check_job(data, config)
    except _Invalid as exc:
        raise OptimusError(f"{where}: {exc}; {REMEDY}") from None


# -- the artifact on its own ------------------------------------------------------------------


def _check_artifact(data: dict[str, Any]) -> None:
    _keys(data, tuple(_TOP_LEVEL), "")
    for key, kind in _TOP_LEVEL.items():
        _typed(data[key], kind, key)
    llm, enc = _plan(data["llm_plan"], "llm_plan"), _plan(data["encoder_plan"], "encoder_plan")
    num_gpus = _int(data["num_gpus"], "num_gpus", 1)
    _check_plans(llm, enc, num_gpus)
    n_mb = _int(data["num_microbatches"], "num_microbatches", 1)
    layout = encoder_stage_gpus(llm, enc)
    partition = _check_partition(data["partition"], len(layout), n_mb)
    llm_microbatch = _check_assignment(data["assignment"], partition, n_mb)
    _check_warmup(data["warmup"], llm, n_mb)
    _int_list(data["default_warmup"], "default_warmup", llm.pp)
    _check_predicted(data["predicted"], n_mb)
    kernels = _check_llm_kernels(data["llm_kernels"], llm)
    _check_fingerprint(data["fingerprint"])
    seen: dict[tuple[int, int], int] = {}
    for i, stage in enumerate(data["encoder_stages"]):
        field = f"encoder_stages[{i}]"
        j, e = _check_stage_place(stage, field, layout, llm)
        if (j, e) in seen:
            raise _Invalid(
                field, f"encoder pipeline {j} stage {e} again (also encoder_stages[{seen[(j, e)]}])"
            )
        seen[(j, e)] = i
        _check_ops(
            stage["ops"],
            f"{field}.ops",
            j,
            partition[j],
            llm_microbatch,
            kernels[stage["llm_stage"]],
            llm,
            n_mb,
        )
    for j, stages in enumerate(layout):
        for e in range(len(stages)):
            if (j, e) not in seen:
                raise _Invalid("encoder_stages", f"no entry for encoder pipeline {j} stage {e}")


def _check_predicted(value: dict, n_mb: int) -> None:
    """The scheduler's predictions (times in us; F/B/EF/EB per microbatch): finite numbers."""
    times, per_microbatch = (
        ("iteration_us", "coarse_iteration_us", "llm_origin_us"),
        ("F", "B", "EF", "EB"),
    )
    _keys(value, times + per_microbatch, "predicted")
    for key in times:
        _finite(value[key], f"predicted.{key}")
    for key in per_microbatch:
        entries = _typed(value[key], list, f"predicted.{key}")
        if len(entries) != n_mb:
            raise _Invalid(
                f"predicted.{key}", f"{len(entries)} entries, but there are {n_mb} microbatches"
            )
        for i, entry in enumerate(entries):
            _finite(entry, f"predicted.{key}[{i}]")


def _finite(value: Any, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _Invalid(field, f"expected a finite number, got {_describe(value)}")
    return value


def _check_plans(llm: ParallelPlan, enc: ParallelPlan, num_gpus: int) -> None:
    for name, plan in (("llm_plan", llm), ("encoder_plan", enc)):
        if plan.world_size != num_gpus:
            raise _Invalid(name, f"dp*pp*tp = {plan.world_size}, but num_gpus is {num_gpus}")
    if enc.vp != 1:
        raise _Invalid(
            "encoder_plan.vp", f"{enc.vp}, but the encoder has no virtual stages: must be 1"
        )
    if llm.pp % enc.pp:
        raise _Invalid("encoder_plan.pp", f"{enc.pp} does not divide llm_plan.pp={llm.pp}")
    if llm.tp % enc.tp:
        raise _Invalid("encoder_plan.tp", f"{enc.tp} does not divide llm_plan.tp={llm.tp}")


def _check_partition(value: list, pipelines: int, n_mb: int) -> list[int]:
    """Microbatches per encoder pipeline: every pipeline gets at least one, all of them together."""
    partition = _int_list(value, "partition", pipelines)
    for j, count in enumerate(partition):
        _int(count, f"partition[{j}]", 1)
    if sum(partition) != n_mb:
        raise _Invalid(
            "partition", f"{partition} adds up to {sum(partition)}, not num_microbatches={n_mb}"
        )
    return partition


def _check_assignment(value: list, partition: list[int], n_mb: int) -> dict[tuple[int, int], int]:
    """The global ordering: every (encoder pipeline, local microbatch) feeds exactly one LLM
    microbatch."""
    if len(value) != n_mb:
        raise _Invalid(
            "assignment",
            f"{len(value)} entries, one per LLM microbatch: must be num_microbatches={n_mb}",
        )
    llm_microbatch: dict[tuple[int, int], int] = {}
    for i, pair in enumerate(value):
        field = f"assignment[{i}]"
        if not isinstance(pair, list) or len(pair) != 2:
            raise _Invalid(
                field, f"expected [encoder pipeline, local microbatch], got {_describe(pair)}"
            )
        j = _int(pair[0], f"{field}[0]", 0, len(partition) - 1)
        k = _int(pair[1], f"{field}[1]", 0, partition[j] - 1)
        if (j, k) in llm_microbatch:
            raise _Invalid(
                field,
                f"encoder pipeline {j}'s local microbatch {k} again (also assignment"
                f"[{llm_microbatch[(j, k)]}]): must be a permutation",
            )
        llm_microbatch[(j, k)] = i
    return (
        llm_microbatch  # n_mb distinct pairs out of sum(partition) == n_mb: each one exactly once
    )


def _check_warmup(value: list, llm: ParallelPlan, n_mb: int) -> None:
    warmup = _int_list(value, "warmup", llm.pp)
    for s, w in enumerate(warmup):
        if w > n_mb * llm.vp:
            raise _Invalid(
                f"warmup[{s}]",
                f"{w} forwards, but a stage runs {n_mb * llm.vp} (num_microbatches * vp)",
            )
    default = [default_warmup(llm.pp, llm.vp, n_mb, s) for s in range(llm.pp)]
    if llm.vp == 1 and warmup != default:
        # megatron-core's non-interleaved schedule computes its warm-up inline: it cannot be
        # adjusted
        raise _Invalid(
            "warmup", f"{warmup}, but without virtual stages megatron-core runs {default}"
        )
    unit = OpWork.sequential([("unit", 0, False, 1.0)])
    work = {(s, c, phase): unit for s in range(llm.pp) for c in range(llm.vp) for phase in PHASES}
    try:
        simulate(llm.pp, llm.vp, n_mb, work, 0.0, warmup)
    except PipelineDeadlock:
        raise _Invalid(
            "warmup",
            f"{warmup} deadlocks the LLM pipeline (pp={llm.pp}, vp={llm.vp}, {n_mb} "
            f"microbatches); megatron-core's default is {default}",
        ) from None


def _check_llm_kernels(
    value: dict, llm: ParallelPlan
) -> dict[int, dict[tuple[int, str], list[str]]]:
    """Kernel names of every (stage, chunk, phase) op; per stage {(chunk, phase): names}."""
    expected = [
        f"{s}/{c}/{phase}" for s in range(llm.pp) for c in range(llm.vp) for phase in PHASES
    ]
    _keys(value, tuple(expected), "llm_kernels")
    kernels: dict[int, dict[tuple[int, str], list[str]]] = {s: {} for s in range(llm.pp)}
    for key in expected:
        names = value[key]
        field = f"llm_kernels[{key!r}]"
        if not isinstance(names, list) or not names:
            raise _Invalid(
                field, f"expected a non-empty list of kernel names, got {_describe(names)}"
            )
        for n, name in enumerate(names):
            _typed(name, str, f"{field}[{n}]")
        s, c, phase = key.split("/")
        kernels[int(s)][(int(c), phase)] = names
    return kernels


def _check_fingerprint(value: dict) -> None:
    for key, setting in value.items():
        if setting is not None and not isinstance(setting, (str, int, float)):
            raise _Invalid(
                f"fingerprint[{key!r}]",
                f"expected a number, string, true/false or null, got {_describe(setting)}",
            )


def _check_stage_place(
    stage: Any, field: str, layout: list[list[list[int]]], llm: ParallelPlan
) -> tuple[int, int]:
    """(encoder pipeline, encoder stage) of an ``encoder_stages`` entry on the GPUs the plans give
    it."""
    _typed(stage, dict, field)
    _keys(stage, _STAGE_KEYS, field)
    j = _int(stage["encoder_pipeline"], f"{field}.encoder_pipeline", 0, len(layout) - 1)
    e = _int(stage["encoder_stage"], f"{field}.encoder_stage", 0, len(layout[j]) - 1)
    gpus = layout[j][e]
    if stage["gpus"] != gpus or not all(type(g) is int for g in stage["gpus"]):
        raise _Invalid(
            f"{field}.gpus",
            f"{_describe(stage['gpus'])}, but the plans put encoder pipeline {j} stage "
            f"{e} on GPUs {gpus}",
        )
    if _int(stage["llm_stage"], f"{field}.llm_stage") != gpus[0] // llm.tp:
        raise _Invalid(
            f"{field}.llm_stage",
            f"{stage['llm_stage']}, but GPUs {gpus} hold LLM stage {gpus[0] // llm.tp}",
        )
    _typed(stage["ops"], list, f"{field}.ops")
    return j, e


def _check_ops(
    ops: list,
    field: str,
    j: int,
    count: int,
    llm_microbatch: dict[tuple[int, int], int],
    kernels: dict[tuple[int, str], list[str]],
    llm: ParallelPlan,
    n_mb: int,
) -> None:
    """Every (phase, local microbatch, kernel_index) once, or as pieces that tile [0, 1]; each
    chain's kernel
    indexes 0..n-1; a forward chain for every local microbatch, and a backward chain for all of them
    or (frozen encoders) none; chains of the same phase equally long."""
    # (phase, local microbatch) -> kernel_index -> its pieces: (lo, hi, op)
    chains: dict[tuple[str, int], dict[int, list[tuple[float, float, int]]]] = {}
    for n, op in enumerate(ops):
        at = f"{field}[{n}]"
        phase, k, index, (lo, hi) = _check_op(op, at, j, count, llm_microbatch, kernels, llm, n_mb)
        chains.setdefault((phase, k), {}).setdefault(index, []).append((lo, hi, n))
    for (phase, k), chain in chains.items():
        for index, pieces in chain.items():
            reached = 0.0
            for lo, hi, n in sorted(pieces):
                if lo != reached:
                    raise _Invalid(
                        f"{field}[{n}].piece",
                        f"[{lo}, {hi}], but the pieces of kernel_index {index} "
                        f"in the {phase} chain of local microbatch {k} must tile [0, 1]: the next "
                        f"starts at {reached}",
                    )
                reached = hi
            if reached != 1.0:
                raise _Invalid(
                    f"{field}[{max(pieces)[2]}].piece",
                    f"the pieces of kernel_index {index} in the "
                    f"{phase} chain of local microbatch {k} end at {reached}, not 1",
                )
    for k in range(count):
        if ("fwd", k) not in chains:
            raise _Invalid(field, f"no fwd op of local microbatch {k}")
    with_backward = sorted(k for phase, k in chains if phase == "bwd")
    if with_backward and len(with_backward) != count:
        k = min(set(range(count)) - set(with_backward))
        raise _Invalid(
            field,
            f"no bwd op of local microbatch {k}, but local microbatch {with_backward[0]} has some",
        )
    for (phase, k), chain in sorted(chains.items()):
        for position, index in enumerate(sorted(chain)):
            if index != position:
                raise _Invalid(
                    f"{field}[{chain[index][0][2]}].kernel_index",
                    f"{index}, but the {phase} chain of "
                    f"local microbatch {k} has no kernel_index {position}",
                )
    for phase in PHASES:
        lengths = {k: len(chain) for (p, k), chain in sorted(chains.items()) if p == phase}
        whole = max(lengths, key=lengths.get, default=None)
        for k, length in lengths.items():
            if length < lengths[whole]:
                raise _Invalid(
                    field,
                    f"no {phase} op of local microbatch {k} with kernel_index {length}, but local "
                    f"microbatch {whole} has one",
                )


def _check_op(
    op: Any,
    at: str,
    j: int,
    count: int,
    llm_microbatch: dict[tuple[int, int], int],
    kernels: dict[tuple[int, str], list[str]],
    llm: ParallelPlan,
    n_mb: int,
) -> tuple[str, int, int, tuple[float, float]]:
    _typed(op, dict, at)
    _keys(op, _OP_KEYS, at)
    phase = _choice(op["phase"], PHASES, f"{at}.phase")
    k = _int(op["local_microbatch"], f"{at}.local_microbatch", 0, count - 1)
    if _int(op["microbatch"], f"{at}.microbatch") != llm_microbatch[(j, k)]:
        raise _Invalid(
            f"{at}.microbatch",
            f"{op['microbatch']}, but the assignment feeds LLM microbatch "
            f"{llm_microbatch[(j, k)]} from encoder pipeline {j}'s local microbatch {k}",
        )
    index = _int(op["kernel_index"], f"{at}.kernel_index")
    piece = _piece(op["piece"], f"{at}.piece")
    _typed(op["encoder"], str, f"{at}.encoder")
    _int(op["layer"], f"{at}.layer", -1)
    _typed(op["kernel"], str, f"{at}.kernel")
    _typed(op["is_comm"], bool, f"{at}.is_comm")
    _choice(op["window"], ("pre", "llm", "post"), f"{at}.window")
    for key in ("start_us", "end_us"):
        _finite(op[key], f"{at}.{key}")
    _check_hook(op["hook"], f"{at}.hook", kernels, llm, n_mb)
    return phase, k, index, piece


def _piece(value: Any, field: str) -> tuple[float, float]:
    """[lo, hi): a share of a kernel's tokens, 0 <= lo < hi <= 1."""
    if not isinstance(value, list) or len(value) != 2:
        raise _Invalid(
            field, f"expected [lo, hi], fractions of the kernel's tokens, got {_describe(value)}"
        )
    lo, hi = (_finite(x, f"{field}[{i}]") for i, x in enumerate(value))
    if not 0.0 <= lo < hi <= 1.0:
        raise _Invalid(field, f"{_describe(value)}, but must have 0 <= lo < hi <= 1")
    return lo, hi


def _check_hook(
    hook: Any, at: str, kernels: dict[tuple[int, str], list[str]], llm: ParallelPlan, n_mb: int
) -> None:
    """A hook names a moment of this stage's LLM ops; ``llm_kernel`` names an op and one of its
    kernels (its ``kernel`` and ``layer`` only describe it: the runtime goes by
    ``kernel_index``)."""
    _typed(hook, dict, at)
    if "at" not in hook:
        raise _Invalid(f"{at}.at", "missing")
    kind = _choice(hook["at"], HOOK_KINDS, f"{at}.at")
    if kind != "llm_kernel":
        _keys(hook, ("at",), at)
        return
    _keys(hook, _LLM_HOOK_KEYS, at)
    phase = _choice(hook["phase"], PHASES, f"{at}.phase")
    chunk = _int(hook["chunk"], f"{at}.chunk", 0, llm.vp - 1)
    _int(hook["microbatch"], f"{at}.microbatch", 0, n_mb - 1)
    names = kernels[(chunk, phase)]
    if _int(hook["kernel_index"], f"{at}.kernel_index") >= len(names):
        raise _Invalid(
            f"{at}.kernel_index",
            f"{hook['kernel_index']}, but the LLM's {phase} of chunk {chunk} on this "
            f"stage has {len(names)} kernels (llm_kernels)",
        )
    _typed(hook["kernel"], str, f"{at}.kernel")
    _int(hook["layer"], f"{at}.layer", -1)
    _typed(hook["after"], bool, f"{at}.after")


# -- the artifact against the job -------------------------------------------------------------


def _check_job(data: dict[str, Any], config: OptimusConfig) -> None:
    llm, enc = ParallelPlan(**data["llm_plan"]), ParallelPlan(**data["encoder_plan"])
    n_mb = config.num_microbatches_total // llm.dp
    if data["num_microbatches"] != n_mb:
        raise _Invalid(
            "num_microbatches",
            f"{data['num_microbatches']}, but this job runs {n_mb} per LLM pipeline "
            "(training.global_batch_size / micro_batch_size / dp)",
        )
    # kernel names and order only: no profile needed
    cost = CostModel(config.cluster, config.cost_model)
    for (s, c, phase), work in llm_op_work(config, llm, cost).items():
        key, names = f"{s}/{c}/{phase}", [k.name for k in work.kernels]
        have = data["llm_kernels"][key]
        if have != names:
            n = next((n for n, (a, b) in enumerate(zip(have, names)) if a != b), None)
            if n is None:
                raise _Invalid(
                    f"llm_kernels[{key!r}]",
                    f"{len(have)} kernels, but this job's LLM runs {len(names)}",
                )
            raise _Invalid(
                f"llm_kernels[{key!r}][{n}]",
                f"{have[n]!r}, but this job's LLM runs {names[n]!r} there",
            )
    work = build_encoder_work(config, llm, enc, cost)
    for i, stage in enumerate(data["encoder_stages"]):
        e = stage["encoder_stage"]
        _check_chains(
            stage["ops"], f"encoder_stages[{i}].ops", e, {"fwd": work.fwd[e], "bwd": work.bwd[e]}
        )


def _check_chains(
    ops: list[dict[str, Any]], field: str, e: int, chains: dict[str, StageChain]
) -> None:
    """Each op is the kernel this job's encoder stage runs at its kernel_index, a piece of it only
    if it
    can be split, and each chain is whole (``validate_artifact`` made the chains of a phase
    contiguous and equally long)."""
    length = {phase: 0 for phase in PHASES}
    names_of = {phase: [k.name for k in chain.kernels] for phase, chain in chains.items()}
    for n, op in enumerate(ops):
        kernels, names, index = (
            chains[op["phase"]].kernels,
            names_of[op["phase"]],
            op["kernel_index"],
        )
        if index >= len(names):
            raise _Invalid(
                f"{field}[{n}].kernel_index",
                f"{index}, but encoder stage {e}'s {op['phase']} chain has "
                f"{len(names)} kernels"
                + (" (frozen encoders have no backward)" if not names else ""),
            )
        if op["kernel"] != names[index]:
            raise _Invalid(
                f"{field}[{n}].kernel",
                f"{op['kernel']!r}, but kernel {index} of encoder stage {e}'s "
                f"{op['phase']} chain is {names[index]!r}",
            )
        if op["piece"] != [0.0, 1.0] and not kernels[index].splittable:
            raise _Invalid(
                f"{field}[{n}].piece",
                f"{_describe(op['piece'])}, but this job's encoder runs kernel "
                f"{index} ({names[index]!r}) whole: only a layer's compute kernels without dropout "
                "split",
            )
        length[op["phase"]] = max(length[op["phase"]], index + 1)
    for phase, chain in chains.items():
        if length[phase] != len(chain.kernels):
            raise _Invalid(
                field,
                f"the {phase} chains have {length[phase]} kernels, but encoder stage {e}'s "
                f"{phase} chain has {len(chain.kernels)}",
            )


# -- field types --------------------------------------------------------------------------------

_JSON_NAMES = {
    str: "a string",
    int: "an integer",
    float: "a number",
    bool: "true or false",
    list: "a list",
    dict: "an object",
}


def _typed(value: Any, kind: type, field: str) -> Any:
    if kind is int:
        return _int(value, field)
    if not isinstance(value, kind):
        raise _Invalid(field, f"expected {_JSON_NAMES[kind]}, got {_describe(value)}")
    return value


def _int(value: Any, field: str, lo: int = 0, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _Invalid(field, f"expected an integer, got {_describe(value)}")
    if value < lo or (hi is not None and value > hi):
        bound = f"in {lo}..{hi}" if hi is not None else f">= {lo}"
        raise _Invalid(field, f"{value}, but must be {bound}")
    return value


def _int_list(value: list, field: str, length: int) -> list[int]:
    if len(value) != length:
        raise _Invalid(field, f"{len(value)} entries, but the plans need {length}")
    for n, item in enumerate(value):
        _int(item, f"{field}[{n}]")
    return value


def _choice(value: Any, allowed: tuple[str, ...], field: str) -> str:
    if value not in allowed:
        raise _Invalid(field, f"{_describe(value)}, but must be one of {', '.join(allowed)}")
    return value


def _keys(mapping: dict, expected: tuple[str, ...], field: str) -> None:
    prefix = f"{field}." if field else ""
    for key in mapping:
        if key not in expected:
            raise _Invalid(f"{prefix}{key}", f"unknown key; valid keys: {', '.join(expected)}")
    for key in expected:
        if key not in mapping:
            raise _Invalid(f"{prefix}{key}", "missing")


def _plan(value: dict, field: str) -> ParallelPlan:
    _keys(value, _PLAN_KEYS, field)
    return ParallelPlan(**{key: _int(value[key], f"{field}.{key}", 1) for key in _PLAN_KEYS})


def _describe(value: Any) -> str:
    """A JSON value as the file has it, shortened."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."
