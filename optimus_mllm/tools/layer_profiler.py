"""Measure what a layer costs beyond its kernels: the runtime's host work around them.

The kernel profile times each kernel alone, in a tight loop. A training step also runs what lies
between the kernels -- residual adds, biases applied outside a GEMM, dropout, reshapes, autograd's
bookkeeping, the modules' Python -- which on CPU ranks adds a large share. So for each module (the
LLM and every encoder) a stage of layers is built as the runtime builds it -- megatron-core's GPT
decoder layers for the LLM (``runtime/llm.py``), an encoder's ``VisionStage`` (``runtime/vit.py``)
-- and timed forward and backward, next to the sum of one layer's kernels timed alone at the same
shapes. The difference per layer is the layer's host work (the profile's ``layer_host``), which the
cost model adds to that module's layers at every TP (``costing.cost_model.CostModel.layer``).

The host work is an addition, not a factor: it is Python and dispatch per op, the same for a TP
shard's smaller kernels (measured on 2 CPU ranks: a TP 2 LLM layer forward took as long as a TP 1
one, while its kernels alone took half). It is measured at TP 1 and one data-parallel rank (every
rank its own TP and DP group), on as many distinct layers as one pipeline chunk of the job holds
(the LLM) or the whole encoder holds, so that each layer reads its own weights as in training
rather than one layer's from cache. The LLM's layers run under the runtime's megatron-core DDP, so
their backward includes the accumulation into the gradient buffer; the runtime's optimizer
(``runtime/optimizer.py``) then steps over them, timed per parameter: the host cost of the
optimizer step the cost model adds after a rank's gradients are reduced.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from typing import Any

import torch

from optimus_mllm.config import OptimusConfig, TransformerSpec
from optimus_mllm.costing.cost_model import LayerShape, Phase, layer_kernels
from optimus_mllm.planner.plans import ParallelPlan
from optimus_mllm.runtime.dtypes import DTYPES
from optimus_mllm.scheduler.llm_costs import activation_dtype_bytes
from optimus_mllm.tools.profiler import (
    RECOMPUTE,
    Timer,
    kernel_callable,
    layer_op,
    timings_us,
)


def measure_layer_host(
    config: OptimusConfig,
    plan: ParallelPlan,
    warmup: int,
    repeats: int,
    dtype: torch.dtype,
    timer: Timer,
) -> tuple[list[dict[str, Any]], float]:
    """One entry per (module, phase): a layer's time in a stage of distinct layers, its kernels'
    summed time alone, and their difference, the layer's host work; and the optimizer step's time
    per parameter. ``plan``: the job's LLM plan (its chunk's layer count). Needs
    ``parallel_state`` with one data-parallel rank and TP 1
    (``initialize_model_parallel(pipeline_model_parallel_size=world)``)."""
    from megatron.core import parallel_state

    from optimus_mllm.runtime.optimizer import build_optimizer

    mbs = config.training.micro_batch_size
    # the layers of one pipeline chunk, as the runtime splits the LLM (runtime/llm.py)
    llm_layers = config.llm.num_layers // (plan.pp * plan.vp)
    entries = []
    llm_stage, ddp = _llm_stage(config, llm_layers, dtype)
    entries += _host(
        "llm", config.llm, mbs, llm_stage, llm_layers, True, config, warmup, repeats, timer
    )
    # the runtime's optimizer over the chunk's gradients: its step, as train_step runs it
    optimizer = build_optimizer(config, [ddp], None, None)

    def step() -> None:
        ddp.finish_grad_sync()
        optimizer.step()

    per_param = statistics.median(timings_us(step, warmup, repeats, timer)) / sum(
        p.numel() for p in ddp.parameters()
    )
    group = parallel_state.get_tensor_model_parallel_group()
    for enc in config.encoders:
        stage = _encoder_stage(config, enc, group, dtype)
        entries += _host(
            enc.name, enc, mbs, stage, enc.num_layers, False, config, warmup, repeats, timer
        )
    return entries, per_param


LayerRun = Callable[[], torch.Tensor]  # one forward of the layers, their graph kept for a backward


def _host(
    module: str,
    spec: TransformerSpec,
    batch: int,
    stage: LayerRun,
    layers: int,
    causal: bool,
    config: OptimusConfig,
    warmup: int,
    repeats: int,
    timer: Timer,
) -> list[dict[str, Any]]:
    fwd_times, bwd_times = [], []
    for i in range(warmup + repeats):
        fwd, bwd = _forward_backward_us(stage, timer)
        if i >= warmup:
            fwd_times.append(fwd)
            bwd_times.append(bwd)
    shape = LayerShape(
        spec,
        1,
        batch,
        False,
        activation_dtype_bytes(config),
        config.training.recompute,
    )
    dtype = DTYPES[config.training.precision]
    found = []
    for phase, times in (("fwd", fwd_times), ("bwd", bwd_times)):
        kernels_us = _kernels_us(shape, phase, causal, warmup, repeats, dtype, timer)
        layer_us = statistics.median(times) / layers
        found.append(
            {
                "module": module,
                "phase": phase,
                "layers": layers,
                "layer_us": layer_us,
                "kernels_us": kernels_us,
                # a layer faster than its kernels alone (a fused or cached run) adds nothing
                "host_us": max(0.0, layer_us - kernels_us),
            }
        )
    return found


def _forward_backward_us(layer: LayerRun, timer: Timer) -> tuple[float, float]:
    """One forward of the layer and the backward of its graph, timed apart."""
    out: list[torch.Tensor] = []
    fwd = timer(lambda: out.append(layer()))
    grad = torch.ones_like(out[0])
    return fwd, timer(lambda: out[0].backward(grad))


def _kernels_us(
    shape: LayerShape,
    phase: Phase,
    causal: bool,
    warmup: int,
    repeats: int,
    dtype: torch.dtype,
    timer: Timer,
) -> float:
    """The layer's compute kernels in ``phase`` timed one by one, summed."""
    total = 0.0
    for work in layer_kernels(shape, phase):
        if work.is_comm:
            continue
        op = layer_op(
            shape.spec, work.name.removeprefix(RECOMPUTE), 1, shape.micro_batch_size, False, causal
        )
        fn = kernel_callable(op, work.phase, work.name.startswith(RECOMPUTE), "cpu", dtype)
        total += statistics.median(timings_us(fn, warmup, repeats, timer))
    return total


