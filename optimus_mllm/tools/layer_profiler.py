"""Measure what a whole layer costs beyond its kernels: the runtime's host work around them.

The kernel profile times each kernel alone, in a tight loop. A training step also runs what lies
between the kernels -- residual adds, biases applied outside a GEMM, dropout, reshapes, autograd's
bookkeeping, the modules' Python -- which on CPU ranks adds a large share (``optimus-profile``
prints it as the profile's ``layer_scales``). So for each module (the LLM and every encoder) a
layer is built as the runtime builds it -- megatron-core's GPT decoder layer for the LLM
(``runtime/llm.py``), the encoder's ``VisionStage`` steps (``runtime/vit.py``) -- and timed
forward and backward, next to the sum of its kernels timed alone at the same shapes. Their ratio,
a layer scale per (module, phase), multiplies that module's measured kernels when the cost model
loads the profile (``costing.cost_model.read_machine_profile``).

Measured at TP 1 and one data-parallel rank (every rank its own TP and DP group), and applied at
every TP: a TP shard's kernels are smaller, so the scale of a TP > 1 layer is, if anything, larger
than this one. The LLM's layer runs under the runtime's megatron-core DDP, so its backward includes
the accumulation into the gradient buffer; the runtime's optimizer (``runtime/optimizer.py``) then
steps over it, timed per parameter: the host cost of the optimizer step the cost model adds after a
rank's gradients are reduced.
"""

from __future__ import annotations

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


def measure_layer_scales(
    config: OptimusConfig, warmup: int, repeats: int, dtype: torch.dtype, timer: Timer
) -> tuple[list[dict[str, Any]], float]:
    """One entry per (module, phase): the layer's time, its kernels' summed time, their ratio; and
    the optimizer step's time per parameter. Needs ``parallel_state`` with one data-parallel rank
    and TP 1 (``initialize_model_parallel(pipeline_model_parallel_size=world)``)."""
    from megatron.core import parallel_state

    from optimus_mllm.runtime.optimizer import build_optimizer

    mbs = config.training.micro_batch_size
    entries = []
    llm_layer, ddp = _llm_layer(config, dtype)
    entries += _scales("llm", config.llm, mbs, llm_layer, True, config, warmup, repeats, timer)
    # the runtime's optimizer over the layer's gradients: its step, as train_step runs it
    optimizer = build_optimizer(config, [ddp], None, None)

    def step() -> None:
        ddp.finish_grad_sync()
        optimizer.step()

    per_param = statistics.median(timings_us(step, warmup, repeats, timer)) / sum(
        p.numel() for p in ddp.parameters()
    )
    group = parallel_state.get_tensor_model_parallel_group()
    for enc in config.encoders:
        if enc.num_layers < 2:  # no middle layer: its kernels keep their own times (scale 1)
            continue
        layer = _encoder_layer(config, enc, group, dtype)
        entries += _scales(enc.name, enc, mbs, layer, False, config, warmup, repeats, timer)
    return entries, per_param


LayerRun = Callable[[], torch.Tensor]  # one forward of the layer, its graph kept for a backward


def _scales(
    module: str,
    spec: TransformerSpec,
    batch: int,
    layer: LayerRun,
    causal: bool,
    config: OptimusConfig,
    warmup: int,
    repeats: int,
    timer: Timer,
) -> list[dict[str, Any]]:
    fwd_times, bwd_times = [], []
    for i in range(warmup + repeats):
        fwd, bwd = _forward_backward_us(layer, timer)
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
        layer_us = statistics.median(times)
        found.append(
            {
                "module": module,
                "phase": phase,
                "layer_us": layer_us,
                "kernels_us": kernels_us,
                "scale": layer_us / kernels_us,
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


def _llm_layer(config: OptimusConfig, dtype: torch.dtype) -> tuple[LayerRun, Any]:
    """One megatron-core GPT decoder layer, as a middle pipeline chunk holds it, under the
    runtime's megatron-core DDP (its backward accumulates into the gradient buffer)."""
    from optimus_mllm.runtime.llm import causal_mask, gpt_chunk, transformer_config
    from optimus_mllm.runtime.optimizer import wrap_ddp

    plan = ParallelPlan(1, 1, 1)
    tconfig = transformer_config(config, plan)
    chunk = gpt_chunk(config, plan, tconfig, 1, False, False, 0)
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


def _encoder_layer(config: OptimusConfig, enc: Any, group: Any, dtype: torch.dtype) -> LayerRun:
    """One middle layer of the encoder's ``VisionStage``, run as its steps."""
    from optimus_mllm.runtime.vit import VisionStage

    stage = VisionStage(enc, config.llm.hidden_size, (1, 2), group, params_dtype=dtype)
    x = torch.randn(
        enc.layer_tokens, config.training.micro_batch_size, enc.hidden_size, dtype=dtype
    ).requires_grad_()
    return lambda: stage(x, seed=0)
