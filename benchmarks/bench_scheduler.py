"""Paper-scale benchmark of the bubble scheduler, side by side with the Optimus paper's figures.

    python benchmarks/bench_scheduler.py [--calibration NAME] [--json OUT] [--profile PROFILE ...]
        [--only NAME ...]
    python benchmarks/bench_scheduler.py --scaling [GPUS ...] [--repeat N] [--json OUT]

For every setup in configs/paper/, under the cost model's calibration (``--calibration``: roofline,
the default; paper, fitted to Tables 5 and 7 by scripts/fit_calibration.py; or a calibration file),
it plans, schedules (Algorithm 1, on one core) and simulates the two Megatron-LM baselines at the
paper's settings (Tables 11, 12: Megatron-LM at V1, balanced at V12 or V6; every other V up to 16
as labelled extra rows), then prints, ours against the paper's with the error of each figure:
- Table 1: the LLM's bubbles under Megatron-LM's schedule;
- Table 7: Eff_coarse, Eff_fine and scheduler runtime at 1536/2048/3072 GPUs;
- Table 5: iteration time, MFU (with and without recomputed FLOPs) and aggregate PFLOP/s of
  Megatron-LM, Megatron-LM balanced and Optimus, and under it why the paper's Megatron-LM column
  cannot hold with the others;
- weak scaling (Models A-D), the dual-encoder models, and Appendix C's 8-GPU model.
Optimus runs as the paper's Algorithm 1 (every kernel whole: what Tables 5 and 7 measure) and as
this scheduler runs (kernels cut to fit, pieces priced by their shape: ``cut``). The strong-scaling
setups (Tables 1, 5, 7) run in two readings of the paper, which states no image size: its configs'
(2048-token ViT inputs merged 2x2 into 512 LLM tokens, written in the configs) and 256-token images
(224 px in 14 px patches, ViT-22B's own, no merge). ``--scaling`` instead times the scheduler itself
as the job grows: strong_3072's model on 1536, 6144 and 12288 GPUs (LLM TP8 PP8) with 32, 64 and
128 microbatches per pipeline, on 192 GiB GPUs so that memory prunes no encoder plan; with
``--repeat N`` each row is scheduled N times and the fastest run printed (the same schedule each
time), as timeit does on a machine whose speed drifts.

With ``--profile`` (kernel profiles written by ``optimus-profile`` on a GPU) every setup also runs
with the measured kernel times and a last table shows how its figures move against the roofline. A
profile is keyed by (module, kernel, phase, tp), which does not tell models apart, so a setup uses
only the entries whose recorded FLOPs and bytes equal its own kernels' (the table says how many of
its compute kernels were measured); the rest, and all communication, stay on the roofline. Measured
times are those of the GPU the profile ran on, whatever GPU a setup's ``cluster`` section describes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from optimus_mllm.config import OptimusConfig, load_config
from optimus_mllm.config.calibration import ROOFLINE
from optimus_mllm.config.files import atomic_write_text
from optimus_mllm.costing.cost_model import CostModel, LayerShape, MeasuredKernel, read_profile
from optimus_mllm.errors import OptimusError
from optimus_mllm.planner import ParallelPlan, PlannerResult, plan
from optimus_mllm.scheduler.baselines import megatron_lm_balanced_baseline, megatron_lm_baseline
from optimus_mllm.scheduler.bubble_scheduler import best_schedule
from optimus_mllm.scheduler.llm_costs import (
    activation_dtype_bytes,
    build_llm_timeline,
    tp_bandwidth,
)
from optimus_mllm.scheduler.metrics import (
    BUBBLE_KINDS,
    bubble_breakdown,
    mfu,
    scheduling_efficiency,
)

REPO = Path(__file__).resolve().parent.parent

# The paper's numbers (Tables 5, 7, 10; Figures 15, 16 give speedups only).
PAPER_TABLE7 = {
    "strong_1536": (32, 34.3, 57.5, 322.2),
    "strong_2048": (24, 45.8, 69.3, 89.6),
    "strong_3072": (16, 68.7, 85.0, 15.1),
}
# iteration time s, MFU %, aggregate PFLOP/s: each of Megatron-LM, balanced, Optimus
PAPER_TABLE5 = {
    "strong_1536": (10.65, 10.43, 9.80, 31.6, 32.3, 34.4, 480.7, 490.9, 522.4),
    "strong_2048": (8.26, 8.06, 7.29, 30.6, 31.3, 34.6, 619.8, 635.2, 702.3),
    "strong_3072": (5.91, 5.87, 4.87, 28.5, 28.7, 34.6, 866.3, 872.2, 1051.3),
}
# App. C: 3.42 s / 2.78 s
PAPER_SPEEDUP = {
    "model_a": "up to 1.22",
    "model_b": "up to 1.22",
    "model_c": "up to 1.22",
    "model_d": "up to 1.22",
    "dualenc_11b_5b": "1.25",
    "dualenc_22b_5b": "1.26",
    "dualenc_22b_11b": "1.27",
    "appc_vit3b_gpt11b_8gpu": "1.23",
}
# % of a 5.12 s step, >3000 GPUs, production
PAPER_TABLE1 = {
    "dp_all_gather": 3.3,
    "dp_reduce_scatter": 8.9,
    "pp_warmup": 5.0,
    "pp_cooldown": 9.2,
    "pp_other": 8.7,
    "tp": 11.2,
}
# the baselines are tried at every V up to this (the paper's balanced runs use 6 and 12)
MAX_BASELINE_V = 16
# The strong-scaling setups' second reading, and the suffix of its rows' names.
SHORT_READING = (
    "256-token images (224 px, ViT-22B's own), no merge",
    ["model.encoders.0.seq_length=256", "model.encoders.0.projector.spatial_merge=1"],
)
SHORT_SUFFIX = "_256tok"
SCALING = {1536: 32, 6144: 64, 12288: 128}  # GPUs: microbatches per LLM pipeline
# Tables 11, 12: Megatron-LM runs plain 1F1B (they give it no V); balanced runs at these V
PAPER_MEGATRON_V = 1
PAPER_BALANCED_V = {
    "strong_1536": 12,
    "strong_2048": 12,
    "strong_3072": 12,
    "model_a": 6,
    "model_b": 6,
    "model_c": 12,
    "model_d": 12,
}
# §2.3: a ViT-22B layer's forward and backward on the paper's GPUs, ms
PAPER_VIT22B_LAYER_MS = (1.4, 2.0)


def paper_figures(
    config: OptimusConfig, planned: PlannerResult | None = None, cost: CostModel | None = None
) -> dict[str, float]:
    """What Tables 5 and 7 report, at the paper's settings: Megatron-LM at V1 and balanced at the V
    of Tables 11 and 12 (else Optimus's), Optimus with every kernel whole (the paper's Algorithm 1),
    its Eff_coarse and Eff_fine, and the scheduler's runtime."""
    planned = planned or plan(config)
    llm_plan, cost = planned.llm_plan, cost or CostModel.from_config(config)
    started = time.perf_counter()
    fine = best_schedule(config, planned, cost, cut_kernels=False)
    runtime = time.perf_counter() - started
    coarse = best_schedule(config, planned, cost, fine=False)
    megatron = megatron_lm_baseline(config, replace(llm_plan, vp=PAPER_MEGATRON_V), cost)
    balanced = None
    if len(config.encoders) == 1:
        v = PAPER_BALANCED_V.get(config.name, llm_plan.vp)
        balanced = megatron_lm_balanced_baseline(config, llm_plan, cost, v).iteration_us / 1e6
    return {
        "gpus": config.cluster.num_gpus,
        "megatron_s": megatron.iteration_us / 1e6,
        "balanced_s": balanced,
        "optimus_s": fine.best.iteration_us / 1e6,
        "coarse_s": coarse.best.iteration_us / 1e6,
        "eff_coarse": scheduling_efficiency(coarse.best),
        "eff_fine": scheduling_efficiency(fine.best),
        "runtime_s": runtime,
        "llm_alone_s": fine.llm_alone_us / 1e6,
    }


