"""``megatron_patches.p2p.ChannelP2PCommunicator`` against megatron-core's handling of a sent
output: the send is still in flight when the schedule frees the output tensor
(``deallocate_pipeline_outputs``, Megatron-LM's default), and the receiver must still get the
values that were sent."""

from __future__ import annotations

import time

import pytest

from support.distributed_utils import run_distributed

pytestmark = pytest.mark.distributed


def _send_then_free(delay_s: float) -> list[float] | None:
    import torch
    import torch.distributed as dist
    from megatron.core.pipeline_parallel.schedules import deallocate_output_tensor
    from megatron.core.transformer import TransformerConfig

    from megatron_patches.p2p import ChannelP2PCommunicator, build_pipeline_channels

    rank = dist.get_rank()
    config = TransformerConfig(
        num_layers=1,
        hidden_size=8,
        num_attention_heads=1,
        pipeline_model_parallel_size=2,
        pipeline_dtype=torch.float32,
        deallocate_pipeline_outputs=True,
    )
    pp_group = dist.new_group([0, 1])
    communicator = ChannelP2PCommunicator(pp_group, config, build_pipeline_channels([[0, 1]], rank))
    if rank == 0:
        output = torch.arange(16, dtype=torch.float32).reshape(2, 8).clone().requires_grad_(True)
        communicator.send_forward(output, is_last_stage=False)
        # what megatron-core's schedule does right after sending: the send is not waited for here
        deallocate_output_tensor(output, deallocate_pipeline_outputs=True)
        dist.barrier()
        communicator.finish()
        return None
    dist.barrier()  # the sender has freed its output before this receive is even posted
    time.sleep(delay_s)
    communicator.recv_forward((2, 8), is_first_stage=False)
    received = communicator.wait_for_input("prev")
    communicator.finish()
    return received.detach().flatten().tolist()


def test_a_sent_output_freed_by_megatron_core_arrives_whole() -> None:
    received = run_distributed(_send_then_free, 2, 0.2)[1]
    assert received == [float(v) for v in range(16)]
