"""The data-parallel collectives the runtime issues are the ones the timeline models.

The scheduler's model (``llm_costs.dp_comm_us``, ``encoder_costs``): with the distributed optimizer
a rank's parameters are all-gathered before its first computation and its fp32 gradients
reduce-scattered after its last, over the LLM's DP group for its LLM stage and over the encoder's DP
group for its encoder stage; without it the gradients are all-reduced and nothing is gathered. Each
rank here records every collective megatron-core's DDP buffers issue during two Optimus steps, and
the phase it ran in: inside the pipeline schedule, in the gradient sync after the step's last op, or
in the optimizer step (whose all-gather is the next step's "before the first computation"). The
element counts must be the model's parameters per rank, up to megatron-core's bucket padding.
"""

from __future__ import annotations

import sys

import pytest

from optimus_mllm.scheduler.artifact_format import ScheduleArtifact

from support.artifact_utils import artifact_for
from support.distributed_utils import run_distributed
from support.paths import CONFIGS

pytestmark = pytest.mark.distributed

TINY = str(CONFIGS / "tiny.yaml")
FIG5_SMALL = str(CONFIGS / "paper" / "small" / "fig5_8gpu.yaml")  # the paper's Figure 5 plan, small
STEPS = 2  # the second step's all-gather follows an update made from reduced gradients
EIGHT_RANKS = [
    "cluster.num_gpus=8",
    "cluster.gpus_per_node=8",
    "parallel.llm={dp: 2, pp: 2, tp: 2, vp: 2}",
]
LLM_DP2_ON_4 = ["parallel.llm={dp: 2, pp: 2, tp: 1, vp: 2}"]


def _recorded_steps(config_path: str, overrides: list[str], artifact: dict) -> dict:
    """One rank: STEPS Optimus steps with megatron-core's DP collectives recorded as (kind, group,
    elements,
    phase); the DP group ranks of this rank's LLM stage and encoder stage."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.distributed import param_and_grad_buffer as buffers

    from optimus_mllm.config import load_config
    from optimus_mllm.planner import plan
    from optimus_mllm.runtime.trainer import Trainer

    config = load_config(config_path, overrides)
    trainer = Trainer(config, plan(config).llm_plan, "optimus", artifact)
    phase = ["schedule"]
    records: list[tuple] = []

    def recording(kind, original):
        def call(first, *args, group=None, **kwargs):
            # the DDP buffers' own calls
            if sys._getframe(1).f_globals.get("__name__") == buffers.__name__:
                # elements of the whole buffer: a reduce-scatter's input, an all-gather's output
                whole = args[0] if kind == "reduce_scatter" else first
                records.append(
                    (
                        kind,
                        tuple(sorted(dist.get_process_group_ranks(group))),
                        whole.numel(),
                        phase[0],
                    )
                )
            return original(first, *args, group=group, **kwargs)

        return call

    def in_phase(name, method):
        def call(*args, **kwargs):
            phase[0] = name
            try:
                return method(*args, **kwargs)
            finally:
                phase[0] = "schedule"

        return call

    originals = {
        "dist_reduce_scatter_func": buffers.dist_reduce_scatter_func,
        "dist_all_gather_func": buffers.dist_all_gather_func,
        "all_reduce": dist.all_reduce,
    }
    buffers.dist_reduce_scatter_func = recording(
        "reduce_scatter", originals["dist_reduce_scatter_func"]
    )
    buffers.dist_all_gather_func = recording("all_gather", originals["dist_all_gather_func"])
    dist.all_reduce = recording("all_reduce", originals["all_reduce"])
    trainer._finalize_gradients = in_phase("grad sync", trainer._finalize_gradients)
    trainer.optimizer.step = in_phase("optimizer step", trainer.optimizer.step)
    try:
        for i in range(STEPS):
            trainer.train_step(i)
    finally:
        buffers.dist_reduce_scatter_func = originals["dist_reduce_scatter_func"]
        buffers.dist_all_gather_func = originals["dist_all_gather_func"]
        dist.all_reduce = originals["all_reduce"]
    result = {
        "records": records,
        "stage": parallel_state.get_pipeline_model_parallel_rank(),
        "llm_dp": tuple(
            sorted(dist.get_process_group_ranks(parallel_state.get_data_parallel_group()))
        ),
        "encoder_dp": tuple(sorted(trainer.groups.dp_ranks)),
        "encoder_stage": trainer.groups.coords.pp,
    }
    trainer.close()
    return result


def _modelled_elements(
    config_path: str, overrides: list[str], artifact: ScheduleArtifact
) -> tuple[list[float], list[float]]:
    """The timeline's parameters per rank: by LLM stage, and by encoder stage."""
    from optimus_mllm.config import load_config
    from optimus_mllm.costing.params import llm_params_per_stage
    from optimus_mllm.planner import plan
    from optimus_mllm.scheduler.encoder_costs import trainable_params_per_stage

    config = load_config(config_path, overrides)
    llm, enc = plan(config).llm_plan, artifact.encoder_plan
    return (
        [p / llm.tp for p in llm_params_per_stage(config.llm, llm.pp)],
        [p / enc.tp for p in trainable_params_per_stage(config, enc.pp)],
    )