@dataclass
class Row:
    name: str
    gpus: int
    microbatches: int
    llm_plan: str
    encoder_plan: str  # of Optimus's schedule cut to fit
    llm_alone_s: float
    megatron_s: float  # at the paper's V1
    balanced_s: float | None  # at the paper's V (Tables 11, 12), else Optimus's
    balanced_v: int | None
    megatron_by_v: dict[int, float]  # every V each baseline can run at
    balanced_by_v: dict[int, float]
    optimus_s: float  # every kernel whole: the paper's Algorithm 1
    optimus_cut_s: float  # ours: kernels cut to fit the bubbles, pieces priced by their shape
    coarse_s: float
    eff_coarse: float
    eff_fine: float  # Algorithm 1's
    eff_fine_cut: float  # ours
    runtime_s: float  # Algorithm 1's scheduler, one core
    # method -> MFU counting model FLOPs only / also the FLOPs recomputation runs again
    mfu: dict[str, float | None]
    mfu_recompute: dict[str, float | None]
    bubbles: dict[str, float]  # share of the LLM-alone iteration per bubble kind
    encoder_first_stage_s: float  # the encoder's compute of every microbatch, run on one stage

    @property
    def paper_baseline_s(self) -> float:
        """The faster baseline at the paper's settings."""
        return min(t for t in (self.megatron_s, self.balanced_s) if t is not None)

    @property
    def speedup(self) -> float:
        return self.paper_baseline_s / self.optimus_s

    @property
    def speedup_cut(self) -> float:
        return self.paper_baseline_s / self.optimus_cut_s

    @property
    def best_baseline(self) -> tuple[str, int, float]:
        """The fastest baseline at any V: (name, V, seconds)."""
        runs = [("Megatron-LM", v, t) for v, t in self.megatron_by_v.items()]
        runs += [("balanced", v, t) for v, t in self.balanced_by_v.items()]
        return min(runs, key=lambda run: run[2])

    @property
    def speedup_best(self) -> float:
        return self.best_baseline[2] / self.optimus_cut_s


