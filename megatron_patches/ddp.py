"""megatron-core ``DistributedDataParallel`` internals the runtime relies on: gradient averaging
over fewer replicas than the DP group (``average_over``), and whole reduced gradients for inspection
(``gather_main_grads``).

megatron-core scales every gradient by 1 / (its data-parallel group's size) before the reduction.
The Optimus encoder's data-parallel group holds DP_enc = m * DP_llm copies of a stage, but the m
encoder pipelines inside one LLM replica each see only their share of that replica's microbatches:
the replica's gradient is their sum, and the job's is the mean over the DP_llm replicas. There is no
constructor argument for that factor, so ``average_over`` sets it on the buffers and buckets that
apply it (``_ParamAndGradBuffer`` / ``_ParamAndGradBucket.gradient_scaling_factor``).
"""

from __future__ import annotations

from typing import Any

from megatron_patches.lookup import MegatronPatchError, megatron_version


def average_over(ddp: Any, replicas: int) -> None:
    """Scale ``ddp``'s gradients by 1 / ``replicas`` before they are reduced over its DP group."""
    if ddp.ddp_config.average_in_collective:
        raise MegatronPatchError(
            "average_over: average_in_collective divides by the group size itself"
        )
    factor = 1.0 / replicas
    for buffer in _attr(ddp, "buffers"):
        for owner in (buffer, *buffer.buckets):
            if not hasattr(owner, "gradient_scaling_factor"):
                raise MegatronPatchError(
                    f"average_over: {type(owner).__name__} has no gradient_scaling_factor "
                    f"(megatron-core {megatron_version()}); update megatron_patches/ddp.py"
                )
            owner.gradient_scaling_factor = factor


def gather_main_grads(ddp: Any) -> None:
    """Make every ``param.main_grad`` of ``ddp`` the whole reduced gradient, for inspection after a
    step.

    With the distributed optimizer, megatron-core reduce-scatters each bucket, so a rank's gradient
    buffer is reduced only in its own shard; this all-gathers the shards back into the buffer (which
    the next step zeroes). Without the distributed optimizer the buffer is all-reduced already.
    """
    if not ddp.ddp_config.use_distributed_optimizer:
        return
    import torch.distributed as dist

    for group in _attr(ddp, "bucket_groups"):
        comm = group.intra_distributed_optimizer_instance_group
        size, rank = comm.size(), comm.rank()
        for bucket in group.buckets:
            shard = bucket.grad_data.numel() // size
            local = bucket.grad_data[rank * shard : (rank + 1) * shard].clone()
            dist.all_gather_into_tensor(bucket.grad_data, local, group=comm)


def _attr(ddp: Any, name: str) -> Any:
    if not hasattr(ddp, name):
        raise MegatronPatchError(
            f"DistributedDataParallel has no {name!r} (megatron-core {megatron_version()}); "
            "update megatron_patches/ddp.py"
        )
    return getattr(ddp, name)
