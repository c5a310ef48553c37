"""Fit the ``paper`` calibration to the Optimus paper's Tables 5 and 7, print the fit and its
residuals, and write ``optimus_mllm/config/calibrations/paper.yaml``.

    python scripts/fit_calibration.py [--out PATH] [--workers N]
    python scripts/fit_calibration.py --evaluate KEY=VALUE ... [--profile FILE [--profile-scale X]]

What is fitted: the GEMM and attention efficiencies of the cost model and those of its collectives
inside a node (NVLink: TP) and across nodes (DP, PP), with full recomputation, which the paper's
own FLOP accounting implies (its aggregate PFLOP/s times its iteration time is 5.12e18 FLOPs in
every Table 5 row: the configs' workload with recomputation as a fourth pass, 3.82e18 without).
What they are fitted to, on the three strong-scaling setups
(configs/paper/strong_*.yaml): Megatron-LM balanced at V12 (Table 12) and Optimus (Table 5),
within 5 %, and Eff_coarse and Eff_fine (Table 7), within 5 points, Optimus running every kernel
whole as the paper's Algorithm 1 does. Megatron-LM's own column is left out: no calibration fits
it together with the rest (``benchmarks/bench_scheduler.py`` states why under its table).

The search is a coordinate descent from START on grids of 0.04, 0.02, then 0.01: each step tries
one grid step up and down of every constant and keeps the best, until none improves, then the grid
is refined. The score counts the figures outside their bounds, then compares the residuals in units
of their bounds, largest first (``score``); so the fit is deterministic and a rerun writes the same
file. The trials are read as calibration files, the way ``bench_scheduler.py --calibration`` reads
the shipped one, so the residuals are those the benchmark prints. ``--evaluate`` prints the
residuals of the shipped constants with some replaced; with ``--profile`` the kernels a measured
profile times take its times (multiplied by ``--profile-scale``, e.g. for a slower GPU than the one
it was measured on) instead.

Why the fit stops short of the bounds: with every kernel whole, Eff_fine is a step function of the
constants. The LLM's TP collectives all carry one activation tensor, so they all last the same, and
so do the ViT's longest forward kernels, fc1 and fc2 (360.3 us against the collectives' 328.2 us at
the shipped constants, kernels priced by the waves their tiles fill). There those kernels fit no TP
bubble and Eff_fine is under the paper's 57.5 / 69.3 / 85.0 % for every NVLink efficiency from 0.55
to 0.62; at 0.54 the collectives outlast them and Eff_fine is far over it; no constant lands in
between. Measured kernel times (``--profile``) do give values in between, but no setting tried
brings every figure within its bound (README, the bubble scheduler's benchmark). Eff_coarse times
the microbatches is 1098-1099 in all three of the paper's rows (its coarse bubbles hold a fixed
amount of one microbatch's encoder work) and 1217-1235 in ours; the network efficiency that would
shrink those bubbles lowers Eff_fine with them.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import tempfile
from multiprocessing import Pool
from pathlib import Path
from types import ModuleType

from optimus_mllm.config import load_config
from optimus_mllm.config.calibration import CALIBRATIONS, load_calibration
from optimus_mllm.config.files import atomic_write_text, read_versioned_json
from optimus_mllm.costing.cost_model import PROFILE_FORMAT, PROFILE_VERSION, read_profile
from optimus_mllm.errors import OptimusError

REPO = Path(__file__).resolve().parent.parent


def _bench_scheduler() -> ModuleType:
    """benchmarks/bench_scheduler.py, loaded from its file beside this one (scripts are programs,
    not a package): the paper's tables and how the benchmark reads a setup."""
    spec = importlib.util.spec_from_file_location(
        "bench_scheduler", REPO / "benchmarks" / "bench_scheduler.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it runs
    spec.loader.exec_module(module)
    return module


_bench = _bench_scheduler()
PAPER_TABLE5, PAPER_TABLE7, paper_figures = (
    _bench.PAPER_TABLE5,
    _bench.PAPER_TABLE7,
    _bench.paper_figures,
)

START = {
    "gemm_efficiency": 0.45,
    "attention_efficiency": 0.32,
    "nvlink_efficiency": 0.60,
    "network_efficiency": 0.70,
}
STEPS = (0.04, 0.02, 0.01)
RECOMPUTE = "full"
BOUNDS = {"balanced_s": 5.0, "optimus_s": 5.0, "eff_coarse": 5.0, "eff_fine": 5.0}
Constants = tuple[tuple[str, float], ...]


def _setup_residuals(args: tuple[str, Constants, str | None]) -> dict[str, float]:
    name, constants, profile = args
    # the trial as a calibration file, read the way `bench_scheduler.py --calibration` reads the
    # shipped one: what is fitted is what the benchmark prints
    with tempfile.TemporaryDirectory() as folder:
        trial = Path(folder) / "trial.yaml"
        trial.write_text(_entries(dict(constants)))
        overrides = [f"cost_model.calibration={trial}"]
        if profile is not None:
            overrides.append(f"cost_model.profile={profile}")
        config = load_config(REPO / "configs" / "paper" / f"{name}.yaml", overrides)
    ours = paper_figures(config)
    _, paper_bal, paper_opt, *_ = PAPER_TABLE5[name]
    _, paper_coarse, paper_fine, _ = PAPER_TABLE7[name]
    return {
        "balanced_s": 100 * (ours["balanced_s"] / paper_bal - 1),
        "optimus_s": 100 * (ours["optimus_s"] / paper_opt - 1),
        "eff_coarse": 100 * ours["eff_coarse"] - paper_coarse,
        "eff_fine": 100 * ours["eff_fine"] - paper_fine,
    }


# per (constants, profile) run: per setup, per figure
_RESIDUALS: dict[tuple[Constants, str | None], dict[str, dict[str, float]]] = {}


def residuals_of(
    trials: list[dict[str, float]], workers: int = 1, profile: str | None = None
) -> list[dict[str, dict[str, float]]]:
    """Per trial, per setup, per figure: ours less the paper's (times in %, efficiencies in
    points); (constants, setup) pairs run on ``workers`` processes, and a trial run before is not
    run again. ``profile``: a kernel profile whose times replace the constants' for the kernels it
    times (the fit itself runs without one)."""
    keys = [(tuple(sorted(t.items())), profile) for t in trials]
    todo = [(name, k) for k in dict.fromkeys(keys) if k not in _RESIDUALS for name in PAPER_TABLE7]
    if todo:
        jobs = [(name, constants, profile) for name, (constants, profile) in todo]
        if workers == 1:
            rows = [_setup_residuals(job) for job in jobs]
        else:
            with Pool(min(workers, len(jobs))) as pool:
                rows = pool.map(_setup_residuals, jobs)
        for (name, k), row in zip(todo, rows):
            _RESIDUALS.setdefault(k, {})[name] = row
    return [{name: _RESIDUALS[k][name] for name in PAPER_TABLE7} for k in keys]


def score(res: dict[str, dict[str, float]]) -> tuple[float, ...]:
    """How many figures miss their bounds, then the residuals in units of their bounds, largest
    first, compared in that order: as many figures within their bounds as the constants allow, then
    the worst as small as it gets, then the next worst, and so on. (A figure the constants cannot
    bring within its bound, Eff_fine below, then does not hold the others outside theirs.)"""
    scaled = sorted(
        (abs(v) / BOUNDS[k] for row in res.values() for k, v in row.items()), reverse=True
    )
    return (sum(x > 1 for x in scaled), *scaled)


def fit(workers: int = 1) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    best = dict(START)
    [best_res] = residuals_of([best], workers)
    print(f"start {_fmt(best)}: {_outcome(best_res)}", flush=True)
    for step in STEPS:
        while True:
            trials = []
            for key in best:
                for delta in (-step, step):
                    trial = dict(best, **{key: round(best[key] + delta, 2)})
                    if 0 < trial[key] <= 1:
                        trials.append(trial)
            res, trial = min(zip(residuals_of(trials, workers), trials), key=lambda x: score(x[0]))
            if score(res) >= score(best_res):
                break
            best, best_res = trial, res
            print(f"step {step:.2f} {_fmt(best)}: {_outcome(res)}", flush=True)
    return best, best_res


def _outcome(res: dict[str, dict[str, float]]) -> str:
    outside, worst, *_ = score(res)
    return f"{outside} of {len(BOUNDS) * len(res)} figures outside their bounds, worst {worst:.2f}"


def _fmt(constants: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.2f}" for k, v in constants.items())


def report(constants: dict[str, float], res: dict[str, dict[str, float]]) -> list[str]:
    lines = [f"recompute: {RECOMPUTE}; " + _fmt(constants)]
    lines.append(
        f"{'setup':<13}{'balanced %':>12}{'Optimus %':>11}{'Eff_c pts':>11}{'Eff_f pts':>11}"
    )
    for name, row in res.items():
        lines.append(
            f"{name:<13}{row['balanced_s']:>+12.1f}{row['optimus_s']:>+11.1f}"
            f"{row['eff_coarse']:>+11.1f}{row['eff_fine']:>+11.1f}"
        )
    outside, worst, *_ = score(res)
    lines.append(
        f"worst residual: {worst:.2f} of its bound (5 % or 5 points), {outside} of "
        f"{len(BOUNDS) * len(res)} figures outside: "
        + ("within" if worst <= 1 else "NOT within")
        + " the bounds"
    )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(CALIBRATIONS / "paper.yaml"), help="file to write")
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="processes scheduling (constants, setup) pairs at once (default 1; the result is the "
        "same with any number)",
    )
    parser.add_argument(
        "--evaluate",
        nargs="+",
        metavar="KEY=VALUE",
        help="no search, nothing written: the residuals of the shipped constants with these "
        "replaced, e.g. nvlink_efficiency=0.56",
    )
    parser.add_argument(
        "--profile",
        metavar="FILE",
        help="with --evaluate: a kernel profile (optimus-profile; e.g. profiles/h100_strong.json) "
        "whose times replace the constants' for the kernels it times",
    )
    parser.add_argument(
        "--profile-scale",
        type=float,
        default=1.0,
        metavar="X",
        help="with --profile: multiply its times by X (default 1)",
    )
    args = parser.parse_args(argv)
    try:
        if args.workers < 1:
            raise OptimusError(f"--workers: must be at least 1, got {args.workers}")
        if not 0 < args.profile_scale < math.inf:
            raise OptimusError(f"--profile-scale: must be positive, got {args.profile_scale}")
        if args.profile_scale != 1.0 and not args.profile:
            raise OptimusError("--profile-scale: scales a --profile's times; give --profile FILE")
        if args.profile and not args.evaluate:
            raise OptimusError("--profile: only with --evaluate (the fit itself uses none)")
        if args.evaluate:
            constants = _evaluated(args.evaluate)
            with tempfile.TemporaryDirectory() as folder:
                profile = _scaled_profile(args.profile, args.profile_scale, Path(folder))
                res = residuals_of([constants], args.workers, profile)[0]
            print("\n".join(report(constants, res)))
            return 0
    except OptimusError as exc:
        print(f"fit_calibration: error: {exc}", file=sys.stderr)
        return 2
    constants, res = fit(args.workers)
    print("\n".join(report(constants, res)))
    atomic_write_text(args.out, calibration_text(constants, res))
    return 0


