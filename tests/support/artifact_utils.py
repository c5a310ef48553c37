"""Schedule artifacts edited for tests."""

from __future__ import annotations

import copy
import random
from collections.abc import Sequence
from pathlib import Path


def artifact_for(config_path: str | Path, overrides: Sequence[str] = ()) -> dict:
    """The schedule artifact ``optimus-plan --artifact`` writes for this config."""
    from optimus_mllm.config import load_config
    from optimus_mllm.planner import plan
    from optimus_mllm.scheduler.artifact import schedule_job_artifact

    config = load_config(str(config_path), list(overrides))
    return schedule_job_artifact(config, plan(config))


def shuffled_hooks(artifact: dict, seed: int) -> dict:
    """A copy whose every encoder op is hooked at a random LLM kernel of its stage: predictions gone
    wrong."""
    rng = random.Random(seed)
    artifact = copy.deepcopy(artifact)
    for stage in artifact["encoder_stages"]:
        keys = [k for k in artifact["llm_kernels"] if k.startswith(f"{stage['llm_stage']}/")]
        for op in stage["ops"]:
            key = rng.choice(keys)
            _, chunk, phase = key.split("/")
            op["hook"] = {
                "at": "llm_kernel",
                "phase": phase,
                "chunk": int(chunk),
                "microbatch": rng.randrange(artifact["num_microbatches"]),
                "kernel_index": rng.randrange(len(artifact["llm_kernels"][key])),
                "kernel": "?",
                "layer": 0,
                "after": rng.random() < 0.5,
            }
    return artifact


def split_kernels(
    artifact: dict, config_path: str | Path, cuts: Sequence[float], overrides: Sequence[str] = ()
) -> dict:
    """A copy whose every op of a kernel the job's encoder can split (``EncoderKernel.splittable``)
    runs as
    pieces of its tokens cut at ``cuts``, each hooked where the whole op was, its predicted time
    shared out."""
    from optimus_mllm.config import load_config
    from optimus_mllm.cost_model import CostModel
    from optimus_mllm.planner.plans import ParallelPlan
    from optimus_mllm.scheduler.encoder_costs import build_encoder_work

    config = load_config(str(config_path), list(overrides))
    work = build_encoder_work(
        config,
        ParallelPlan(**artifact["llm_plan"]),
        ParallelPlan(**artifact["encoder_plan"]),
        CostModel.from_config(config),
    )
    bounds = [0.0, *cuts, 1.0]
    artifact = copy.deepcopy(artifact)
    for stage in artifact["encoder_stages"]:
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
    return artifact