def baseline_vs(config: OptimusConfig, llm_plan: ParallelPlan, balanced: bool) -> list[int]:
    """The virtual stage counts a baseline can run at under ``llm_plan``'s DP, PP and TP: chunks of
    whole layers (the LLM's for Megatron-LM, encoder plus LLM layers for balanced), and the
    interleaved schedule (V > 1) only with PP > 1 and the microbatches a multiple of PP."""
    layers = config.llm.num_layers + (sum(e.num_layers for e in config.encoders) if balanced else 0)
    microbatches = config.num_microbatches_total // llm_plan.dp
    vs = []
    for v in range(1, MAX_BASELINE_V + 1):
        if llm_plan.pp * v > layers or (v > 1 and (llm_plan.pp == 1 or microbatches % llm_plan.pp)):
            continue
        if not balanced and config.llm.num_layers % (llm_plan.pp * v):
            continue
        vs.append(v)
    return vs


def encoder_first_stage_s(config: OptimusConfig, planned: PlannerResult, cost: CostModel) -> float:
    """The encoders' layers, forward and backward, for every microbatch of a pipeline, at the LLM's
    TP: what Megatron-LM's first stage runs besides its LLM layers."""
    llm_plan, t = planned.llm_plan, config.training
    total_us = 0.0
    for enc in config.encoders:
        dtype = activation_dtype_bytes(config)
        shape = LayerShape(
            enc, llm_plan.tp, t.micro_batch_size, t.sequence_parallel, dtype, t.recompute
        )
        bw = tp_bandwidth(config, llm_plan.tp)
        phases = ("fwd", "bwd") if not enc.frozen else ("fwd",)
        layer_us = sum(k.duration_us for p in phases for k in cost.layer(shape, p, enc.name, bw))
        total_us += layer_us * enc.num_layers
    return total_us * planned.num_microbatches / 1e6


def run_setup(name: str, config: OptimusConfig, profile: dict[tuple, float] | None = None) -> Row:
    """Plan, schedule and simulate the baselines; on the config's calibration, or with the
    measured ``profile``."""
    planned = plan(config)
    llm_plan = planned.llm_plan
    cost = CostModel(config.cluster, config.cost_model, profile)
    paper = paper_figures(config, planned, cost)
    cut = best_schedule(config, planned, cost)
    at_v = {v: replace(llm_plan, vp=v) for v in range(1, MAX_BASELINE_V + 1)}
    megatron_by_v = {
        v: megatron_lm_baseline(config, at_v[v], cost).iteration_us / 1e6
        for v in baseline_vs(config, llm_plan, balanced=False)
    }
    balanced_by_v = {}
    if len(config.encoders) == 1:
        balanced_by_v = {
            v: megatron_lm_balanced_baseline(config, llm_plan, cost, v).iteration_us / 1e6
            for v in baseline_vs(config, llm_plan, balanced=True)
        }
    times = {
        "megatron": paper["megatron_s"],
        "balanced": paper["balanced_s"],
        "optimus": paper["optimus_s"],
        "optimus_cut": cut.best.iteration_us / 1e6,
    }
    # Table 1 profiled Megatron-LM: the LLM alone under its schedule
    breakdown = bubble_breakdown(build_llm_timeline(config, at_v[PAPER_MEGATRON_V], cost))
    return Row(
        name=name,
        gpus=config.cluster.num_gpus,
        microbatches=planned.num_microbatches,
        llm_plan=str(llm_plan),
        encoder_plan=str(cut.best.encoder_plan),
        llm_alone_s=cut.llm_alone_us / 1e6,
        megatron_s=paper["megatron_s"],
        balanced_s=paper["balanced_s"],
        balanced_v=PAPER_BALANCED_V.get(config.name, llm_plan.vp) if balanced_by_v else None,
        megatron_by_v=megatron_by_v,
        balanced_by_v=balanced_by_v,
        optimus_s=paper["optimus_s"],
        optimus_cut_s=times["optimus_cut"],
        coarse_s=paper["coarse_s"],
        eff_coarse=paper["eff_coarse"],
        eff_fine=paper["eff_fine"],
        eff_fine_cut=scheduling_efficiency(cut.best),
        runtime_s=paper["runtime_s"],
        mfu={k: None if s is None else mfu(config, s * 1e6) for k, s in times.items()},
        mfu_recompute={
            k: None if s is None else mfu(config, s * 1e6, recompute=True) for k, s in times.items()
        },
        bubbles={k: breakdown.share(k) for k in BUBBLE_KINDS},
        encoder_first_stage_s=encoder_first_stage_s(config, planned, cost),
    )


