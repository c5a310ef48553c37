"""Figures of a schedule: iteration time, scheduling efficiency (paper §5.3.2), bubble breakdown
(Table 1), MFU."""

from __future__ import annotations

from dataclasses import dataclass

from optimus_mllm.config import OptimusConfig
from optimus_mllm.costing.cost_model import LayerShape, layer_kernels
from optimus_mllm.scheduler.bubble_scheduler import Schedule
from optimus_mllm.scheduler.llm_timeline import LLMTimeline

BUBBLE_KINDS = ("dp_all_gather", "pp_warmup", "pp_other", "tp", "pp_cooldown", "dp_reduce_scatter")


def scheduling_efficiency(schedule: Schedule) -> float:
    """Share of the encoder's compute time placed inside the LLM's bubbles.

    The LLM's bubbles on a GPU are those of the LLM alone, carried into the schedule: the idle time
    before its first computation (as long as the LLM alone has it: DP all-gather plus PP warm-up),
    the gaps between its first and last computation (TP and PP bubbles), and the idle time after its
    last computation (as long as the LLM alone has it: PP cool-down plus DP reduce-scatter). Encoder
    compute outside them is what lengthens the iteration.
    """
    tl, t0, w = schedule.timeline, schedule.llm_origin_us, schedule.work
    alone_origin, alone_end = tl.origin_us, tl.iteration_us
    inside = total = 0.0
    for c in schedule.chains:
        stage = tl.stages[w.llm_stage(c.pipeline, c.stage)]
        first, last = t0 + stage.first_compute_us, t0 + stage.last_compute_us
        pre_bubble = (first - (alone_origin + stage.first_compute_us), first)
        post_bubble = (last, last + alone_end - (alone_origin + stage.last_compute_us))
        for run in schedule.runs(c):
            if run.kernel.is_comm:
                continue
            start, end = run.start_us, run.end_us
            total += end - start
            if c.window == "llm":
                inside += end - start  # placed into an idle gap of the LLM's compute stream
            else:
                lo, hi = pre_bubble if c.window == "pre" else post_bubble
                inside += max(0.0, min(end, hi) - max(start, lo))
    return inside / total if total else 1.0


@dataclass(frozen=True)
class BubbleBreakdown:
    """Average idle time per GPU of the LLM alone, by cause (paper Table 1), in microseconds."""

    iteration_us: float
    seconds_by_kind: dict[str, float]

    def share(self, kind: str) -> float:
        return self.seconds_by_kind[kind] / self.iteration_us


def bubble_breakdown(tl: LLMTimeline) -> BubbleBreakdown:
    """Classify the compute stream's idle time of each stage of the LLM-alone iteration, averaged
    over stages."""
    total = dict.fromkeys(BUBBLE_KINDS, 0.0)
    origin, end = tl.origin_us, tl.iteration_us
    for s, stage in enumerate(tl.stages):
        compute, comm, _ = tl.kernel_intervals(s)  # hidden collectives leave no bubble
        first, last = origin + stage.first_compute_us, origin + stage.last_compute_us
        ag, rs = tl.dp_all_gather_us[s], tl.dp_reduce_scatter_us[s]
        tp = sum(b - a for a, b in comm)
        busy = sum(b - a for a, b in compute)
        total["dp_all_gather"] += ag
        total["pp_warmup"] += first - ag
        total["tp"] += tp
        total["pp_other"] += (last - first) - busy - tp
        total["dp_reduce_scatter"] += rs
        total["pp_cooldown"] += end - last - rs
    return BubbleBreakdown(end, {k: v / tl.pp for k, v in total.items()})


def model_flops_per_iteration(config: OptimusConfig, recompute: bool = False) -> float:
    """Model FLOPs of one iteration (forward + backward = 3x forward), all GPUs; with
    ``recompute``, also the forward FLOPs that activation recomputation runs again (a trained
    transformer's layers once more under full recomputation, their attention core under selective),
    as hardware-FLOP MFU counts them."""
    t = config.training
    flops = 0.0
    for spec, extra in [(config.llm, _lm_head_flops(config))] + [(e, 0.0) for e in config.encoders]:
        shape = LayerShape(spec, 1, 1, False, 2)
        kernels = layer_kernels(shape, "fwd")
        per_layer = sum(k.flops for k in kernels if k.kind in ("gemm", "attention"))
        trainable = not getattr(spec, "frozen", False)
        flops += (3 if trainable else 1) * (per_layer * spec.num_layers + extra)
        if recompute and trainable:
            again = {
                "full": per_layer,
                "selective": sum(k.flops for k in kernels if k.kind == "attention"),
            }.get(t.recompute, 0.0)
            flops += again * spec.num_layers
    return flops * t.global_batch_size


def _lm_head_flops(config: OptimusConfig) -> float:
    llm = config.llm
    return 2.0 * llm.seq_length * llm.hidden_size * llm.vocab_size


def mfu(config: OptimusConfig, iteration_us: float, recompute: bool = False) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the cluster's peak; with ``recompute``,
    recomputed FLOPs count too (``model_flops_per_iteration``)."""
    peak = config.cluster.num_gpus * config.cluster.peak_tflops * 1e12
    return model_flops_per_iteration(config, recompute) / (iteration_us * 1e-6) / peak
