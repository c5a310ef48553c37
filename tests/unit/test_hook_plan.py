"""Hook plan: artifact hooks mapped to observable events, and no placement that can deadlock."""

from __future__ import annotations

import copy
import random

import pytest

from optimus_mllm.runtime.hook_plan import (
    OBSERVABLE_COLLECTIVES,
    POST,
    PRE,
    _stuck_microbatches,
    build_hook_plan,
)

from support.artifact_utils import artifact_for
from support.paths import CONFIGS


@pytest.fixture(scope="module")
def artifacts():
    return {
        "tiny": artifact_for(CONFIGS / "tiny.yaml"),
        "fig5": artifact_for(CONFIGS / "paper" / "fig5_8gpu.yaml"),
    }


def _chain_positions(hp):
    for stage in hp.stages:
        position = {e: i for i, e in enumerate(hp.events[stage.llm_stage])}
        seen: dict[tuple, tuple[int, tuple[float, float], int]] = {}
        for op in stage.ops:
            key = (op.phase, op.local_microbatch)
            if key in seen:
                last_index, last_piece, last_pos = seen[key]
                if last_piece[1] < 1.0:  # a kernel cut into pieces: the next piece of its tokens
                    assert (op.kernel_index, op.piece[0]) == (last_index, last_piece[1]), (
                        "pieces run in order"
                    )
                else:
                    assert (op.kernel_index, op.piece[0]) == (last_index + 1, 0.0), (
                        "chain ops run in kernel order"
                    )
                assert position[op.event] >= last_pos
            else:
                assert (op.kernel_index, op.piece[0]) == (0, 0.0)
            seen[key] = (op.kernel_index, op.piece, position[op.event])


@pytest.mark.parametrize("name", ["tiny", "fig5"])
def test_scheduler_artifact_needs_no_repair(artifacts, name):
    artifact = artifacts[name]
    hp = build_hook_plan(artifact)
    assert hp.moved_microbatches == ()
    assert all(op.event == op.assigned for st in hp.stages for op in st.ops)
    assert sum(len(st.ops) for st in hp.stages) == sum(
        len(st["ops"]) for st in artifact["encoder_stages"]
    )
    _chain_positions(hp)
    windows = {op["window"] for st in artifact["encoder_stages"] for op in st["ops"]}
    assert "llm" in windows  # the schedule really uses hooks inside the LLM's ops
    events = {op.event[0] for st in hp.stages for op in st.ops}
    assert {"pre"} <= events and events - {"pre", "post"}


def test_hook_mapping_to_observable_events(artifacts):
    # TP2 with sequence parallelism: tp_rs_attn / tp_rs_mlp are observable
    artifact = artifacts["fig5"]
    hp = build_hook_plan(artifact)
    names = artifact["llm_kernels"]
    seen = set()
    for stage, raw_stage in zip(hp.stages, artifact["encoder_stages"]):
        ops = sorted(
            stage.ops, key=lambda o: (o.phase, o.local_microbatch, o.kernel_index, o.piece)
        )
        raws = sorted(
            raw_stage["ops"],
            key=lambda o: (o["phase"], o["local_microbatch"], o["kernel_index"], tuple(o["piece"])),
        )
        for op, raw in zip(ops, raws):
            hook = raw["hook"]
            if hook["at"] != "llm_kernel":
                assert op.assigned == (PRE if hook["at"] == "before_first_compute" else POST)
                seen.add(hook["at"])
                continue
            kernel = names[f"{stage.llm_stage}/{hook['chunk']}/{hook['phase']}"][
                hook["kernel_index"]
            ]
            if hook["phase"] == "fwd" and kernel in OBSERVABLE_COLLECTIVES:
                assert op.assigned[0] == ("tp_after" if hook["after"] else "tp_before")
                seen.add("collective")
            elif hook["phase"] == "bwd":
                assert op.assigned[0] in ("op_start", "op_end")
                seen.add("bwd")
            else:
                assert op.assigned[0] in ("op_start", "tp_after", "op_end")
                seen.add("fwd compute")
    assert seen == {
        "before_first_compute",
        "after_last_compute",
        "collective",
        "bwd",
        "fwd compute",
    }


def _shuffled(artifact, seed):
    """Hooks at random LLM kernels: what arbitrarily wrong time predictions could produce."""
    rng = random.Random(seed)
    artifact = copy.deepcopy(artifact)
    n = artifact["num_microbatches"]
    for stage in artifact["encoder_stages"]:
        keys = [k for k in artifact["llm_kernels"] if k.startswith(f"{stage['llm_stage']}/")]
        for op in stage["ops"]:
            key = rng.choice(keys)
            _, chunk, phase = key.split("/")
            op["hook"] = {
                "at": "llm_kernel",
                "phase": phase,
                "chunk": int(chunk),
                "microbatch": rng.randrange(n),
                "kernel_index": rng.randrange(len(artifact["llm_kernels"][key])),
                "kernel": "?",
                "layer": 0,
                "after": rng.random() < 0.5,
            }
    return artifact


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("name", ["tiny", "fig5"])
def test_wrong_predictions_are_repaired_into_a_deadlock_free_plan(artifacts, name, seed):
    artifact = _shuffled(artifacts[name], seed)
    hp = build_hook_plan(artifact)
    assert hp.moved_microbatches, "random hooks put some encoder work before its inputs exist"
    assert _stuck_microbatches(hp, artifact) == set()
    _chain_positions(hp)
    for mb, phase in hp.moved_microbatches:
        target = PRE if phase == "fwd" else POST
        assert all(
            op.event == target
            for st in hp.stages
            for op in st.ops
            if (op.microbatch, op.phase) == (mb, phase)
        )


def test_cycle_detection_sees_an_encoder_output_needed_before_it_exists(artifacts):
    """Encoder forward of microbatch 0 placed after the LLM's last op: the LLM would wait
    forever."""
    artifact = copy.deepcopy(artifacts["tiny"])
    for stage in artifact["encoder_stages"]:
        for op in stage["ops"]:
            if op["microbatch"] == 0 and op["phase"] == "fwd":
                op["hook"] = {"at": "after_last_compute"}
    hp = build_hook_plan(artifact)
    assert (0, "fwd") in hp.moved_microbatches
    assert all(
        op.event == PRE
        for st in hp.stages
        for op in st.ops
        if (op.microbatch, op.phase) == (0, "fwd")
    )
