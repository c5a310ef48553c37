"""The runtime's point-to-point messages obey NCCL's matching rules, checked on gloo.

gloo matches a send with a receive by (peer, tag); NCCL ignores tags and matches by order on each
communicator, and a communicator whose two ranks both send first can deadlock. Each rank records
every P2P call of one Optimus training step (LLM pipeline and encoder plan alike); the check then
holds the records to NCCL's rules: no tags, no P2P on the default group, one direction per group,
and on every group the k-th send and the k-th receive agree in shape and dtype.
"""

from __future__ import annotations

import copy
from collections import defaultdict

import pytest

from tests.conftest import CONFIGS
from tests.distributed_utils import run_distributed

TINY = str(CONFIGS / "tiny.yaml")
PP4_V2 = ["model.llm.num_layers=8", "parallel.llm={dp: 1, pp: 4, tp: 1, vp: 2}"]
ENC_PP2 = ["parallel.encoder={pp: 2, tp: 1}"]


def _recorded_step(overrides: list[str], artifact: dict) -> list[tuple]:
    """One rank: train one step with every P2P call recorded as (op, group, me, peer, shape, dtype, tag)."""
    import torch.distributed as dist

    from optimus_mllm.config import load_config
    from optimus_mllm.planner import plan
    from optimus_mllm.runtime.trainer import Trainer

    records: list[tuple] = []
    me = dist.get_rank()

    def recording(op: str, original):
        def call(tensor, peer=None, group=None, tag=0, **kwargs):
            name = "default" if group is None or group == dist.group.WORLD else group.group_name
            records.append((op, name, me, peer, tuple(tensor.shape), str(tensor.dtype), tag))
            return original(tensor, peer, group=group, tag=tag, **kwargs)
        return call

    originals = {op: getattr(dist, op) for op in ("send", "recv", "isend", "irecv")}
    config = load_config(TINY, overrides)
    trainer = Trainer(config, plan(config).llm_plan, "optimus", artifact)
    for op, original in originals.items():
        setattr(dist, op, recording(op, original))
    try:
        trainer.train_step(0)
    finally:
        for op, original in originals.items():
            setattr(dist, op, original)
    trainer.close()
    return records


def _artifact(overrides: list[str]) -> dict:
    from optimus_mllm.config import load_config
    from optimus_mllm.cost_model import CostModel
    from optimus_mllm.planner import plan
    from optimus_mllm.scheduler.artifact import schedule_to_artifact
    from optimus_mllm.scheduler.bubble_scheduler import optimus

    config = load_config(TINY, overrides)
    schedule = optimus(config, plan(config), CostModel.from_config(config)).best
    return schedule_to_artifact(schedule, config)


def nccl_violations(records: list[tuple]) -> list[str]:
    """What NCCL would match differently from gloo, or could deadlock on, in these P2P records."""
    problems = []
    sends: dict[tuple[str, int, int], list] = defaultdict(list)  # (group, sender, receiver) -> [(shape, dtype)]
    recvs: dict[tuple[str, int, int], list] = defaultdict(list)
    directions: dict[str, set] = defaultdict(set)
    for op, group, me, peer, shape, dtype, tag in records:
        if tag:
            problems.append(f"{op} from rank {me} uses tag {tag}: NCCL ignores tags")
        if group == "default":
            problems.append(f"{op} on rank {me} goes over the default group, shared by every kind of message")
        if op in ("send", "isend"):
            sends[(group, me, peer)].append((shape, dtype))
            directions[group].add((me, peer))
        else:
            recvs[(group, peer, me)].append((shape, dtype))
    for group, ways in directions.items():
        if len(ways) > 1:
            problems.append(f"group {group} carries sends both ways {sorted(ways)}: opposing sends can deadlock")
    for key in sends.keys() | recvs.keys():
        if sends[key] != recvs[key]:
            problems.append(f"group {key[0]} from rank {key[1]} to {key[2]}: sends {sends[key]} but receives "
                            f"{recvs[key]} in order")
    return problems


def test_the_checker_finds_tags_shared_groups_opposing_sends_and_order_mismatches():
    records = [("isend", "default", 0, 1, (2,), "f", 5), ("recv", "default", 1, 0, (2,), "f", 5),
               ("isend", "g", 0, 1, (2,), "f", 0), ("isend", "g", 1, 0, (2,), "f", 0),
               ("recv", "g", 1, 0, (3,), "f", 0), ("recv", "g", 0, 1, (2,), "f", 0)]
    text = "\n".join(nccl_violations(records))
    assert "uses tag 5" in text and "default group" in text and "both ways" in text
    assert "sends [((2,), 'f')] but receives [((3,), 'f')]" in text


def _shuffled_hooks(artifact: dict) -> dict:
    """Every encoder op's hook at the first LLM op of its stage, reversed chain order: consumption order
    differs from the order the channels deliver in."""
    artifact = copy.deepcopy(artifact)
    for stage in artifact["encoder_stages"]:
        stage["ops"].reverse()
    return artifact


@pytest.mark.parametrize("overrides, shuffle", [([], False), (ENC_PP2, True), (PP4_V2, False)],
                         ids=["tiny", "encoder-PP2-reordered", "PP4-V2-adjusted"])
def test_runtime_messages_follow_nccl_matching_rules(overrides, shuffle):
    artifact = _artifact(overrides)
    if shuffle:
        artifact = _shuffled_hooks(artifact)
    per_rank = run_distributed(_recorded_step, 4, overrides, artifact, timeout=240)
    records = [r for rank in per_rank for r in rank]
    assert any(op in ("isend", "send") for op, *_ in records), "no P2P recorded: the check saw nothing"
    assert nccl_violations(records) == []
