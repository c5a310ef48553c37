"""Model planner (paper §4.1)."""

from optimus_mllm.planner.partitions import PartitionSet, microbatch_partitions
from optimus_mllm.planner.planner import EncoderPlanCandidate, PlannerResult, PrunedPlan, plan
from optimus_mllm.planner.plans import ParallelPlan, encoder_stage_gpus, symmetry_groups

__all__ = [
    "EncoderPlanCandidate",
    "ParallelPlan",
    "PartitionSet",
    "PlannerResult",
    "PrunedPlan",
    "encoder_stage_gpus",
    "microbatch_partitions",
    "plan",
    "symmetry_groups",
]