# megatron-core pads every bucket to a multiple of the DP size times 128 elements, and replicates
# norms and row-parallel biases on every TP rank where the model divides all by TP
SLACK = 0.15


CASES = {
    "tiny-LLM-DP1-encoder-DP4": (TINY, [], True),
    "LLM-DP2-TP2": (TINY, EIGHT_RANKS, True),
    "LLM-DP2-no-distributed-optimizer": (TINY, LLM_DP2_ON_4, False),
    "fig5-small": (FIG5_SMALL, [], True),
}


def _rank_cases(cases: dict[str, tuple[str, list[str], dict]]) -> dict[str, dict]:
    """One rank of several cases in one launch (starting the ranks is most of a case's time)."""
    return {name: _recorded_steps(*case) for name, case in cases.items()}


@pytest.fixture(scope="module")
def launches() -> dict:
    """Every case's artifact, and its ranks' records, the cases of one world size run in one
    launch."""
    prepared, by_world = {}, {}
    for name, (config_path, overrides, distributed_optimizer) in CASES.items():
        overrides = [
            *overrides,
            f"training.distributed_optimizer={str(distributed_optimizer).lower()}",
        ]
        artifact = artifact_for(config_path, overrides)
        world = artifact.llm_plan.world_size
        prepared[name] = (config_path, overrides, artifact)
        by_world.setdefault(world, {})[name] = prepared[name]
    records = {}
    for world, cases in by_world.items():
        per_rank = run_distributed(_rank_cases, world, cases, timeout=600)
        records.update({name: [rank[name] for rank in per_rank] for name in cases})
    return {"prepared": prepared, "records": records}


@pytest.mark.parametrize("case", CASES)
def test_dp_collectives_are_the_timelines(launches, case):
    config_path, overrides, artifact = launches["prepared"][case]
    distributed_optimizer = CASES[case][2]
    llm_model, encoder_model = _modelled_elements(config_path, overrides, artifact)
    seen_groups = set()
    for rank, r in enumerate(launches["records"][case]):
        for group, modelled in (
            (r["llm_dp"], llm_model[r["stage"]]),
            (r["encoder_dp"], encoder_model[r["encoder_stage"]]),
        ):
            calls = [(kind, n, phase) for kind, ranks, n, phase in r["records"] if ranks == group]
            if len(group) == 1:
                # no replicas: the model has no DP time, and a 1-rank collective moves nothing
                continue
            seen_groups.add(group)
            assert all(phase != "schedule" for _, _, phase in calls), (
                f"rank {rank}: a DP collective inside the schedule"
            )
            sync = {kind for kind, _, phase in calls if phase == "grad sync"}
            gather = {kind for kind, _, phase in calls if phase == "optimizer step"}
            assert (sync, gather) == (
                ({"reduce_scatter"}, {"all_gather"})
                if distributed_optimizer
                else ({"all_reduce"}, set())
            ), f"rank {rank}: {calls}"
            for kind in sync | gather:
                per_step = sum(n for k, n, _ in calls if k == kind) / STEPS
                assert modelled <= per_step <= modelled * (1 + SLACK), (
                    f"rank {rank} {kind} over {group}: {per_step:.0f} elements a step, the model "
                    f"{modelled:.0f}"
                )
    assert seen_groups, "no data-parallel group with replicas: the test checked nothing"
