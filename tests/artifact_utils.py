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
    """A copy whose every encoder op is hooked at a random LLM kernel of its stage: predictions gone wrong."""
    rng = random.Random(seed)
    artifact = copy.deepcopy(artifact)
    for stage in artifact["encoder_stages"]:
        keys = [k for k in artifact["llm_kernels"] if k.startswith(f"{stage['llm_stage']}/")]
        for op in stage["ops"]:
            key = rng.choice(keys)
            _, chunk, phase = key.split("/")
            op["hook"] = {"at": "llm_kernel", "phase": phase, "chunk": int(chunk),
                          "microbatch": rng.randrange(artifact["num_microbatches"]),
                          "kernel_index": rng.randrange(len(artifact["llm_kernels"][key])),
                          "kernel": "?", "layer": 0, "after": rng.random() < 0.5}
    return artifact