@dataclass
class ScalingRow:
    gpus: int
    microbatches: int
    llm_plan: str
    encoder_plan: str
    plans_scheduled: int
    plans_bounded: int
    partitions_searched: int
    scheduler_s: float  # the fastest of the runs
    scheduler_runs_s: list[float]
    optimus_s: float


def scaling_config(gpus: int, microbatches: int) -> OptimusConfig:
    """strong_3072's model on ``gpus`` GPUs (LLM DP*8*8) with ``microbatches`` per pipeline, 192 GiB
    each."""
    base = load_config(REPO / "configs" / "paper" / "strong_3072.yaml")
    dp = gpus // 64
    return load_config(
        REPO / "configs" / "paper" / "strong_3072.yaml",
        [
            f"cluster.num_gpus={gpus}",
            "cluster.gpu_memory_gib=192",
            f"parallel.llm={{dp: {dp}, pp: 8, tp: 8}}",
            f"training.global_batch_size={microbatches * dp * base.training.micro_batch_size}",
        ],
    )


def run_scaling(gpus: int, microbatches: int, repeat: int = 1) -> ScalingRow:
    config = scaling_config(gpus, microbatches)
    planned = plan(config)
    runs, iterations = [], set()
    for _ in range(repeat):
        started = time.perf_counter()
        result = best_schedule(config, planned, CostModel(config.cluster, config.cost_model))
        runs.append(time.perf_counter() - started)
        iterations.add(result.best.iteration_us)
    if len(iterations) > 1:
        raise RuntimeError(
            f"the scheduler gave different schedules on {gpus} GPUs: {sorted(iterations)}"
        )
    return ScalingRow(
        gpus,
        planned.num_microbatches,
        str(planned.llm_plan),
        str(result.best.encoder_plan),
        sum(o.status == "scheduled" for o in result.outcomes),
        sum(o.status == "bounded" for o in result.outcomes),
        sum(o.stats.partitions_searched for o in result.outcomes),
        min(runs),
        runs,
        result.best.iteration_us / 1e6,
    )


def print_scaling(rows: list[ScalingRow]) -> None:
    runs = len(rows[0].scheduler_runs_s) if rows else 1
    print(
        "Scheduler runtime as the job grows (strong_3072's model, 2048-token ViT inputs, 192 GiB "
        "GPUs, one core" + (f"; the fastest of {runs} runs" if runs > 1 else "") + ")"
    )
    print(
        f"{'GPUs':>6}{'#mb':>6}  {'LLM plan':<19}{'encoder plan':<16}{'plans sched/bounded':>20}"
        f"{'partitions':>12}{'scheduler s':>13}{'Optimus s':>11}"
    )
    for r in rows:
        print(
            f"{r.gpus:>6}{r.microbatches:>6}  {r.llm_plan:<19}{r.encoder_plan:<16}"
            f"{f'{r.plans_scheduled}/{r.plans_bounded}':>20}{r.partitions_searched:>12}"
            f"{r.scheduler_s:>13.1f}"
            f"{r.optimus_s:>11.3f}"
        )
    print(
        "  #mb: microbatches per LLM pipeline; partitions: microbatch partitions scheduled over "
        "all encoder plans"
    )
    print()


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def print_tables(
    rows: dict[str, Row], short: dict[str, Row], configs: dict[str, OptimusConfig]
) -> None:
    strong = [n for n in PAPER_TABLE7 if n in rows]
    if strong:
        print(
            f"== Strong scaling, the configs' reading: {_reading(configs[strong[0]])} "
            "(scripts/fit_calibration.py fits the paper calibration to this reading)"
        )
        print_strong_scaling({n: rows[n] for n in strong}, configs)
    if short:
        # a second set of Tables 1, 5 and 7 under the same headings: say they are not the fit's
        print(
            f"== Strong scaling, the other reading: {SHORT_READING[0]} (no calibration is "
            "fitted to it: the paper calibration's residuals are those of the reading above)"
        )
        print_strong_scaling({n.removesuffix(SHORT_SUFFIX): r for n, r in short.items()}, configs)
    others = [n for n in rows if n not in PAPER_TABLE7]
    if others:
        print(
            "Other setups: iteration time in s (speedup of Optimus over Megatron-LM: ours | paper)"
        )
        _print_rows({n: rows[n] for n in others})


