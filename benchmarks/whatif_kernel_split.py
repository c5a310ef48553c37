"""What-if: encoder kernels whole, in equal pieces, or cut to fit the bubbles they go into. What
does each buy?

    python benchmarks/whatif_kernel_split.py [--pieces US ...] [--only CASE ...]
        [--calibration NAME] [--json OUT]

The bubble scheduler cuts a kernel the runtime can split (a transformer layer's compute kernel) to
fit the bubble it goes into (``scheduler/fine.py``), each piece priced by its shape: whole blocks
of 128 rows, tile and wave quantization of an H100-class GPU, a non-GEMM backward piece recomputing
its forward rows (``CostModel.piece_us``): that is the ``fit ... by shape`` row. For comparison,
with every kernel whole (the paper's Algorithm 1 as it stands: ``whole``); cut to fit with each
piece priced as its share of the work plus the cost model's launch overhead
(``cost_model.kernel_overhead_us``), as if the GPU ran any piece at the whole kernel's efficiency
(``fit``); and with every compute kernel longer than a piece size cut into the fewest equal pieces
no longer than it, wherever it runs, priced the same way (``equal``). The rows marked ``free`` drop
the launch too, the most any split could buy. The Megatron-LM baselines keep whole kernels at the
LLM plan's V. Cases:
- ``fig5_heavy``: the paper's Figure 5 shape (8 GPUs, LLM DP1 PP4 TP2) with a 4096-wide ViT on
  1024 tokens and the LLM at V10, where Optimus with whole kernels loses to balanced;
- the strong-scaling setups in the configs' reading (2048-token ViT inputs): ``strong_1536`` ...
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Literal
from unittest import mock

from optimus_mllm.config import OptimusConfig, load_config
from optimus_mllm.config.files import atomic_write_text
from optimus_mllm.costing.cost_model import CostModel
from optimus_mllm.errors import OptimusError
from optimus_mllm.planner import plan
from optimus_mllm.scheduler import bubble_scheduler
from optimus_mllm.scheduler.baselines import megatron_lm_balanced_baseline, megatron_lm_baseline
from optimus_mllm.scheduler.encoder_costs import EncoderWork, StageChain
from optimus_mllm.scheduler.fine import stage_gaps

REPO = Path(__file__).resolve().parent.parent

CASES: dict[str, tuple[str, list[str]]] = {
    "fig5_heavy": ("fig5_heavy.yaml", []),
    "strong_1536": ("strong_1536.yaml", []),
    "strong_2048": ("strong_2048.yaml", []),
    "strong_3072": ("strong_3072.yaml", []),
}
PIECES_US = (100.0, 40.0, 15.0)


def split_chain(chain: StageChain, piece_us: float, overhead_us: float) -> StageChain:
    """Each compute kernel longer than ``piece_us`` as ceil(d / piece_us) equal pieces, each paying
    ``overhead_us`` (the whole kernel paid it once); nothing is cut further."""
    kernels = []
    for k in chain.kernels:
        n = 1 if k.is_comm else math.ceil(k.duration_us / piece_us)
        if n == 1:
            kernels.append(dataclasses.replace(k, splittable=False))
            continue
        d = (k.duration_us - overhead_us) / n + overhead_us
        kernels += [
            dataclasses.replace(k, name=f"{k.name}.{i}", duration_us=d, splittable=False)
            for i in range(n)
        ]
    return StageChain(tuple(kernels))


# The rows: how the encoder's kernels are split, and how a piece is priced: by its shape (the cost
# model's tile and wave quantization and recomputation, ``CostModel.piece_us``), as its share of the
# work plus a launch, or as its share alone
Pricing = Literal["shape", "launch", "free"]
Row = tuple[str, float | None, Pricing]  # ("whole" | "equal" | "fit", piece size, pricing)


def encoder_work(build: Callable[..., EncoderWork], row: Row) -> Callable[..., EncoderWork]:
    """``build_encoder_work`` with the row's kernels."""
    split, piece, pricing = row

    def build_row(config: OptimusConfig, *args: object) -> EncoderWork:
        work = build(config, *args)
        if split == "whole" or (split, pricing) == ("fit", "shape"):
            return work.whole() if split == "whole" else work
        paid = 0.0 if pricing == "free" else config.cost_model.kernel_overhead_us
        if split == "fit":
            chain = unpriced
            work = dataclasses.replace(work, launch_us=paid)
        else:
            chain = lambda c: split_chain(c, piece, paid)  # noqa: E731
        return dataclasses.replace(
            work, fwd=tuple(map(chain, work.fwd)), bwd=tuple(map(chain, work.bwd))
        )

    return build_row


def unpriced(chain: StageChain) -> StageChain:
    """Its kernels' pieces priced as their share of the work plus a launch, not by their shape."""
    return StageChain(tuple(dataclasses.replace(k, prices=None) for k in chain.kernels))


