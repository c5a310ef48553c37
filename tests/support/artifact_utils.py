"""Schedule artifacts edited for tests: as a file would be, then read back by the typed loader and
checked, so that every edited artifact is one ``optimus-train --schedule`` would run."""

from __future__ import annotations

import copy
import random
from collections.abc import Sequence
from pathlib import Path

from optimus_mllm.scheduler.artifact_checks import validate_artifact
from optimus_mllm.scheduler.artifact_format import (
    ScheduleArtifact,
    artifact_from_json,
    artifact_to_json,
)
from optimus_mllm.scheduler.pipeline_order import rank_op_order


def artifact_for(config_path: str | Path, overrides: Sequence[str] = ()) -> ScheduleArtifact:
    """The schedule artifact ``optimus-plan --artifact`` writes for this config."""
    from optimus_mllm.config import load_config
    from optimus_mllm.planner import plan
    from optimus_mllm.scheduler.artifact import schedule_job_artifact

    config = load_config(str(config_path), list(overrides))
    return schedule_job_artifact(config, plan(config))


def checked(data: dict) -> ScheduleArtifact:
    """An edited artifact's JSON, typed and checked as ``load_artifact`` would."""
    artifact = artifact_from_json(data)
    validate_artifact(artifact, "edited artifact")
    return artifact


def _moment(hook: dict, order: dict[tuple, int]) -> tuple:
    """Where a hook falls in its stage's execution (``artifact_checks._hook_moment``)."""
    if hook["at"] != "llm_kernel":
        return (0,) if hook["at"] == "before_first_compute" else (2,)
    kernel = hook["llm_kernel"]
    op = kernel["op"]
    return (
        1,
        order[(op["microbatch"], op["chunk"], op["phase"])],
        kernel["kernel_index"],
        kernel["after"],
    )


def _stage_order(data: dict, stage: int) -> dict[tuple, int]:
    return {
        (op["microbatch"], op["chunk"], op["phase"]): k
        for k, op in enumerate(data["llm_op_order"][stage])
    }


def shuffled_hooks(artifact: ScheduleArtifact, seed: int) -> ScheduleArtifact:
    """A copy whose encoder ops are hooked at random LLM kernels of their stage: predictions gone
    wrong. The random hooks are handed out in the order the stage lists its ops, so that each still
    runs at its hook (a chain's kernels in order)."""
    rng = random.Random(seed)
    data = artifact_to_json(artifact)
    for stage in data["encoder_stages"]:
        order = _stage_order(data, stage["llm_stage"])
        llm_ops = data["llm_op_order"][stage["llm_stage"]]
        hooks = []
        for _ in stage["ops"]:
            op = rng.choice(llm_ops)
            names = data["llm_kernels"][f"{stage['llm_stage']}/{op['chunk']}/{op['phase']}"]
            index = rng.randrange(len(names))
            after = rng.random() < 0.5
            hooks.append(
                {
                    "at": "llm_kernel",
                    "llm_kernel": {
                        "op": dict(op),
                        "kernel_index": index,
                        "kernel": names[index],
                        "layer": 0,
                        "after": after,
                    },
                }
            )
        hooks.sort(key=lambda hook: _moment(hook, order))
        for op, hook in zip(stage["ops"], hooks):
            op["hook"] = hook
    return checked(data)


def with_warmup(artifact: ScheduleArtifact, warmup: list[int]) -> ScheduleArtifact:
    """A copy run under another LLM warm-up: megatron-core's op order under it, and each encoder op
    hooked where the scheduler put it, or where the op before it is hooked if that is now later
    (the new order can put an earlier hook's LLM op after a later one's)."""
    data = artifact_to_json(artifact)
    data["warmup"] = list(warmup)
    llm = data["llm_plan"]
    data["llm_op_order"] = [
        [
            {"microbatch": mb, "chunk": chunk, "phase": phase}
            for mb, chunk, phase in rank_op_order(
                data["num_microbatches"], llm["vp"], warmup[s], llm["pp"]
            )
        ]
        for s in range(llm["pp"])
    ]
    for stage in data["encoder_stages"]:
        order = _stage_order(data, stage["llm_stage"])
        previous = None
        for op in stage["ops"]:
            if previous is not None and _moment(op["hook"], order) < _moment(previous, order):
                op["hook"] = copy.deepcopy(previous)
            previous = op["hook"]
    return checked(data)


def split_kernels(
    artifact: ScheduleArtifact,
    config_path: str | Path,
    cuts: Sequence[float],
    overrides: Sequence[str] = (),
) -> ScheduleArtifact:
    """A copy whose every op of a kernel the job's encoder can split (``EncoderKernel.splittable``)
    runs as
    pieces of its tokens cut at ``cuts``, each hooked where the whole op was, its predicted time
    shared out."""
    from optimus_mllm.config import load_config
    from optimus_mllm.costing.cost_model import CostModel
    from optimus_mllm.scheduler.encoder_costs import build_encoder_work

    config = load_config(str(config_path), list(overrides))
    work = build_encoder_work(
        config,
        artifact.llm_plan,
        artifact.encoder_plan,
        CostModel.from_config(config),
    )
    bounds = [0.0, *cuts, 1.0]
    data = artifact_to_json(artifact)
    for stage in data["encoder_stages"]:
        chains = {"fwd": work.fwd[stage["encoder_stage"]], "bwd": work.bwd[stage["encoder_stage"]]}
        ops = []
        for op in stage["ops"]:
            if not chains[op["phase"]].kernels[op["kernel_index"]].splittable:
                ops.append(op)
                continue
            start, span = op["start_us"], op["end_us"] - op["start_us"]
            ops += [
                {
                    **copy.deepcopy(op),
                    "piece": [lo, hi],
                    "start_us": start + lo * span,
                    "end_us": start + hi * span,
                }
                for lo, hi in zip(bounds, bounds[1:])
            ]
        stage["ops"] = ops
    return checked(data)