def _reading(config: OptimusConfig) -> str:
    enc = config.encoders[0]
    merge = enc.projector.spatial_merge
    return (
        f"{enc.seq_length}-token ViT inputs, "
        + (f"merged {merge}x{merge} into " if merge > 1 else "")
        + f"{enc.image_tokens} LLM image tokens"
    )


def _err(ours: float | None, paper: float) -> str:
    """Ours against the paper's, in % of the paper's."""
    return "-" if ours is None else f"{100 * (ours / paper - 1):+.1f}%"


def _pts(ours: float | None, paper: float) -> str:
    """Ours (a fraction) less the paper's (in %), in points."""
    return "-" if ours is None else f"{100 * ours - paper:+.1f}"


def print_strong_scaling(rows: dict[str, Row], configs: dict[str, OptimusConfig]) -> None:
    """Tables 1, 7 and 5 for the strong-scaling setups (named as in PAPER_TABLE7), ours against
    the paper's, and under Table 5 what the paper's Megatron-LM column is inconsistent with."""
    strong = list(rows)
    print(
        "Table 1: LLM bubbles, % of the LLM-alone iteration under Megatron-LM's schedule (V1): "
        "ours "
        "(ours less the paper's, points); paper: production, >3000 GPUs"
    )
    print(f"{'bubble':<20}" + "".join(f"{rows[n].gpus:>12}-GPU" for n in strong) + f"{'paper':>9}")
    for kind in BUBBLE_KINDS:
        cells = [
            f"{_pct(rows[n].bubbles[kind])} ({_pts(rows[n].bubbles[kind], PAPER_TABLE1[kind])})"
            for n in strong
        ]
        print(f"{kind:<20}" + "".join(f"{c:>16}" for c in cells) + f"{PAPER_TABLE1[kind]:>8.1f}%")
    print()
    print(
        "Table 7: scheduling efficiency (ours | paper, ours less the paper's in points) and "
        "scheduler runtime; Optimus as the paper's Algorithm 1 (kernels whole), and ours cut to fit"
    )
    print(
        f"{'setting':<10}{'#mb':>8}  {'Eff_coarse':>22}  {'Eff_fine':>22}  {'Eff_fine cut':>12}"
        f"  {'runtime s':>17}"
    )
    for n in strong:
        r, (mb, pc, pf, pt) = rows[n], PAPER_TABLE7[n]
        print(
            f"{r.gpus:>5}-GPU {r.microbatches:>4} | {mb:<2}  "
            f"{_pct(r.eff_coarse):>6} | {pc:>4.1f}% {_pts(r.eff_coarse, pc):>7}  "
            f"{_pct(r.eff_fine):>6} | {pf:>4.1f}% {_pts(r.eff_fine, pf):>7}  "
            f"{_pct(r.eff_fine_cut):>12}  {r.runtime_s:>7.2f} | {pt:>7.1f}"
        )
    print()
    print(
        "Table 5: iteration time, MFU and aggregate PFLOP/s at batch 1536 (ours | paper, error); "
        "MFU and PFLOP/s count recomputed FLOPs as the paper's do (its PFLOP/s x time is 5.12e18 "
        "FLOPs a step), MFU without them in brackets"
    )
    print(f"{'GPUs':>5}  {'method':<27}{'time s':>24}  {'MFU':>31}  {'PFLOP/s':>25}")
    for n in strong:
        r, p, config = rows[n], PAPER_TABLE5[n], configs[n]
        peak_pflops = config.cluster.num_gpus * config.cluster.peak_tflops / 1e3
        methods = [
            ("megatron", f"Megatron-LM (V{PAPER_MEGATRON_V})", r.megatron_s, 0),
            ("balanced", f"Megatron-LM balanced (V{r.balanced_v})", r.balanced_s, 1),
            ("optimus", "Optimus (Algorithm 1)", r.optimus_s, 2),
        ]
        for key, label, seconds, i in methods:
            hfu, model = r.mfu_recompute[key], r.mfu[key]
            paper_pflops = p[6 + i]
            pflops = None if hfu is None else hfu * peak_pflops
            print(
                f"{r.gpus:>5}  {label:<27}{_s(seconds):>8} | {p[i]:>5.2f} "
                f"{_err(seconds, p[i]):>7}  "
                f"{_pct(hfu):>6} ({_pct(model):>5}) | {p[3 + i]:>4.1f}% {_pts(hfu, p[3 + i]):>6}  "
                f"{_f(pflops):>7} | {paper_pflops:>6.1f} {_err(pflops, paper_pflops):>7}"
            )
        print(
            f"{'':>5}  {'Optimus cut to fit (ours)':<27}{r.optimus_cut_s:>8.3f}{'':>16}  "
            f"{_pct(r.mfu_recompute['optimus_cut']):>6} ({_pct(r.mfu['optimus_cut']):>5})"
        )
        for label, by_v in (("Megatron-LM", r.megatron_by_v), ("balanced", r.balanced_by_v)):
            extra = [f"V{v} {t:.3f}" for v, t in sorted(by_v.items()) if v in (1, 2, 6, 12, 16)]
            if by_v:
                print(f"{'':>5}  {'  extra: ' + label + ' at':<27}{', '.join(extra)}")
        print(
            f"{'':>5}  speedup over the faster baseline at the paper's settings: Optimus "
            f"{r.speedup:.2f}x, cut to fit {r.speedup_cut:.2f}x | paper "
            f"{min(p[0], p[1]) / p[2]:.2f}x"
        )
    print()
    print_megatron_note(rows)


