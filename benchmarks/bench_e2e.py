"""Each placement's step time, measured by training it, against the planner's prediction (issue 52
item 4).

    python benchmarks/bench_e2e.py --config configs/cpu/pp2_v1_heavy_vit.yaml [YAML ...] \\
        --nproc 2 --steps 5 [--profile P] [--json OUT]

Per config: it profiles the machine with ``optimus-profile`` under torchrun as a job of ``--nproc``
ranks, unless given ``--profile`` (where profiling fails, it says so in one line and predicts with
the cost model's constants); it predicts every placement's iteration time
(``scheduler/placements.py``, what ``optimus-plan`` prints last); then it trains each placement the
job can run with ``optimus-train`` under torchrun for ``--steps`` steps, one thread a rank
(``OMP_NUM_THREADS=1``), and takes the median step time of the steps after the first two (start-up
and warm-up). Megatron-LM's placement runs with ``--baseline megatron-lm``, the balanced one with
``--baseline balanced``, and Optimus with ``--schedule``, its fastest schedule written here, so that
the Optimus row is Optimus even where the planner would run a baseline. The last step's loss is
kept per placement: the placements train the same model, so their losses should agree.

It prints predicted against measured per placement, Optimus's speed-up over each baseline, measured
and predicted, and the placement the planner runs (``*``: what ``optimus-train`` runs with no
flag); ``--json OUT`` writes the rows. ``--nproc`` must be the configs' ``cluster.num_gpus`` (a
config is not rescaled) and at most this machine's cores.

A measurement, not a test: it needs an otherwise idle machine, as other work moves every number.
Not done yet: issue 52's rows of Megatron-LM's own ``pretrain_vlm.py`` (``MEGATRON_LM_DIR``,
modes ``megatron-lm-script`` and ``megatron-lm-script+optimus``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from optimus_mllm.cli.common import ArgumentParser
from optimus_mllm.config import load_config
from optimus_mllm.config.files import atomic_write_text
from optimus_mllm.costing.cost_model import CostModel
from optimus_mllm.errors import OptimusError
from optimus_mllm.planner import plan
from optimus_mllm.scheduler.artifact import write_artifact
from optimus_mllm.scheduler.bubble_scheduler import best_schedule
from optimus_mllm.scheduler.placements import (
    PlacementMode,
    PlacementPrediction,
    predicted_placements,
)

PROG = "bench_e2e"
NO_PROFILE = "the cost model's constants (no profile)"
WARMUP_STEPS = 2  # the steps left out of the median: start-up, then the first full step
# optimus-train's step line: "step 3/5 | loss 6.9783 | grad norm ... | 3271.8 ms | ..."
STEP_LINE = re.compile(r"^step (\d+)/\d+ \| loss (\S+) \| .* \| ([0-9.]+) ms \| ")
# the flags that make optimus-train run each placement (Optimus's adds its --schedule)
MODE_FLAGS: dict[PlacementMode, tuple[str, ...]] = {
    "megatron-lm": ("--baseline", "megatron-lm"),
    "balanced": ("--baseline", "balanced"),
    "optimus": (),
}


@dataclass(frozen=True)
class Measured:
    """One training run's median step after warm-up, its last step's loss and its step count."""

    step_s: float
    loss: float
    steps: int


@dataclass(frozen=True)
class Row:
    """One placement of one config: predicted and measured, or why there is no measurement."""

    config: str
    mode: PlacementMode
    predicted_s: float | None
    measured_s: float | None
    planned: bool
    predicted_from: str  # the profile's path, or NO_PROFILE
    loss: float | None = None
    steps: int | None = None
    problem: str | None = None  # why the placement was not measured


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog=PROG,
        description="Train every placement of each config for real and print its median step "
        "time against the planner's prediction. A measurement, not a test: run it on an "
        "otherwise idle machine.",
    )
    parser.add_argument("--config", nargs="+", required=True, metavar="YAML", help="job configs")
    parser.add_argument(
        "--nproc",
        type=int,
        required=True,
        metavar="N",
        help="ranks (torchrun --nproc-per-node), one core each: must be every config's "
        "cluster.num_gpus (configs are not rescaled) and at most this machine's cores",
    )
    parser.add_argument(
        "--steps",
        type=int,
        required=True,
        metavar="S",
        help=f"training steps per placement, at least {WARMUP_STEPS + 1}: the first "
        f"{WARMUP_STEPS} are warm-up, the median of the rest is measured",
    )
    parser.add_argument(
        "--profile",
        metavar="P",
        help="kernel profile to predict with (optimus-profile --out) instead of profiling here",
    )
    parser.add_argument("--json", metavar="OUT", help="also write the rows as JSON")
    return parser


def usage_problem(args: argparse.Namespace, cores: int) -> str | None:
    """What is wrong with the flags before any config is read, or None."""
    if args.steps < WARMUP_STEPS + 1:
        return (
            f"--steps {args.steps}: give at least {WARMUP_STEPS + 1}, the {WARMUP_STEPS} warm-up "
            "steps and one measured"
        )
    if args.nproc < 1:
        return f"--nproc {args.nproc}: give a positive number of ranks"
    if args.nproc > cores:
        return (
            f"--nproc {args.nproc}: more ranks than this machine's {cores} cores; one thread a "
            "rank needs a core each"
        )
    for path in [*args.config, *([args.profile] if args.profile else [])]:
        if not Path(path).is_file():
            flag = "--profile" if path == args.profile else "--config"
            return f"{flag} {path}: no such file"
    return None


def config_problem(path: str, nproc: int) -> str | None:
    """Why ``path`` cannot be benchmarked on ``nproc`` ranks, in one line, or None."""
    try:
        config = load_config(path)
    except OptimusError as exc:
        return f"--config {path}: {exc}"
    if config.cluster.num_gpus != nproc:
        return (
            f"--nproc {nproc}: {path} has cluster.num_gpus={config.cluster.num_gpus}; give "
            f"--nproc {config.cluster.num_gpus} or a config of {nproc} ranks"
        )
    return None


def available_cores() -> int:
    """The cores this process may run on (its affinity, where the platform has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def parse_steps(text: str, warmup: int = WARMUP_STEPS) -> Measured | None:
    """The median step time after ``warmup`` steps and the last step's loss from optimus-train's
    output; None without a step past warm-up."""
    steps = [m for line in text.splitlines() if (m := STEP_LINE.match(line))]
    times = [float(m.group(3)) / 1000 for m in steps[warmup:]]
    if not times:
        return None
    return Measured(statistics.median(times), float(steps[-1].group(2)), len(steps))


def error_line(prog: str, stderr: str) -> str:
    """A failed command's own one-line error (``prog: error: ...``), else its last line."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    own = [line for line in lines if line.startswith(f"{prog}: error:")]
    return (own or lines or [f"{prog} failed with no output"])[-1]


def torchrun(nproc: int, module: str, args: list[str]) -> subprocess.CompletedProcess[str]:
    """``python -m torch.distributed.run --standalone`` of ``module``, one thread a rank."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", str(nproc), "-m", module, *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, check=False)


