"""The LLM's layer kernels as megatron-core runs them: the column-parallel GEMMs' backward
collectives under their own GEMMs (``llm_costs.megatron_backward``)."""

from __future__ import annotations

import inspect

import pytest
from megatron.core.tensor_parallel.layers import LinearWithGradAccumulationAndAsyncCommunication

from optimus_mllm.config import load_config
from optimus_mllm.costing.cost_model import CostModel, Kernel
from optimus_mllm.planner import plan
from optimus_mllm.scheduler.llm_costs import (
    LLM,
    llm_layer_shape,
    llm_op_work,
    megatron_backward,
    tp_bandwidth,
)

from support.paths import CONFIGS


def _k(name: str, us: float, comm: bool = False) -> Kernel:
    return Kernel(name, "bwd", comm, us, 0.0)


def test_sequence_parallel_gathers_under_dgrad_and_reduce_scatters_under_wgrad():
    fwd = [
        Kernel("tp_ag_mlp", "fwd", True, 30.0, 0.0),
        Kernel("tp_ag_attn", "fwd", True, 70.0, 0.0),
    ]
    bwd = [
        _k("tp_ag_mlp", 30.0, comm=True),
        _k("fc2", 200.0),
        _k("fc1", 200.0),
        _k("tp_rs_mlp", 30.0, comm=True),
        _k("ln_mlp", 5.0),
        _k("qkv", 100.0),
        _k("tp_rs_attn", 80.0, comm=True),
        _k("ln_attn", 5.0),
    ]
    assert megatron_backward(bwd, fwd) == [
        ("tp_ag_mlp", True, 30.0, False),  # the row-parallel output gradient's gather blocks
        ("fc2", False, 200.0, False),
        ("tp_ag_mlp_input", True, 30.0, True),  # fc1's input, again, for wgrad: under dgrad
        ("fc1_dgrad", False, 100.0, False),
        ("tp_ag_mlp_input", True, 0.0, False),
        ("tp_rs_mlp", True, 30.0, True),
        ("fc1_wgrad", False, 100.0, False),
        ("tp_rs_mlp", True, 0.0, False),
        ("ln_mlp", False, 5.0, False),
        # collectives longer than their GEMM's 50 us: the rest is a TP bubble
        ("tp_ag_attn_input", True, 50.0, True),
        ("qkv_dgrad", False, 50.0, False),
        ("tp_ag_attn_input", True, 20.0, False),
        ("tp_rs_attn", True, 50.0, True),
        ("qkv_wgrad", False, 50.0, False),
        ("tp_rs_attn", True, 30.0, False),
        ("ln_attn", False, 5.0, False),
    ]


def test_without_sequence_parallelism_the_input_gradient_all_reduce_runs_under_wgrad():
    bwd = [_k("fc2", 40.0), _k("fc1", 40.0), _k("tp_ar_mlp", 30.0, comm=True), _k("ln_mlp", 1.0)]
    assert megatron_backward(bwd, []) == [
        ("fc2", False, 40.0, False),
        ("fc1_dgrad", False, 20.0, False),
        ("tp_ar_mlp", True, 20.0, True),
        ("fc1_wgrad", False, 20.0, False),
        ("tp_ar_mlp", True, 10.0, False),
        ("ln_mlp", False, 1.0, False),
    ]
    # one rank: no collective, nothing to split
    assert megatron_backward([_k("fc1", 40.0), _k("act", 2.0)], []) == [
        ("fc1", False, 40.0, False),
        ("act", False, 2.0, False),
    ]


def test_megatron_core_launches_those_collectives_asynchronously():
    """What the model above rests on, in megatron-core's column-parallel backward: the input's
    all-gather and the input gradient's reduce-scatter (or all-reduce) are launched with
    ``async_op=True`` and waited for after the next GEMM."""
    source = inspect.getsource(LinearWithGradAccumulationAndAsyncCommunication.backward)
    calls = {
        "dist_all_gather_func(": "all_gather_buffer, input, group=tp_group, async_op=True",
        "dist_reduce_scatter_func(": "sub_grad_input, grad_input, group=tp_group, async_op=True",
        "torch.distributed.all_reduce(": "grad_input, group=tp_group, async_op=True",
    }
    flat = " ".join(source.split())
    for call, args in calls.items():
        assert f"{call} {args}" in flat or f"{call}{args}" in flat, call
    assert flat.index("grad_input = grad_output.matmul(weight)") < flat.index("handle.wait()")


@pytest.mark.parametrize(
    ("name", "overrides"),
    [("strong_1536", ()), ("strong_1536", ("cost_model.calibration=paper",)), ("fig5_8gpu", ())],
)
def test_an_llm_backward_op_waits_only_for_what_its_gemms_do_not_hide(name, overrides):
    """Per layer, the backward op's compute-stream time is the priced backward less what runs under
    the GEMMs: with every GEMM longer than its collectives, the column-parallel reduce-scatters,
    and the input all-gathers are not charged at all."""
    config = load_config(CONFIGS / "paper" / f"{name}.yaml", overrides)
    llm_plan = plan(config).llm_plan
    cost = CostModel.from_config(config)
    shape = llm_layer_shape(config, llm_plan)
    bw = tp_bandwidth(config, llm_plan.tp)
    priced = {k.name: k for k in cost.layer(shape, "bwd", LLM, bw)}
    assert priced["fc1"].duration_us / 2 > priced["tp_rs_mlp"].duration_us  # the case tested
    assert priced["qkv"].duration_us / 2 > priced["tp_rs_attn"].duration_us
    sequential = sum(k.duration_us for k in cost.layer(shape, "bwd", LLM, bw))
    hidden = priced["tp_rs_mlp"].duration_us + priced["tp_rs_attn"].duration_us
    work = llm_op_work(config, llm_plan, cost)
    per_chunk = config.llm.num_layers // (llm_plan.pp * llm_plan.vp)
    middle = work[(1, 0, "bwd")]  # no embedding, no output layer
    assert middle.duration_us == pytest.approx(per_chunk * (sequential - hidden))
    exposed = [k for k in middle.kernels if k.is_comm and not k.hidden and k.duration_us > 0]
    # the output gradients' gathers, and under full recomputation the forward's collectives again
    recomputed = 4 if shape.recompute == "full" else 0
    assert len(exposed) == per_chunk * (2 + recomputed)