def print_megatron_note(rows: dict[str, Row]) -> None:
    """Why no calibration matches the paper's Megatron-LM column along with the others."""
    fwd_ms, bwd_ms = PAPER_VIT22B_LAYER_MS
    print(
        "The paper's Megatron-LM column is inconsistent with its balanced column and §2.3: both "
        "run "
        "the same work, balanced spread evenly over the PP stages, Megatron-LM with all 48 ViT "
        "layers on its first stage, which then paces the pipeline; so Megatron-LM should take "
        "about the ViT's time on that stage, less its even share, longer than balanced. At §2.3's "
        f"{fwd_ms} + {bwd_ms} ms a ViT-22B layer:"
    )
    for n, r in rows.items():
        p, pp = PAPER_TABLE5[n], _pp(r.llm_plan)
        vit = r.microbatches * 48 * (fwd_ms + bwd_ms) / 1e3
        ours_vit = r.encoder_first_stage_s
        print(
            f"  {r.gpus}-GPU: paper: Megatron-LM - balanced = {p[0] - p[1]:.2f} s, where "
            f"{r.microbatches} x 48 x {fwd_ms + bwd_ms:.1f} ms x (1 - 1/{pp}) = "
            f"{vit * (1 - 1 / pp):.2f} s; ours: {r.megatron_s - r.balanced_s:.2f} s, ViT "
            f"{ours_vit:.2f} s x (1 - 1/{pp}) = {ours_vit * (1 - 1 / pp):.2f} s; Megatron-LM "
            f"{r.megatron_s:.2f} s against the paper's {p[0]:.2f} s ({_err(r.megatron_s, p[0])})"
        )
    print()