def profile_job(path: str, nproc: int, out: Path) -> str | None:
    """Profile the machine for the config with optimus-profile; its one-line error, or None."""
    done = torchrun(nproc, "optimus_mllm.cli.profile", ["--config", path, "--out", str(out)])
    return None if done.returncode == 0 else error_line("optimus-profile", done.stderr)


def predict(
    path: str, profile: str | None, schedule_out: Path
) -> tuple[list[PlacementPrediction], bool]:
    """Every placement's prediction for the config priced with ``profile`` (None: the cost
    model's constants), and whether Optimus's fastest schedule was written to ``schedule_out``."""
    config = load_config(path, _profile_override(profile))
    planned = plan(config)
    cost = CostModel.from_config(config)
    scheduled = best_schedule(config, planned, cost)
    if scheduled.best is not None:
        write_artifact(scheduled.best, config, schedule_out)
    return predicted_placements(config, planned, scheduled, cost), scheduled.best is not None


def _profile_override(profile: str | None) -> list[str]:
    return [f"cost_model.profile={profile}"] if profile else []


def train(
    path: str,
    mode: PlacementMode,
    nproc: int,
    steps: int,
    profile: str | None,
    schedule: Path | None,
) -> Measured | str:
    """Train one placement for ``steps`` steps: its measurement, or why there is none (one line).

    Args:
        path: the config.
        mode: the placement.
        nproc: ranks.
        steps: training steps.
        profile: the profile it was predicted with, given to optimus-train too so that the job it
            plans is the one predicted.
        schedule: Optimus's schedule artifact (the ``optimus`` mode only).
    """
    overrides = [f"training.train_iters={steps}", *_profile_override(profile)]
    args = ["--config", path, "--override", *overrides, *MODE_FLAGS[mode]]
    if schedule is not None:
        args += ["--schedule", str(schedule)]
    done = torchrun(nproc, "optimus_mllm.train", args)
    if done.returncode != 0:
        return error_line("optimus-train", done.stderr)
    measured = parse_steps(done.stdout)
    return measured if measured is not None else "optimus-train printed no step past warm-up"