def run_case(config: OptimusConfig, rows: list[Row]) -> dict:
    """Optimus with whole kernels, then with each split row, and both baselines."""
    planned = plan(config)
    cost = CostModel.from_config(config)
    balanced = None
    if len(config.encoders) == 1:
        balanced = megatron_lm_balanced_baseline(config, planned.llm_plan, cost).iteration_us / 1e6
    out = {
        "llm_plan": str(planned.llm_plan),
        "megatron_s": megatron_lm_baseline(config, planned.llm_plan, cost).iteration_us / 1e6,
        "balanced_s": balanced,
        "rows": [],
    }
    for row in [("whole", None, "launch"), *rows]:
        with mock.patch.object(
            bubble_scheduler,
            "build_encoder_work",
            encoder_work(bubble_scheduler.build_encoder_work, row),
        ):
            fine = bubble_scheduler.best_schedule(config, planned, cost)
            coarse = bubble_scheduler.best_schedule(config, planned, cost, fine=False)
        split, piece, pricing = row
        out["rows"].append(
            {
                "split": split,
                "piece_us": piece,
                "pricing": pricing,
                "optimus_s": fine.best.iteration_us / 1e6,
                "coarse_s": coarse.best.iteration_us / 1e6,
                "encoder_plan": str(fine.best.encoder_plan),
            }
        )
        if split == "whole":
            out["encoder_ms"], out["bubbles_ms"] = encoder_and_bubbles_ms(fine.best)
    return out


def encoder_and_bubbles_ms(schedule: bubble_scheduler.Schedule) -> tuple[float, float]:
    """On the GPUs with the most of each: the schedule's encoder compute per iteration, and the
    LLM's idle
    compute time between its first and last computation (its bubbles)."""
    w = schedule.work
    encoder = max(
        n * (w.fwd[e].compute_us + w.bwd[e].compute_us)
        for n in schedule.partition
        for e in range(len(w.fwd))
    )
    bubbles = max(gaps.total() for gaps, _ in stage_gaps(schedule.timeline))
    return encoder / 1e3, bubbles / 1e3


def print_case(name: str, case: dict) -> None:
    balanced = "-" if case["balanced_s"] is None else f"{case['balanced_s']:.4f}"
    print(
        f"== {name}: LLM {case['llm_plan']}; Megatron-LM {case['megatron_s']:.4f} s, balanced "
        f"{balanced} s; "
        f"per GPU per iteration, at most {case['encoder_ms']:.1f} ms of encoder compute (whole "
        "kernels' plan) "
        f"and {case['bubbles_ms']:.1f} ms of LLM bubbles"
    )
    print(f"{'kernels':<32}{'encoder plan':<16}{'coarse s':>10}{'Optimus s':>11}{'vs whole':>10}")
    whole_s = case["rows"][0]["optimus_s"]
    for row in case["rows"]:
        label = (
            f"pieces <= {row['piece_us']:g} us"
            if row["split"] == "equal"
            else {"whole": "whole", "fit": "pieces fit to bubbles"}[row["split"]]
        )
        if row["split"] != "whole":
            label += {"shape": " by shape", "launch": "", "free": " free"}[row["pricing"]]
        print(
            f"{label:<32}{row['encoder_plan']:<16}{row['coarse_s']:>10.4f}{row['optimus_s']:>11.4f}"
            f"{100 * (row['optimus_s'] / whole_s - 1):>+9.2f}%"
        )
    print()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--pieces",
        nargs="+",
        type=float,
        default=list(PIECES_US),
        metavar="US",
        help=f"piece sizes in us (default {' '.join(f'{p:g}' for p in PIECES_US)}); each runs "
        "with the launch overhead charged and free",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        choices=sorted(CASES),
        metavar="CASE",
        help=f"cases to run (default all: {', '.join(CASES)})",
    )
    parser.add_argument(
        "--calibration",
        default="roofline",
        metavar="NAME",
        help="the cost model's calibration (default roofline; paper; or a calibration YAML file)",
    )
    parser.add_argument("--json", metavar="OUT", help="write every figure as JSON")
    args = parser.parse_args(argv)
    if not all(math.isfinite(p) and p > 0 for p in args.pieces):
        print(
            "whatif_kernel_split: error: --pieces: piece sizes must be positive numbers of us",
            file=sys.stderr,
        )
        return 2
    if args.json and not Path(args.json).parent.is_dir():  # before minutes of scheduling, not after
        print(
            f"whatif_kernel_split: error: --json: directory {Path(args.json).parent} does not "
            "exist; create it "
            "first",
            file=sys.stderr,
        )
        return 2
    rows: list[Row] = [("equal", p, pricing) for p in args.pieces for pricing in ("launch", "free")]
    rows += [("fit", None, pricing) for pricing in ("shape", "launch", "free")]
    results = {}
    try:
        for name in args.only or CASES:
            path, overrides = CASES[name]
            calibration = f"cost_model.calibration={args.calibration}"
            results[name] = run_case(
                load_config(REPO / "configs" / "paper" / path, [*overrides, calibration]), rows
            )
            print_case(name, results[name])
        if args.json:
            atomic_write_text(args.json, json.dumps(results, indent=2) + "\n")
    except OptimusError as exc:
        print(f"whatif_kernel_split: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