def _scaled_profile(path: str | None, scale: float, folder: Path) -> str | None:
    """``path``'s profile with every time multiplied by ``scale``, as a file in ``folder`` (the
    profile itself when ``scale`` is 1); None without a profile."""
    if path is None:
        return None
    read_profile(path, "--profile:")  # a profile this release reads: format, version, kernel set
    if scale == 1.0:
        return path
    data = read_versioned_json(path, "--profile:", PROFILE_FORMAT, PROFILE_VERSION, "")
    for kernel in data["kernels"]:
        kernel["time_us"] *= scale
    scaled = folder / "scaled_profile.json"
    scaled.write_text(json.dumps(data))
    return str(scaled)


def _evaluated(items: list[str]) -> dict[str, float]:
    """The shipped paper calibration's constants with ``KEY=VALUE`` items replaced."""
    shipped = load_calibration("paper")
    assert shipped is not None  # only roofline has no file
    constants = {k: shipped.constants[k] for k in START}
    for item in items:
        key, _, value = item.partition("=")
        try:
            constants[key] = float(value) if key in START else math.nan
        except ValueError:
            constants[key] = math.nan
        if not 0 < constants[key] <= 1:  # nan too
            raise OptimusError(
                f"--evaluate: {item!r} must be KEY=VALUE with KEY one of {', '.join(START)} and "
                "VALUE in (0, 1], e.g. nvlink_efficiency=0.57"
            )
    return constants


def calibration_text(constants: dict[str, float], res: dict[str, dict[str, float]]) -> str:
    """The calibration file for ``constants``: the fit and its residuals ``res`` as a header, then
    the entries ``optimus_mllm.config.calibration`` reads."""
    body = [
        "# The paper calibration, written by scripts/fit_calibration.py (rerun it to reproduce):"
    ] + [f"#   {line}" for line in report(constants, res)]
    return "\n".join(body) + "\n" + _entries(constants)


def _entries(constants: dict[str, float]) -> str:
    """The recompute mode and ``constants`` as a calibration file's entries."""
    lines = [f"recompute: {RECOMPUTE}", "cost_model:"]
    return "\n".join(lines + [f"  {k}: {v:.2f}" for k, v in constants.items()]) + "\n"


if __name__ == "__main__":
    sys.exit(main())
