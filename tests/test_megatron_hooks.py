"""megatron_patches.hooks: the reduction hook and the warm-up override leave megatron-core as it was."""

from __future__ import annotations

import pytest

from megatron_patches.hooks import tp_collective_hook, warmup_override


def test_tp_collective_hook_wraps_and_restores():
    from megatron.core.tensor_parallel import layers

    names = ("reduce_from_tensor_model_parallel_region", "reduce_scatter_to_sequence_parallel_region")
    before = {n: getattr(layers, n) for n in names}
    calls = []
    with tp_collective_hook(calls.append):
        assert all(getattr(layers, n) is not before[n] for n in names)
    assert all(getattr(layers, n) is before[n] for n in names)
    with pytest.raises(RuntimeError), tp_collective_hook(calls.append):
        raise RuntimeError("restored even on error")
    assert all(getattr(layers, n) is before[n] for n in names)


def test_warmup_override_replaces_only_the_warmup_and_restores():
    from megatron.core.pipeline_parallel import schedules

    original = schedules.get_pp_rank_microbatches

    class Group:
        def size(self):
            return 4

        def rank(self):
            return 0

    class Communicator:
        pp_group = Group()
        virtual_pipeline_model_parallel_size = 2

    default = original(8, 2, 4, p2p_communicator=Communicator())
    with warmup_override(lambda stage: 7):
        total, all_warmup, warmup, remaining = schedules.get_pp_rank_microbatches(8, 2, 4, p2p_communicator=Communicator())
    assert (total, warmup, remaining, all_warmup) == (default[0], 7, default[0] - 7, False)
    assert default[2] == 10  # megatron-core's own: (4 - 0 - 1) * 2 + (2 - 1) * 4
    assert schedules.get_pp_rank_microbatches is original
