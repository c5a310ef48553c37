"""A schedule as a Chrome / Perfetto trace (``chrome://tracing``, https://ui.perfetto.dev).

One process per GPU of the LLM pipeline (``pid`` = ``llm_stage * TP_llm + tp_rank``), two threads
each: ``"compute"`` (the compute stream) and ``"comm"`` (TP collectives, P2P, DP collectives).
Every GPU carries the LLM kernels of its stage and the encoder kernels of the encoder stage it
holds. ``ts`` and ``dur`` are microseconds of iteration time (the LLM's timeline is shifted by the
LLM origin ``t0``).

Besides the kernels the trace shows, on ``"comm"``:
- one LLM P2P send (``timeline.p2p_us``) from the end of every op whose output another op on a
  different stage consumes: a forward feeding the next stage (or, from the last stage, chunk + 1
  on the first), a backward feeding the previous stage (or, from the first stage, chunk - 1 on the
  last). Encoder P2P and the encoder-to-LLM transfers are not drawn;
- the DP collectives: the LLM all-gather of each stage ending at its first computation, the
  encoder's all-gather over [0, its duration), and per GPU the LLM's and the encoder's gradient
  reduce-scatters, which share the GPU's link in order of readiness (as the scheduler's latency
  counts them). Zero-length P2P and DP events (PP = 1, DP = 1) are left out.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from optimus_mllm.config.files import atomic_write_text
from optimus_mllm.scheduler.bubble_scheduler import Schedule
from optimus_mllm.scheduler.llm_costs import LLM
from optimus_mllm.scheduler.llm_timeline import LLMTimeline, PipelineOp

COMPUTE = "compute"
COMM = "comm"
_SHORT_PHASE = {"fwd": "F", "bwd": "B"}


def schedule_trace(schedule: Schedule) -> dict[str, Any]:
    """The Chrome trace of ``schedule``: metadata events, then kernels in time order."""
    events = (
        _llm_events(schedule)
        + _p2p_events(schedule)
        + _encoder_events(schedule)
        + _dp_events(schedule)
    )
    events.sort(key=lambda ev: (ev["ts"], ev["pid"]))
    return {
        "traceEvents": _metadata_events(schedule) + events,
        "displayTimeUnit": "ms",
        "otherData": {
            "F": list(schedule.forward_dependency_us),
            "B": list(schedule.backward_dependency_us),
            "iteration_us": schedule.iteration_us,
            "llm_plan": schedule.llm_plan.as_dict(),
            "encoder_plan": schedule.encoder_plan.as_dict(),
            "partition": list(schedule.partition),
        },
    }


def write_trace(schedule: Schedule, path: str | Path) -> None:
    """Write ``schedule``'s trace as JSON, never leaving a half-written file."""
    atomic_write_text(path, json.dumps(schedule_trace(schedule), allow_nan=False))


def num_gpus(schedule: Schedule) -> int:
    """GPUs of one LLM pipeline."""
    return schedule.llm_plan.pp * schedule.llm_plan.tp


def encoder_names(schedule: Schedule) -> str:
    """The encoders' names joined by '+': the ``model`` of encoder events covering every encoder."""
    names = dict.fromkeys(k.encoder for chain in schedule.work.fwd for k in chain.kernels)
    return "+".join(names)


def _event(
    name: str,
    ts: float,
    dur: float,
    pid: int,
    is_comm: bool,
    model: str,
    phase: str,
    microbatch: int | None,
    stage: int,
    chunk: int | None,
    layer: int,
    kernel: str,
) -> dict[str, Any]:
    return {
        "name": name,
        "ph": "X",
        "ts": ts,
        "dur": dur,
        "pid": pid,
        "tid": COMM if is_comm else COMPUTE,
        "args": {
            "model": model,
            "phase": phase,
            "microbatch": microbatch,
            "stage": stage,
            "chunk": chunk,
            "layer": layer,
            "kernel": kernel,
            "is_comm": is_comm,
        },
    }


def _stage_gpus(schedule: Schedule, stage: int) -> range:
    tp = schedule.llm_plan.tp
    return range(stage * tp, (stage + 1) * tp)


def _metadata_events(schedule: Schedule) -> list[dict[str, Any]]:
    tp = schedule.llm_plan.tp
    events = []
    for g in range(num_gpus(schedule)):
        label = f"GPU {g} (LLM stage {g // tp}, TP rank {g % tp})"
        events.append({"name": "process_name", "ph": "M", "pid": g, "args": {"name": label}})
        events.append(
            {"name": "process_sort_index", "ph": "M", "pid": g, "args": {"sort_index": g}}
        )
    return events


