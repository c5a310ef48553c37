"""The Chrome trace and the PNG drawing of real schedules (tiny and the paper's Figure 5 setup)."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from functools import cache
from typing import Any

import pytest

from optimus_mllm.config import load_config
from optimus_mllm.costing.cost_model import CostModel
from optimus_mllm.planner import plan
from optimus_mllm.scheduler.bubble_scheduler import Schedule, best_schedule
from optimus_mllm.scheduler.plot import draw_schedule
from optimus_mllm.scheduler.trace import schedule_trace, write_trace

from support.paths import CONFIGS

TOL_US = 1e-6
ARG_TYPES = {
    "model": (str,),
    "phase": (str,),
    "microbatch": (int, type(None)),
    "stage": (int,),
    "chunk": (int, type(None)),
    "layer": (int,),
    "kernel": (str,),
    "is_comm": (bool,),
}
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@cache
def schedule_of(config_name: str) -> Schedule:
    config = load_config(CONFIGS / config_name)
    schedule = best_schedule(config, plan(config), CostModel.from_config(config)).best
    assert schedule is not None
    return schedule


@pytest.fixture(scope="module", params=["tiny.yaml", "paper/fig5_8gpu.yaml"])
def case(request: pytest.FixtureRequest) -> tuple[Schedule, dict[str, Any]]:
    schedule = schedule_of(request.param)
    return schedule, schedule_trace(schedule)


def kernel_events(trace: dict[str, Any]) -> list[dict[str, Any]]:
    return [ev for ev in trace["traceEvents"] if ev["ph"] == "X"]


def encoder_kernel_events(trace: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        ev
        for ev in kernel_events(trace)
        if ev["args"]["model"] != "llm" and ev["args"]["phase"] != "dp"
    ]


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def test_events_have_the_required_fields(case):
    schedule, trace = case
    assert set(trace) == {"traceEvents", "displayTimeUnit", "otherData"}
    assert trace["displayTimeUnit"] == "ms"
    assert {ev["ph"] for ev in trace["traceEvents"]} <= {"X", "M"}
    for ev in kernel_events(trace):
        assert is_number(ev["ts"]) and is_number(ev["dur"]) and ev["dur"] >= 0, ev
        assert isinstance(ev["pid"], int) and isinstance(ev["name"], str) and ev["name"], ev
        assert set(ev["args"]) == set(ARG_TYPES), ev
        for key, types in ARG_TYPES.items():
            assert isinstance(ev["args"][key], types), (key, ev)
        assert ev["tid"] == ("comm" if ev["args"]["is_comm"] else "compute"), ev
        assert ev["args"]["phase"] in {"fwd", "bwd", "dp", "p2p"}, ev
        assert (ev["args"]["chunk"] is None) == (
            ev["args"]["model"] != "llm" or ev["args"]["phase"] == "dp"
        ), ev
    json.dumps(trace, allow_nan=False)


def test_pids_cover_every_gpu_of_the_llm_pipeline(case):
    schedule, trace = case
    gpus = set(range(schedule.llm_plan.pp * schedule.llm_plan.tp))
    assert {ev["pid"] for ev in kernel_events(trace)} == gpus
    names = {
        ev["pid"]: ev["args"]["name"]
        for ev in trace["traceEvents"]
        if ev.get("name") == "process_name"
    }
    tp = schedule.llm_plan.tp
    assert names == {g: f"GPU {g} (LLM stage {g // tp}, TP rank {g % tp})" for g in gpus}


def test_no_two_compute_kernels_overlap_on_a_gpu(case):
    _, trace = case
    per_gpu: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for ev in kernel_events(trace):
        if ev["tid"] == "compute" and ev["dur"] > 0:
            per_gpu[ev["pid"]].append(ev)
    overlaps = []
    for pid, events in per_gpu.items():
        events.sort(key=lambda ev: ev["ts"])
        latest = events[0]  # the event reaching furthest so far
        for ev in events[1:]:
            if ev["ts"] < latest["ts"] + latest["dur"] - TOL_US:
                overlaps.append((pid, latest["name"], latest["ts"], ev["name"], ev["ts"]))
            if ev["ts"] + ev["dur"] > latest["ts"] + latest["dur"]:
                latest = ev
    assert not overlaps, overlaps[:10]


def test_every_llm_kernel_appears_on_every_gpu_of_its_stage(case):
    schedule, trace = case
    timeline, tp = schedule.timeline, schedule.llm_plan.tp
    counts = Counter(
        ev["pid"]
        for ev in kernel_events(trace)
        if ev["args"]["model"] == "llm" and ev["args"]["phase"] in ("fwd", "bwd")
    )
    for g in range(schedule.llm_plan.pp * tp):
        stage = timeline.stages[g // tp]
        assert counts[g] == sum(
            len(timeline.work[(op.stage, op.chunk, op.phase)].kernels) for op in stage.ops
        )


def test_every_encoder_kernel_appears_once_per_gpu_of_its_stage(case):
    schedule, trace = case
    llm_microbatch = {a: i for i, a in enumerate(schedule.assignment)}
    expected = Counter()
    for chain in schedule.chains:
        mb = llm_microbatch[(chain.pipeline, chain.local_microbatch)]
        for run in schedule.runs(chain):  # a kernel cut to fit bubbles: each of its pieces
            k, ts = run.kernel, run.start_us
            for g in schedule.work.stage_gpus[chain.pipeline][chain.stage]:
                expected[
                    (
                        g,
                        k.encoder,
                        chain.phase,
                        mb,
                        chain.stage,
                        k.layer,
                        k.name,
                        ts,
                        run.end_us - ts,
                    )
                ] += 1
    actual = Counter(
        (
            ev["pid"],
            ev["args"]["model"],
            ev["args"]["phase"],
            ev["args"]["microbatch"],
            ev["args"]["stage"],
            ev["args"]["layer"],
            ev["args"]["kernel"],
            ev["ts"],
            ev["dur"],
        )
        for ev in encoder_kernel_events(trace)
    )
    assert actual == expected
    assert max(expected.values()) == 1


def test_encoder_forwards_end_before_the_llm_needs_them(case):
    schedule, trace = case
    n = schedule.timeline.num_microbatches
    forward = trace["otherData"]["F"]
    last_stage = len(schedule.work.fwd) - 1
    late = []
    for ev in encoder_kernel_events(trace):
        mb = ev["args"]["microbatch"]
        assert 0 <= mb < n, ev
        if (
            ev["args"]["phase"] == "fwd"
            and ev["args"]["stage"] == last_stage
            and ev["ts"] + ev["dur"] > forward[mb] + TOL_US
        ):
            late.append((ev["name"], ev["ts"] + ev["dur"], forward[mb]))
    assert not late, late[:10]


def test_other_data(case):
    schedule, trace = case
    other = trace["otherData"]
    n = schedule.timeline.num_microbatches
    assert len(other["F"]) == len(other["B"]) == n
    assert sum(other["partition"]) == n
    assert other["llm_plan"] == schedule.llm_plan.as_dict()
    assert other["encoder_plan"] == schedule.encoder_plan.as_dict()
    # the last event (a reduce-scatter or the last computation) ends the iteration
    assert max(ev["ts"] + ev["dur"] for ev in kernel_events(trace)) == pytest.approx(
        other["iteration_us"], abs=1e-3
    )


def test_write_trace_round_trips(tmp_path):
    schedule = schedule_of("tiny.yaml")  # the format is the same for all; fig5's is 26 MB
    path = tmp_path / "trace.json"
    write_trace(schedule, path)
    assert json.loads(path.read_text()) == json.loads(json.dumps(schedule_trace(schedule)))


def test_draw_schedule_writes_a_png(case, tmp_path):
    schedule, _ = case
    path = tmp_path / "schedule.png"
    draw_schedule(schedule, str(path))
    data = path.read_bytes()
    assert len(data) > len(PNG_SIGNATURE) and data.startswith(PNG_SIGNATURE)