def _pp(llm_plan: str) -> int:
    return int(llm_plan.split(" PP", 1)[1].split()[0])


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _print_rows(rows: dict[str, Row]) -> None:
    print(
        f"{'setup':<24}{'GPUs':>5}  "
        f"{'LLM plan':<18}{'encoder plan':<16}{'LLM alone':>10}{'Meg V1':>9}"
        f"{'Meg best':>14}{'bal':>13}{'bal best':>14}{'Optimus':>9}{'cut':>9}{'coarse':>9}"
        f"{'Eff_c':>8}{'Eff_f':>8}{'Eff_cut':>8}"
        f"{'speedup':>9}{'cut':>7}{'vs best':>9}    paper"
    )
    for n, r in rows.items():
        balanced = "-" if r.balanced_s is None else f"{r.balanced_s:.3f} (V{r.balanced_v})"
        line = (
            f"{n:<24}{r.gpus:>5}  "
            f"{r.llm_plan:<18}{r.encoder_plan:<16}{r.llm_alone_s:>10.3f}{r.megatron_s:>9.3f}"
            f"{_best(r.megatron_by_v):>14}{balanced:>13}{_best(r.balanced_by_v):>14}"
            f"{r.optimus_s:>9.3f}{r.optimus_cut_s:>9.3f}{r.coarse_s:>9.3f}"
            f"{_pct(r.eff_coarse):>8}{_pct(r.eff_fine):>8}{_pct(r.eff_fine_cut):>8}"
            f"{r.speedup:>8.2f}x{r.speedup_cut:>6.2f}x{r.speedup_best:>8.2f}x"
        )
        print(line + (f"    {PAPER_SPEEDUP[n]}x" if n in PAPER_SPEEDUP else "    -"))
    print(
        "  Meg V1: Megatron-LM at the paper's V1; bal: balanced at the paper's V (Table 11), else "
        "Optimus's; best: the fastest V (1-16) for that baseline; Optimus: the paper's Algorithm 1 "
        "(kernels whole), cut: ours, kernels cut to fit; speedup, cut: the faster baseline at the "
        "paper's settings over each; vs best: the fastest baseline at any V over cut"
    )
    print()


def _best(by_v: dict[int, float]) -> str:
    if not by_v:
        return "-"
    v = min(by_v, key=by_v.get)
    return f"{by_v[v]:.3f} (V{v})"


@dataclass
class Measured:
    """A setup run with measured kernel times, and how many of its compute kernels they cover."""

    row: Row
    kernels_measured: int
    kernels_needed: int


def run_measured(
    name: str, config: OptimusConfig, profiles: list[MeasuredKernel]
) -> Measured | None:
    """The setup with the profiles' entries that match its kernels, or None when none does."""
    from optimus_mllm.tools.profiler import matching_profile

    table, needed = matching_profile(config, profiles)
    return Measured(run_setup(name, config, table), len(table), needed) if table else None


def _change(before: float | None, after: float | None, fmt: str) -> str:
    if before is None or after is None:
        return "-"
    return f"{before:{fmt}} -> {after:{fmt}}"


def print_profile_changes(rows: dict[str, Row], measured: dict[str, Measured | None]) -> None:
    """Each setup's figures on the roofline against the measured profile."""
    print(
        "Measured profile vs roofline: iteration time in s, speedup of Optimus over the faster "
        "baseline, "
        "Eff_fine, "
        "MFU (roofline -> profile)"
    )
    print(
        f"{'setup':<24}{'measured':>10}  {'LLM alone s':>16}  {'Megatron s':>16}  "
        f"{'Optimus s':>16}  "
        f"{'change':>7}  {'speedup':>14}  {'Eff_fine':>15}  {'MFU Opt':>15}"
    )
    for n, r in rows.items():
        m = measured[n]
        if m is None:
            print(
                f"{n:<24}{'0':>10}  no profile entry matches this setup's kernel shapes; roofline "
                "only"
            )
            continue
        p, covered = m.row, f"{m.kernels_measured}/{m.kernels_needed}"
        print(
            f"{n:<24}{covered:>10}  {_change(r.llm_alone_s, p.llm_alone_s, '7.3f')}"
            f"  {_change(r.megatron_s, p.megatron_s, '7.3f')}  "
            f"{_change(r.optimus_s, p.optimus_s, '7.3f')}"
            f"  {p.optimus_s / r.optimus_s - 1:>+7.1%}  "
            f"{_change(r.speedup, p.speedup, '5.2f')}x  "
            f"{_change(100 * r.eff_fine, 100 * p.eff_fine, '5.1f')}%"
            f"  {_change(100 * r.mfu['optimus'], 100 * p.mfu['optimus'], '5.1f')}%"
        )
    print(
        "  measured: compute kernels of the setup timed in a profile whose shapes match / all it "
        "costs; "
        "communication is always the bandwidth model; change: of Optimus's iteration time"
    )
    print()


