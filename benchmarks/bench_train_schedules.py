"""Wall time of optimus-train on CPU with a schedule per iteration against the artifact's one.

    python benchmarks/bench_train_schedules.py [--iterations 20] [--repeats 2] [--nproc 4]

Writes issue 34's sample webdataset (``make_sample_dataset.py --images-per-sample 0-4 --sizes
16,32 --text-only 0.2``) to a temporary folder and trains ``configs/tiny.yaml`` on it under
torchrun (gloo), one sample and one to four images per microbatch, four microbatches a step: once
with the artifact's schedule every step (``fixed``), once with ``training.schedule_per_iteration``
(``per-iteration``: each iteration's schedule built on a background thread while the step before
trains). The two alternate ``--repeats`` times. A row is the mean step time over the steps after
the first (start-up excluded) from the step lines, the run's wall time, and for ``per-iteration``
how many steps ran their own schedule. A measurement, not a test: other work on the machine moves
it.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STEP_MS = re.compile(r"^step (\d+)/\d+ \| .* \| ([0-9.]+) ms \| ")
OVERRIDES = [
    "training.micro_batch_size=1",
    "training.global_batch_size=4",
    "data.max_images_per_microbatch=4",
]


def make_dataset(out: Path) -> None:
    command = [sys.executable, str(REPO / "scripts" / "make_sample_dataset.py"), "--out", str(out)]
    command += ["--images-per-sample", "0-4", "--sizes", "16,32", "--text-only", "0.2"]
    subprocess.run(command, check=True, capture_output=True)


def train(data: Path, iterations: int, nproc: int, per_iteration: bool) -> dict:
    """One optimus-train run: its mean step time (steps after the first), wall time and the
    schedules its step lines name."""
    overrides = [*OVERRIDES, f"data.path={data}", f"training.train_iters={iterations}"]
    if per_iteration:
        overrides.append("training.schedule_per_iteration=true")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", str(nproc), "-m", "optimus_mllm.train"]
    command += ["--config", str(REPO / "configs" / "tiny.yaml"), "--override", *overrides]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    steps = [(m, line) for line in done.stdout.splitlines() if (m := STEP_MS.match(line))]
    times = [float(m.group(2)) for m, _ in steps[1:]]
    own = sum("| schedule per-iteration" in line for _, line in steps)
    return {"mean_step_ms": statistics.mean(times), "wall_s": wall, "own": own, "steps": len(steps)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--nproc", type=int, default=4)
    args = parser.parse_args(argv)
    if args.iterations < 2 or args.repeats < 1:
        parser.error("give --iterations 2 or more and --repeats 1 or more")
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        make_dataset(data)
        runs: dict[str, list[dict]] = {"fixed": [], "per-iteration": []}
        for _ in range(args.repeats):
            for policy in runs:
                runs[policy].append(
                    train(data, args.iterations, args.nproc, policy == "per-iteration")
                )
    print(f"{args.iterations} iterations on {args.nproc} gloo ranks, {args.repeats} runs each")
    print(f"{'schedule':<14} {'mean step ms':>12} {'wall s':>8} {'own schedule':>13}")
    means = {}
    for policy, found in runs.items():
        means[policy] = statistics.mean(r["mean_step_ms"] for r in found)
        wall = statistics.mean(r["wall_s"] for r in found)
        own = (
            "-"
            if policy == "fixed"
            else f"{sum(r['own'] for r in found)}/" + str(sum(r["steps"] for r in found))
        )
        print(f"{policy:<14} {means[policy]:>12.1f} {wall:>8.1f} {own:>13}")
    overhead = means["per-iteration"] / means["fixed"] - 1
    print(f"per-iteration against fixed: {overhead:+.1%} mean step time")
    return 0


if __name__ == "__main__":
    sys.exit(main())