def _llm_stage(config: OptimusConfig, layers: int, dtype: torch.dtype) -> tuple[LayerRun, Any]:
    """A middle pipeline chunk of ``layers`` megatron-core GPT decoder layers, under the runtime's
    megatron-core DDP (its backward accumulates into the gradient buffer)."""
    from optimus_mllm.runtime.llm import causal_mask, gpt_chunk, transformer_config
    from optimus_mllm.runtime.optimizer import wrap_ddp

    plan = ParallelPlan(1, 1, 1)
    tconfig = transformer_config(config, plan)
    chunk = gpt_chunk(config, plan, tconfig, layers, False, False, 0)
    ddp = wrap_ddp(config, tconfig, chunk)
    llm = config.llm
    x = torch.randn(
        llm.seq_length, config.training.micro_batch_size, llm.hidden_size, dtype=dtype
    ).requires_grad_()
    mask = causal_mask(llm.seq_length)

    def forward() -> torch.Tensor:
        chunk.set_input_tensor(x)
        return ddp(input_ids=None, position_ids=None, attention_mask=mask)

    return forward, ddp


def _encoder_stage(config: OptimusConfig, enc: Any, group: Any, dtype: torch.dtype) -> LayerRun:
    """The encoder's layers as a ``VisionStage`` runs them, without its patch embedding and
    projector: the middle layers [1, n + 1) of the same encoder made two layers longer."""
    from optimus_mllm.runtime.vit import VisionStage

    longer = dataclasses.replace(enc, num_layers=enc.num_layers + 2)
    stage = VisionStage(
        longer, config.llm.hidden_size, (1, enc.num_layers + 1), group, params_dtype=dtype
    )
    x = torch.randn(
        enc.layer_tokens, config.training.micro_batch_size, enc.hidden_size, dtype=dtype
    ).requires_grad_()
    return lambda: stage(x, seed=0)