def build_rows(
    config: str,
    predictions: list[PlacementPrediction],
    measured: dict[str, Measured | str],
    predicted_from: str,
) -> list[Row]:
    """One row per placement: ``measured`` holds each trained mode's measurement or failure."""
    rows = []
    for p in predictions:
        row = Row(config, p.mode, p.iteration_s, None, p.planned, predicted_from)
        got = measured.get(p.mode, p.problem or "not trained")
        if isinstance(got, Measured):
            row = replace(row, measured_s=got.step_s, loss=got.loss, steps=got.steps)
        else:
            row = replace(row, problem=got)
        rows.append(row)
    return rows


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def format_table(rows: list[Row]) -> str:
    """Predicted against measured per placement; ``*`` marks the planned one."""
    header = (
        f"{'config':<20} {'mode':<12} {'predicted s':>12} {'measured s':>11} "
        f"{'meas/pred':>10} {'loss':>8}  planned"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        ratio = (
            f"{r.measured_s / r.predicted_s:.2f}"
            if r.measured_s is not None and r.predicted_s
            else "-"
        )
        loss = "-" if r.loss is None else f"{r.loss:.4f}"
        line = (
            f"{r.config:<20} {r.mode:<12} {_seconds(r.predicted_s):>12} "
            f"{_seconds(r.measured_s):>11} {ratio:>10} {loss:>8}  {'*' if r.planned else ''}"
        )
        lines.append(line.rstrip())
    lines += [f"  {r.config} {r.mode}: not measured: {r.problem}" for r in rows if r.problem]
    return "\n".join(lines) + "\n"


def _speedup(baseline_s: float | None, optimus_s: float | None) -> str:
    """How many times faster Optimus is than the baseline."""
    if baseline_s is None or optimus_s is None:
        return "-"
    return f"{baseline_s / optimus_s:.3f}x"


def format_speedups(rows: list[Row]) -> str:
    """Per config: Optimus against each baseline, measured and predicted, and the planned
    placement."""
    lines = []
    for config in dict.fromkeys(r.config for r in rows):
        own = {r.mode: r for r in rows if r.config == config}
        optimus = own["optimus"]
        against = [
            f"against {mode}: measured {_speedup(own[mode].measured_s, optimus.measured_s)}, "
            f"predicted {_speedup(own[mode].predicted_s, optimus.predicted_s)}"
            for mode in ("megatron-lm", "balanced")
        ]
        planned = next((r.mode for r in own.values() if r.planned), "none")
        lines.append(
            f"{config}: Optimus's speed-up (baseline step / Optimus step) "
            f"{'; '.join(against)}; the planner runs {planned}; predicted from "
            f"{optimus.predicted_from}"
        )
    return "\n".join(lines) + "\n"


def write_json(rows: list[Row], out: str) -> None:
    atomic_write_text(out, json.dumps([asdict(r) for r in rows], indent=2) + "\n")


def bench_config(path: str, args: argparse.Namespace, folder: Path) -> list[Row]:
    """Profile (unless given one), predict and train every placement of one config."""
    name = Path(path).stem
    profile = args.profile
    if profile is None:
        out = folder / f"{name}.profile.json"
        failed = profile_job(path, args.nproc, out)
        if failed is None:
            profile = str(out)
        else:
            print(f"{name}: profiling failed ({failed}); predicting without a profile")
    schedule = folder / f"{name}.schedule.json"
    predictions, scheduled = predict(path, profile, schedule)
    measured: dict[str, Measured | str] = {}
    for p in predictions:
        if p.iteration_s is not None:
            own = schedule if p.mode == "optimus" and scheduled else None
            measured[p.mode] = train(path, p.mode, args.nproc, args.steps, profile, own)
            print(f"{name} {p.mode}: {_measured_text(measured[p.mode])}", flush=True)
    return build_rows(name, predictions, measured, profile or NO_PROFILE)


def _measured_text(got: Measured | str) -> str:
    if isinstance(got, str):
        return f"failed: {got}"
    return f"median step {got.step_s:.3f} s of {got.steps} steps, last loss {got.loss:.4f}"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    problem = usage_problem(args, available_cores())
    if problem is None:
        problem = next(filter(None, (config_problem(c, args.nproc) for c in args.config)), None)
    if problem is not None:
        parser.error(problem)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        for path in args.config:
            try:
                rows += bench_config(path, args, Path(tmp))
            except OptimusError as exc:  # e.g. a profile the cost model refuses
                print(f"{PROG}: error: {path}: {exc}", file=sys.stderr)
                return 2
    print(
        f"\n{args.nproc} ranks, one thread each; median step of steps {WARMUP_STEPS + 1}-"
        f"{args.steps}"
    )
    sys.stdout.write(format_table(rows))
    sys.stdout.write(format_speedups(rows))
    if args.json:
        write_json(rows, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
