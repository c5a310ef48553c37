"""The runtime's point-to-point messages obey NCCL's matching rules, checked on gloo.

Each rank records every P2P call of one Optimus training step (LLM pipeline and encoder plan alike);
tests/p2p_audit.py's ``nccl_violations`` then holds the records to NCCL's rules.
"""

from __future__ import annotations

import pytest

from optimus_mllm.scheduler.artifact_format import ScheduleArtifact, artifact_to_json

from support.artifact_utils import artifact_for, checked
from support.distributed_utils import run_distributed
from support.p2p_audit import nccl_violations, recorded_p2p
from support.paths import CONFIGS

pytestmark = pytest.mark.distributed

TINY = str(CONFIGS / "tiny.yaml")
PP4_V2 = ["model.llm.num_layers=8", "parallel.llm={dp: 1, pp: 4, tp: 1, vp: 2}"]
ENC_PP2 = ["parallel.encoder={pp: 2, tp: 1}"]


def _recorded_step(overrides: list[str], artifact: dict) -> list[tuple]:
    """One rank: train one step with every P2P call recorded (tests/p2p_audit.py)."""
    from optimus_mllm.config import load_config
    from optimus_mllm.planner import plan
    from optimus_mllm.runtime.trainer import Trainer

    config = load_config(TINY, overrides)
    trainer = Trainer(config, plan(config).llm_plan, "optimus", artifact)
    with recorded_p2p() as records:
        trainer.train_step(0)
    trainer.close()
    return records


def test_the_checker_finds_tags_shared_groups_opposing_sends_and_order_mismatches():
    records = [
        ("isend", "default", 0, 1, (2,), "f", 5),
        ("recv", "default", 1, 0, (2,), "f", 5),
        ("isend", "g", 0, 1, (2,), "f", 0),
        ("isend", "g", 1, 0, (2,), "f", 0),
        ("recv", "g", 1, 0, (3,), "f", 0),
        ("recv", "g", 0, 1, (2,), "f", 0),
    ]
    text = "\n".join(nccl_violations(records))
    assert "uses tag 5" in text and "default group" in text and "both ways" in text
    assert "sends [((2,), 'f')] but receives [((3,), 'f')]" in text


def _reversed_chains(artifact: ScheduleArtifact) -> ScheduleArtifact:
    """Every stage's forward chains before the LLM and backward chains after it, each phase's
    chains in reverse microbatch order (a chain's kernels still in order): consumption order
    differs from the order the channels deliver in."""
    data = artifact_to_json(artifact)
    for stage in data["encoder_stages"]:
        ops = []
        for phase, at in (("fwd", "before_first_compute"), ("bwd", "after_last_compute")):
            chains = sorted(
                {op["local_microbatch"] for op in stage["ops"] if op["phase"] == phase},
                reverse=True,
            )
            for k in chains:
                for op in stage["ops"]:
                    if (op["phase"], op["local_microbatch"]) == (phase, k):
                        ops.append({**op, "hook": {"at": at, "llm_kernel": None}})
        stage["ops"] = ops
    return checked(data)


CASES = {
    "tiny": ([], False),
    "encoder-PP2-reordered": (ENC_PP2, True),
    "PP4-V2-adjusted": (PP4_V2, False),
}


def _recorded_steps(cases: dict[str, tuple[list[str], dict]]) -> dict[str, list[tuple]]:
    """One rank of every case, one launch: each case's step, recorded on its own."""
    return {
        name: _recorded_step(overrides, artifact) for name, (overrides, artifact) in cases.items()
    }


@pytest.fixture(scope="module")
def recorded() -> list[dict[str, list[tuple]]]:
    cases = {}
    for name, (overrides, shuffle) in CASES.items():
        artifact = artifact_for(TINY, overrides)
        cases[name] = (overrides, _reversed_chains(artifact) if shuffle else artifact)
    return run_distributed(_recorded_steps, 4, cases, timeout=400)


@pytest.mark.parametrize("case", CASES)
def test_runtime_messages_follow_nccl_matching_rules(recorded, case):
    records = [r for rank in recorded for r in rank[case]]
    assert any(op in ("isend", "send") for op, *_ in records), (
        "no P2P recorded: the check saw nothing"
    )
    assert nccl_violations(records) == []
