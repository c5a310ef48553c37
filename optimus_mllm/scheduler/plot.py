"""A schedule drawn like the paper's Figures 9-11: encoder kernels filling the LLM pipeline's
bubbles.

One row per GPU of the LLM pipeline, not per LLM stage: the TP ranks of a stage share the LLM's
timeline, but when TP_enc < TP_llm they hold different encoder pipelines, whose kernels differ.
Each row has a compute lane (LLM forward / backward in two shades by chunk parity, encoder forward /
backward on top of the LLM's bubbles) and a thinner comm lane below it (LLM TP collectives and P2P
sends, encoder TP collectives, DP all-gathers and reduce-scatters). Dashed lines on the first
stage's rows mark F_i (the LLM needs encoder output i) and B_i (its gradient is ready).

The drawing is made from ``schedule_trace``'s events, so the picture and the trace always agree.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from optimus_mllm.scheduler.bubble_scheduler import Schedule
from optimus_mllm.scheduler.llm_costs import LLM
from optimus_mllm.scheduler.trace import num_gpus, schedule_trace

# category -> (lane, colour); the order is the legend's
_CATEGORIES: dict[str, tuple[str, str]] = {
    "LLM fwd (even chunk)": ("compute", "#9ecae1"),
    "LLM fwd (odd chunk)": ("compute", "#3182bd"),
    "LLM bwd (even chunk)": ("compute", "#a1d99b"),
    "LLM bwd (odd chunk)": ("compute", "#31a354"),
    "Encoder fwd": ("compute", "#fd8d3c"),
    "Encoder bwd": ("compute", "#d62728"),
    "LLM TP collective": ("comm", "#636363"),
    "LLM P2P send": ("comm", "#bdbdbd"),
    "Encoder TP collective": ("comm", "#fdd0a2"),
    "DP all-gather / reduce-scatter": ("comm", "#9467bd"),
}
# vertical extent of each lane inside a row of height 1 (y grows downwards)
_LANES = {"compute": (0.08, 0.55), "comm": (0.66, 0.26)}
_MERGE_GAP_US = 1e-6


def draw_schedule(schedule: Schedule, path: str) -> None:
    """Draw ``schedule`` as a PNG at ``path`` (x axis: iteration time in ms)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure  # no pyplot: nothing global to leak or close

    gpus = num_gpus(schedule)
    fig = Figure(figsize=(16, 1.6 + 0.55 * gpus))
    ax = fig.add_subplot()
    for (gpu, category), intervals in _intervals_by_row(schedule_trace(schedule)).items():
        lane, colour = _CATEGORIES[category]
        y, height = _LANES[lane]
        ax.broken_barh(_merged_ms(intervals), (gpu + y, height), facecolors=colour, linewidth=0)
    _mark_dependency_points(ax, schedule)
    _decorate(ax, schedule)
    fig.savefig(path, dpi=110, bbox_inches="tight")


def _category(event: dict[str, Any]) -> str:
    args = event["args"]
    if args["phase"] == "dp":
        return "DP all-gather / reduce-scatter"
    if args["phase"] == "p2p":
        return "LLM P2P send"
    if args["model"] == LLM:
        if args["is_comm"]:
            return "LLM TP collective"
        parity = "odd" if args["chunk"] % 2 else "even"
        return f"LLM {args['phase']} ({parity} chunk)"
    return "Encoder TP collective" if args["is_comm"] else f"Encoder {args['phase']}"


def _intervals_by_row(trace: dict[str, Any]) -> dict[tuple[int, str], list[tuple[float, float]]]:
    """(GPU, category) -> [(start, end)] in microseconds, so each row draws one call per
    category."""
    rows: dict[tuple[int, str], list[tuple[float, float]]] = defaultdict(list)
    for event in trace["traceEvents"]:
        if event["ph"] == "X" and event["dur"] > 0:
            rows[(event["pid"], _category(event))].append((event["ts"], event["ts"] + event["dur"]))
    return rows


def _merged_ms(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Back-to-back kernels as one bar, as (start, width) in ms: fewer, cleaner rectangles."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1] + _MERGE_GAP_US:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start / 1e3, (end - start) / 1e3) for start, end in merged]


def _mark_dependency_points(ax: Any, schedule: Schedule) -> None:
    """F_i and B_i across the first LLM stage's rows, where the encoder hands over to the LLM."""
    top, bottom = 0.0, float(schedule.llm_plan.tp)
    ax.vlines(
        [f / 1e3 for f in schedule.forward_dependency_us],
        top,
        bottom,
        colors="black",
        linestyles="dashed",
        linewidth=0.8,
        label="F_i: LLM needs encoder output i",
    )
    ax.vlines(
        [b / 1e3 for b in schedule.backward_dependency_us],
        top,
        bottom,
        colors="#7b3294",
        linestyles="dotted",
        linewidth=1.0,
        label="B_i: gradient of output i ready",
    )


def _decorate(ax: Any, schedule: Schedule) -> None:
    from matplotlib.patches import Patch

    tp, gpus = schedule.llm_plan.tp, num_gpus(schedule)
    ax.set_ylim(gpus, 0)  # GPU 0 on top
    ax.set_yticks([g + 0.5 for g in range(gpus)])
    ax.set_yticklabels([f"GPU {g} (stage {g // tp}, TP {g % tp})" for g in range(gpus)])
    ax.set_xlim(0, schedule.iteration_us / 1e3)
    ax.set_xlabel("iteration time (ms)")
    ax.set_title(
        f"LLM {schedule.llm_plan} | encoder {schedule.encoder_plan} | partition "
        f"{list(schedule.partition)} | iteration {schedule.iteration_us / 1e3:.3f} ms"
    )
    handles = [Patch(facecolor=colour, label=name) for name, (_, colour) in _CATEGORIES.items()]
    handles += ax.get_legend_handles_labels()[0]
    ax.legend(
        handles=handles,
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        fontsize="small",
        frameon=False,
    )