def _row_json(r: Row) -> dict:
    name, v, seconds = r.best_baseline
    return {
        **vars(r),
        "speedup": r.speedup,
        "speedup_cut": r.speedup_cut,
        "speedup_best": r.speedup_best,
        "best_baseline": {"name": name, "v": v, "seconds": seconds},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="OUT", help="write every figure as JSON")
    parser.add_argument(
        "--calibration",
        default=ROOFLINE,
        metavar="NAME",
        help=f"the cost model's calibration (default {ROOFLINE}; paper: fitted to Tables 5 and 7 "
        "by "
        "scripts/fit_calibration.py; or a calibration YAML file)",
    )
    parser.add_argument(
        "--profile",
        nargs="+",
        metavar="PROFILE",
        help="measured kernel profile(s) (optimus-profile): also run every setup with them and "
        "compare against the roofline",
    )
    parser.add_argument(
        "--only", nargs="*", metavar="NAME", help="setups to run, e.g. strong_3072 model_a"
    )
    parser.add_argument(
        "--scaling",
        nargs="*",
        type=int,
        metavar="GPUS",
        help=f"time the scheduler on {', '.join(map(str, SCALING))} GPUs (or those given) instead",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        metavar="N",
        help="--scaling: schedule each row N times and print the fastest run",
    )
    parser.add_argument(
        "--one-reading",
        action="store_true",
        help=f"strong scaling in the configs' reading only (skip the {SHORT_SUFFIX[1:]} rows)",
    )
    args = parser.parse_args(argv)
    try:
        return _run(args)
    except OptimusError as exc:  # a bad config or profile: one line, no traceback
        print(f"bench_scheduler: error: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    if args.scaling is not None:
        return _run_scaling(args)
    profiles: list[MeasuredKernel] = []
    if args.profile:  # read them first: a bad file fails before minutes of scheduling
        profiles = [m for path in args.profile for m in read_profile(path, "profile")]
    names = sorted(p.stem for p in (REPO / "configs" / "paper").glob("*.yaml"))
    names = [n for n in names if not args.only or n in args.only]
    ordered = [n for n in PAPER_TABLE7 if n in names] + [n for n in names if n not in PAPER_TABLE7]
    calibration = [f"cost_model.calibration={args.calibration}"]
    configs = {
        n: load_config(REPO / "configs" / "paper" / f"{n}.yaml", calibration) for n in ordered
    }
    short_configs = {}
    if not args.one_reading:
        for n in (n for n in PAPER_TABLE7 if n in names):
            short_configs[f"{n}{SHORT_SUFFIX}"] = load_config(
                REPO / "configs" / "paper" / f"{n}.yaml", [*SHORT_READING[1], *calibration]
            )
    print(f"Calibration: {args.calibration} ({_calibration_line(configs[ordered[0]])})")
    rows = {n: run_setup(n, c) for n, c in configs.items()}
    short = {n: run_setup(n, c) for n, c in short_configs.items()}
    print_tables(rows, short, configs)
    measured = {}
    if args.profile:
        measured = {
            n: run_measured(n, c, profiles) for n, c in {**configs, **short_configs}.items()
        }
        print_profile_changes({**rows, **short}, measured)
    if args.json:
        payload = {
            "calibration": args.calibration,
            "readings": {
                "configs": {n: _reading(c) for n, c in configs.items() if n in PAPER_TABLE7},
                SHORT_SUFFIX[1:]: SHORT_READING[0],
            },
            "rows": {n: _row_json(r) for n, r in {**rows, **short}.items()},
            "paper": {"table7": PAPER_TABLE7, "table5": PAPER_TABLE5, "speedup": PAPER_SPEEDUP},
        }
        if args.profile:
            payload["profile"] = {
                "paths": args.profile,
                "rows": {
                    n: None
                    if m is None
                    else {
                        **_row_json(m.row),
                        "kernels_measured": m.kernels_measured,
                        "kernels_needed": m.kernels_needed,
                    }
                    for n, m in measured.items()
                },
            }
        atomic_write_text(args.json, json.dumps(payload, indent=2) + "\n")
    return 0


def _calibration_line(config: OptimusConfig) -> str:
    cm = config.cost_model
    nvlink = cm.network_efficiency if cm.nvlink_efficiency is None else cm.nvlink_efficiency
    return (
        f"GEMM / attention / memory / NVLink / network efficiency {cm.gemm_efficiency:g} / "
        f"{cm.attention_efficiency:g} / {cm.memory_efficiency:g} / {nvlink:g} / "
        f"{cm.network_efficiency:g}, recompute {config.training.recompute}"
    )


def _run_scaling(args: argparse.Namespace) -> int:
    unknown = [g for g in args.scaling if g not in SCALING]
    if unknown:
        raise OptimusError(
            f"--scaling: no size for {unknown[0]} GPUs; use some of {', '.join(map(str, SCALING))}"
        )
    if args.repeat < 1:
        raise OptimusError(f"--repeat: must be at least 1, got {args.repeat}")
    rows = [run_scaling(g, SCALING[g], args.repeat) for g in (args.scaling or SCALING)]
    print_scaling(rows)
    if args.json:
        atomic_write_text(
            args.json, json.dumps({"scaling": [vars(r) for r in rows]}, indent=2) + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
