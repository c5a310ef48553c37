"""Beyond one machine: two torchrun "nodes" of 2 processes each, on this machine, meeting through
torchrun's c10d rendezvous as the nodes of a cluster do, train the tiny job with the Optimus runtime
like one node of 4 processes.

The two-node job says ``cluster.gpus_per_node=2`` (tiny.yaml's 4 is the one-node job's); each job
plans and schedules itself, as ``optimus-train`` does. The test first checks that both settings give
the same plans, partition and warm-up: the node size only changes the cost model's bandwidths, so
the bubbles' lengths, and with them which LLM kernel each encoder op is placed at and the predicted
times. The two jobs then run the same layers on the same ranks, the encoder's ops at other hook
points, which changes no number: their printed losses and gradient norms must be equal.

Each node reads its own command line and files: a node missing a file, or launched with another
setting, stops the job with one line (``runtime.same_job``) instead of hanging the other node or
training a job of mixed settings.
"""

from __future__ import annotations

import re
import subprocess

import pytest

from optimus_mllm.runtime.process_groups import build_encoder_rank_layout, megatron_rank
from optimus_mllm.scheduler.artifact_format import ScheduleArtifact, artifact_to_json

from support.artifact_utils import artifact_for
from support.train_utils import (
    STEP,
    SUMMARY,
    TINY,
    communicate_all,
    ranks,
    step_numbers,
    torchrun,
    torchrun_nodes,
)

pytestmark = pytest.mark.distributed

TWO_NODES = ("--override", "cluster.gpus_per_node=2")


def _unplaced(artifact: ScheduleArtifact) -> dict:
    """A schedule without what depends on the node size alone: its fingerprint (which names
    gpus_per_node), the predicted times and each encoder op's hook point."""
    data = artifact_to_json(artifact)
    for stage in data["encoder_stages"]:
        for op in stage["ops"]:
            del op["start_us"], op["end_us"], op["hook"], op["window"]
    del data["fingerprint"], data["predicted"]
    return data


def test_nodes_of_two_schedule_like_one_node_with_tp_inside_a_node():
    two_nodes = artifact_for(TINY, ["cluster.gpus_per_node=2"])
    assert _unplaced(two_nodes) == _unplaced(artifact_for(TINY)), (
        "the node size changed the plans, partition or warm-up: pin them for both runs"
    )
    llm, encoder = two_nodes.llm_plan, two_nodes.encoder_plan
    assert (llm.tp, llm.pp) == (2, 2)
    llm_tp_groups = [
        [megatron_rank(llm, dp, pp, tp) for tp in range(llm.tp)]
        for dp in range(llm.dp)
        for pp in range(llm.pp)
    ]
    encoder_tp_groups = build_encoder_rank_layout(llm, encoder).tp_groups
    # torchrun numbers ranks node by node: rank r runs on node r // 2
    for group in [*llm_tp_groups, *encoder_tp_groups]:
        assert len({rank // 2 for rank in group}) == 1, group


def test_two_nodes_of_two_train_like_one_node_of_four():
    agents = communicate_all(torchrun_nodes(TWO_NODES, TWO_NODES))
    assert [agent.returncode for agent in agents] == [0, 0], [a.stderr[-3000:] for a in agents]
    # rank 0 prints; the rendezvous decides which agent runs it
    printing = [agent.stdout.splitlines() for agent in agents if agent.stdout]
    assert len(printing) == 1, [agent.stdout for agent in agents]
    two_nodes = printing[0]
    assert [STEP.match(line).group(1) for line in two_nodes[:3]] == ["1", "2", "3"], two_nodes
    assert SUMMARY.match(two_nodes[3]), two_nodes
    assert all("encoder ops inside LLM span" in line for line in two_nodes[:3]), two_nodes

    one_node = torchrun(nproc=4)
    assert step_numbers(two_nodes) == step_numbers(one_node)
    assert len(step_numbers(one_node)) == 3, one_node


def _the_one_error_line(done: list[subprocess.CompletedProcess]) -> str:
    """Every rank of both nodes exited 2, nothing trained, and one line across them says why."""
    assert [d.returncode for d in done] == [2] * len(done), [d.stderr[-3000:] for d in done]
    assert not any(STEP.match(line) for d in done for line in d.stdout.splitlines())
    errors = [line for d in done for line in d.stderr.splitlines()]
    assert len(errors) == 1 and errors[0].startswith("optimus-train: error:"), errors
    return errors[0]


# The refusals start the ranks of both nodes forked, each node's with its own arguments and
# torchrun's numbering (a fresh interpreter per rank and agent cost 6 imports of torch a test);
# the two-node training above runs under real agents.


def test_a_node_launched_with_another_setting_stops_the_job_in_one_line():
    """Each node reads its own command line: one with another learning rate used to train, silently,
    a job of mixed learning rates."""
    error = _the_one_error_line(ranks(4, nodes=(TWO_NODES, (*TWO_NODES, "training.lr=5e-4"))))
    said = re.fullmatch(
        r"optimus-train: error: rank 2 \(host .+\) runs another job than rank 0 \(host .+\): "
        r"training\.lr is (\S+) there, (\S+) on rank 0; launch every node with the same command "
        r"and the same files",
        error,
    )
    assert said and {said[1], said[2]} == {"0.0005", "0.0001"}, error


def test_a_node_missing_a_file_stops_the_job_in_one_line(tmp_path):
    """A problem one node meets before connecting used to stop that node's ranks silently (only
    rank 0 reports such problems) and leave the other node's ranks waiting in the handshake."""
    missing = tmp_path / "no-such-data"
    error = _the_one_error_line(ranks(4, nodes=(TWO_NODES, (*TWO_NODES, f"data.path={missing}"))))
    assert re.fullmatch(
        rf"optimus-train: error: rank [02] \(host .+\): data\.path: {re.escape(str(missing))} .+",
        error,
    ), error
