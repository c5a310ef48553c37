"""megatron_patches.hooks: the reduction hook and the warm-up override leave megatron-core as it
was."""

from __future__ import annotations

import pytest

from megatron_patches.hooks import tp_collective_hook, warmup_override


def test_tp_collective_hook_wraps_and_restores():
    from megatron.core.tensor_parallel import layers

    names = (
        "reduce_from_tensor_model_parallel_region",
        "reduce_scatter_to_sequence_parallel_region",
    )
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
        total, all_warmup, warmup, remaining = schedules.get_pp_rank_microbatches(
            8, 2, 4, p2p_communicator=Communicator()
        )
    assert (total, warmup, remaining, all_warmup) == (default[0], 7, default[0] - 7, False)
    assert default[2] == 10  # megatron-core's own: (4 - 0 - 1) * 2 + (2 - 1) * 4
    assert schedules.get_pp_rank_microbatches is original


def _hook_events(sequence_parallel: bool) -> dict[str, list]:
    """One rank of LLM TP2: a forward of its GPT chunk under the function hooks and under module
    hooks."""
    import torch
    from megatron.core import parallel_state, tensor_parallel

    import megatron_patches
    from optimus_mllm.config import load_config
    from optimus_mllm.planner import ParallelPlan
    from optimus_mllm.runtime.llm import build_llm_chunks, causal_mask, transformer_config

    from support.train_utils import TINY

    megatron_patches.apply()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    tensor_parallel.model_parallel_cuda_manual_seed(1)
    config = load_config(TINY, [f"training.sequence_parallel={str(sequence_parallel).lower()}"])
    plan = ParallelPlan(1, 1, 2, 1)
    chunks = build_llm_chunks(config, plan, transformer_config(config, plan))
    seq = config.llm.seq_length
    tokens = torch.randint(
        0, config.llm.vocab_size, (2, seq), generator=torch.Generator().manual_seed(0)
    )
    events = {}
    for mode in (False, True):
        calls: list = []
        positions = torch.arange(seq).expand(2, seq)
        with tp_collective_hook(
            lambda edge, collective, calls=calls: calls.append((edge, collective)),
            chunks,
            by_module=mode,
        ):
            # whole sequence, as the runtime
            embedded = chunks[0].embedding(input_ids=tokens, position_ids=positions)
            if sequence_parallel:
                embedded = tensor_parallel.scatter_to_sequence_parallel_region(embedded)
            chunks[0](None, positions, causal_mask(seq), decoder_input=embedded)
        events["module" if mode else "function"] = calls
    return events


@pytest.mark.distributed
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
def test_module_hooks_see_the_reductions_the_function_hooks_see(sequence_parallel):
    """What a transformer-engine layer, which reduces inside its own forward, would give: the same
    hook points, in the same order, as megatron-core's local layers give through the reduction
    functions."""
    from support.distributed_utils import run_distributed

    for events in run_distributed(_hook_events, 2, sequence_parallel, timeout=120):
        kind = "rs" if sequence_parallel else "ar"
        layers = 4  # configs/tiny.yaml's LLM, one chunk
        assert events["function"] == [("before", "tp_ar_embed"), ("after", "tp_ar_embed")] + [
            (edge, f"tp_{kind}_{role}")
            for _ in range(layers)
            for role in ("attn", "mlp")
            for edge in ("before", "after")
        ]
        assert events["module"] == events["function"]


def test_a_layer_that_reduces_inside_its_forward_is_hooked_by_module():
    import torch

    # a row-parallel layer that never calls megatron-core's reductions
    class TransformerEngineLike(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(2, 2))
            self.sequence_parallel = False

        def forward(self, x):
            return x @ self.weight

    mlp = torch.nn.Module()
    mlp.linear_fc2 = TransformerEngineLike()
    calls = []
    with tp_collective_hook(lambda edge, collective: calls.append((edge, collective)), [mlp]):
        mlp.linear_fc2(torch.ones(1, 2))
    mlp.linear_fc2(torch.ones(1, 2))  # hooks removed on exit
    assert calls == [("before", "tp_ar_mlp"), ("after", "tp_ar_mlp")]