def _llm_events(schedule: Schedule) -> list[dict[str, Any]]:
    timeline, t0 = schedule.timeline, schedule.llm_origin_us
    events = []
    for stage in timeline.stages:
        gpus = _stage_gpus(schedule, stage.stage)
        for op in stage.ops:
            label = f"{_SHORT_PHASE[op.phase]}{op.microbatch}.{op.chunk}"
            for k in timeline.work[(op.stage, op.chunk, op.phase)].kernels:
                ts = t0 + op.start_us + k.offset_us
                events += [
                    _event(
                        f"{label} {k.name}",
                        ts,
                        k.duration_us,
                        g,
                        k.is_comm,
                        LLM,
                        op.phase,
                        op.microbatch,
                        op.stage,
                        op.chunk,
                        k.layer,
                        k.name,
                    )
                    for g in gpus
                ]
    return events


def _feeds_other_stage(timeline: LLMTimeline, op: PipelineOp) -> bool:
    """Whether ``op``'s output goes to an op on another stage (see ``simulate``'s producers)."""
    if timeline.pp == 1:
        return False
    if op.phase == "fwd":
        return op.stage < timeline.pp - 1 or op.chunk < timeline.vp - 1
    return op.stage > 0 or op.chunk > 0


def _p2p_events(schedule: Schedule) -> list[dict[str, Any]]:
    timeline, t0 = schedule.timeline, schedule.llm_origin_us
    if timeline.p2p_us <= 0:
        return []
    events = []
    for stage in timeline.stages:
        for op in stage.ops:
            if not _feeds_other_stage(timeline, op):
                continue
            name = f"{_SHORT_PHASE[op.phase]}{op.microbatch}.{op.chunk} p2p send"
            events += [
                _event(
                    name,
                    t0 + op.end_us,
                    timeline.p2p_us,
                    g,
                    True,
                    LLM,
                    "p2p",
                    op.microbatch,
                    op.stage,
                    op.chunk,
                    -1,
                    "p2p_send",
                )
                for g in _stage_gpus(schedule, op.stage)
            ]
    return events


def _encoder_events(schedule: Schedule) -> list[dict[str, Any]]:
    llm_microbatch = {a: i for i, a in enumerate(schedule.assignment)}
    events = []
    for chain in schedule.chains:
        mb = llm_microbatch[(chain.pipeline, chain.local_microbatch)]
        gpus = schedule.work.stage_gpus[chain.pipeline][chain.stage]
        for run in schedule.runs(chain):
            k = run.kernel
            piece = "" if run.piece == (0.0, 1.0) else f" [{run.piece[0]:.3f}, {run.piece[1]:.3f})"
            name = f"{k.encoder} {_SHORT_PHASE[chain.phase]}{mb} {k.name}{piece}"
            events += [
                _event(
                    name,
                    run.start_us,
                    run.end_us - run.start_us,
                    g,
                    k.is_comm,
                    k.encoder,
                    chain.phase,
                    mb,
                    chain.stage,
                    None,
                    k.layer,
                    k.name,
                )
                for g in gpus
            ]
    return events


def _dp_events(schedule: Schedule) -> list[dict[str, Any]]:
    work, timeline, t0 = schedule.work, schedule.timeline, schedule.llm_origin_us
    encoder = encoder_names(schedule)
    encoder_bwd_end = _encoder_backward_end(schedule)
    events = []
    for j, stages in enumerate(work.stage_gpus):
        for e, gpus in enumerate(stages):
            s = work.llm_stage(j, e)
            llm = timeline.stages[s]
            gathers = [
                (
                    t0 + llm.first_compute_us - timeline.dp_all_gather_us[s],
                    timeline.dp_all_gather_us[s],
                    LLM,
                    s,
                ),
                (0.0, work.dp_all_gather_us, encoder, e),
            ]
            reduces = [(t0 + llm.last_compute_us, timeline.dp_reduce_scatter_us[s], LLM, s)]
            if (j, e) in encoder_bwd_end:
                reduces.append((encoder_bwd_end[(j, e)], work.dp_reduce_scatter_us, encoder, e))
            for kernel, items in (
                ("dp_all_gather", gathers),
                ("dp_reduce_scatter", _fifo(reduces)),
            ):
                for ts, dur, model, stage in items:
                    if dur > 0:
                        events += [
                            _event(
                                f"{model} {kernel}",
                                ts,
                                dur,
                                g,
                                True,
                                model,
                                "dp",
                                None,
                                stage,
                                None,
                                -1,
                                kernel,
                            )
                            for g in gpus
                        ]
    return events


def _encoder_backward_end(schedule: Schedule) -> dict[tuple[int, int], float]:
    """(pipeline, encoder stage) -> end of its last backward kernel, where it has any."""
    ends: dict[tuple[int, int], float] = {}
    for chain in schedule.chains:
        if chain.phase == "bwd" and chain.starts_us:
            end = schedule.runs(chain)[-1].end_us
            key = (chain.pipeline, chain.stage)
            ends[key] = max(ends.get(key, end), end)
    return ends


def _fifo(transfers: list[tuple[float, float, str, int]]) -> list[tuple[float, float, str, int]]:
    """(ready, duration, ...) transfers on one link, served in ready order: their actual starts."""
    served, t = [], 0.0
    for ready, duration, *rest in sorted(transfers, key=lambda item: item[0]):
        start = max(t, ready)
        served.append((start, duration, *rest))
        t = start + duration
    return served
