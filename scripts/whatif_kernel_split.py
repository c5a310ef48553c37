"""What-if: encoder kernels split to fit short bubbles. What would it buy the bubble scheduler?

    python scripts/whatif_kernel_split.py [--pieces US ...] [--only CASE ...] [--json OUT]

Two ways to split, along a kernel's tokens; collectives stay whole:
- ``equal``: every encoder compute kernel longer than a piece size becomes the fewest equal pieces no
  longer than it, wherever it runs;
- ``fit``: kernels stay whole in the coarse windows; placed into the LLM's bubbles, a kernel that does
  not fit the bubble at hand fills it with a piece (of at least ``FIT_MIN_WORK_US`` of work) and goes
  on in the next, so each piece is cut to the bubble it goes into.
Each extra piece pays the cost model's launch overhead (``cost_model.kernel_overhead_us``), as the
roofline charges every kernel; the rows marked ``free`` drop it, the most any split could buy. Optimus
(Algorithm 1, fine and coarse) then schedules the split encoder, and once more with Algorithm 2's two
OptimizeSchedule passes swapped (``bwd first``: backwards into the bubbles before forwards); the
Megatron-LM baselines keep whole kernels at the LLM plan's V.

This measures the scheduler only: the runtime does not execute split kernels. Cases:
- ``fig5_heavy``: the paper's Figure 5 shape (8 GPUs, LLM DP1 PP4 TP2) with a 4096-wide ViT on
  1024 tokens and the LLM at V10, where Optimus loses to balanced (scheduler-fidelity issue);
- the strong-scaling setups in the configs' reading (2048-token ViT inputs): ``strong_1536`` ...
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from array import array
from collections.abc import Callable
from pathlib import Path
from unittest import mock

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from optimus_mllm.config import OptimusConfig, load_config  # noqa: E402
from optimus_mllm.cost_model import CostModel  # noqa: E402
from optimus_mllm.errors import OptimusError  # noqa: E402
from optimus_mllm.io_utils import atomic_write_text  # noqa: E402
from optimus_mllm.planner import plan  # noqa: E402
from optimus_mllm.scheduler import bubble_scheduler  # noqa: E402
from optimus_mllm.scheduler.baselines import megatron_lm_balanced_baseline, megatron_lm_baseline  # noqa: E402
from optimus_mllm.scheduler.encoder_costs import EncoderWork, StageChain  # noqa: E402
from optimus_mllm.scheduler.bubble_scheduler import BWD, FWD, _PartitionScheduler  # noqa: E402
from optimus_mllm.scheduler.fine import Placement, Resource, stage_gaps  # noqa: E402

CASES: dict[str, tuple[str, list[str]]] = {
    "fig5_heavy": ("fig5_8gpu.yaml", [
        "model.encoders.0.hidden_size=4096", "model.encoders.0.num_attention_heads=32",
        "model.encoders.0.ffn_hidden_size=16384", "model.encoders.0.seq_length=1024",
        "parallel.llm={dp: 1, pp: 4, tp: 2, vp: 10}"]),
    "strong_1536": ("strong_1536.yaml", []),
    "strong_2048": ("strong_2048.yaml", []),
    "strong_3072": ("strong_3072.yaml", []),
}
PIECES_US = (100.0, 40.0, 15.0)
FIT_MIN_WORK_US = 2.0  # ``fit``: a bubble gets a piece only if it holds this much work besides the launch


def split_chain(chain: StageChain, piece_us: float, overhead_us: float) -> StageChain:
    """Each compute kernel longer than ``piece_us`` as ceil(d / piece_us) equal pieces, each paying
    ``overhead_us`` (the whole kernel paid it once)."""
    kernels = []
    for k in chain.kernels:
        n = 1 if k.is_comm else math.ceil(k.duration_us / piece_us)
        if n == 1:
            kernels.append(k)
            continue
        d = (k.duration_us - overhead_us) / n + overhead_us
        kernels += [dataclasses.replace(k, name=f"{k.name}.{i}", duration_us=d) for i in range(n)]
    return StageChain(tuple(kernels))


def split_work(build: Callable[..., EncoderWork], piece_us: float, overhead_us: float) -> Callable[..., EncoderWork]:
    def build_split(*args, **kwargs) -> EncoderWork:
        work = build(*args, **kwargs)
        return dataclasses.replace(work, fwd=tuple(split_chain(c, piece_us, overhead_us) for c in work.fwd),
                                   bwd=tuple(split_chain(c, piece_us, overhead_us) for c in work.bwd))
    return build_split


def place_fitted(overhead_us: float) -> Callable[..., Placement | None]:
    """``Resource.place_chain`` with ``fit`` splitting: first-fit, except that a compute kernel which
    would start later than a bubble it could partly fill fills that bubble with a piece and goes on from
    its end, each further piece paying ``overhead_us``.

    A fine chain's kernel starts are read only for where the chain starts and ends, so the starts
    returned are each kernel's first piece's, except that the last kernel's is moved so that it plus the
    kernel's duration is where its last piece ends; the spans are the pieces'."""
    min_room = overhead_us + FIT_MIN_WORK_US

    def place_chain(self: Resource, chain: StageChain, ready: float, limit: float) -> Placement | None:
        starts, t = [], ready
        spans = (array("d"), array("d"))  # compute, comm
        for d, is_comm in chain.steps:
            free, left, first = (self.comm if is_comm else self.compute), d, None
            while left > 0:
                whole = free.earliest_fit(t, left, limit)
                piece = None if is_comm or left <= min_room else free.earliest_fit(t, min_room, limit)
                if whole is None and piece is None:
                    return None
                if piece is None or (whole is not None and whole[0] <= piece[0]):
                    start, end = whole[0], whole[0] + left
                else:  # fill the bubble from the piece's start
                    start, _, bubble_end = piece
                    end = min(start + left, bubble_end, limit)
                stream = spans[is_comm]
                if stream and stream[-1] == start:
                    stream[-1] = end
                else:
                    stream.extend((start, end))
                left = 0.0 if end == start + left else left - (end - start) + overhead_us
                first = start if first is None else first
                t = end
            starts.append(first)
        if starts:
            starts[-1] = t - chain.steps[-1][0]
        return starts, spans

    return place_chain


def backward_first(optimize: Callable[..., _PartitionScheduler]) -> Callable[..., _PartitionScheduler]:
    """Algorithm 2's two OptimizeSchedule passes in the other order: backwards into the bubbles first."""
    def swapped(state: _PartitionScheduler, mode: str) -> _PartitionScheduler:
        return optimize(state, BWD if mode == FWD else FWD)
    return swapped


# The rows: how the encoder's kernels are split, and whether the extra launches are charged
Row = tuple[str, float | None, bool]  # ("whole" | "equal" | "fit", piece size, overhead charged)


def run_case(config: OptimusConfig, rows: list[Row]) -> dict:
    """Optimus with whole kernels, then with each split row, in both pass orders, and both baselines."""
    planned = plan(config)
    cost = CostModel.from_config(config)
    balanced = None
    if len(config.encoders) == 1:
        balanced = megatron_lm_balanced_baseline(config, planned.llm_plan, cost).iteration_us / 1e6
    out = {"llm_plan": str(planned.llm_plan), "megatron_s": megatron_lm_baseline(config, planned.llm_plan, cost)
           .iteration_us / 1e6, "balanced_s": balanced, "rows": []}
    overhead = config.cost_model.kernel_overhead_us
    for split, piece, charged in [("whole", None, True), *rows]:
        paid = overhead if charged else 0.0
        build, place = bubble_scheduler.build_encoder_work, Resource.place_chain
        if split == "equal":
            build = split_work(build, piece, paid)
        elif split == "fit":
            place = place_fitted(paid)
        with mock.patch.object(bubble_scheduler, "build_encoder_work", build), \
                mock.patch.object(Resource, "place_chain", place):
            fine = bubble_scheduler.optimus(config, planned, cost)
            coarse = bubble_scheduler.optimus(config, planned, cost, fine=False)
            with mock.patch.object(bubble_scheduler, "optimize_schedule",
                                   backward_first(bubble_scheduler.optimize_schedule)):
                swapped = bubble_scheduler.optimus(config, planned, cost)
        out["rows"].append({"split": split, "piece_us": piece, "overhead": charged,
                            "optimus_s": fine.best.iteration_us / 1e6, "coarse_s": coarse.best.iteration_us / 1e6,
                            "backward_first_s": swapped.best.iteration_us / 1e6,
                            "encoder_plan": str(fine.best.encoder_plan),
                            "backward_first_encoder_plan": str(swapped.best.encoder_plan)})
        if split == "whole":
            out["encoder_ms"], out["bubbles_ms"] = encoder_and_bubbles_ms(fine.best)
    return out


def encoder_and_bubbles_ms(schedule: bubble_scheduler.Schedule) -> tuple[float, float]:
    """On the GPUs with the most of each: the schedule's encoder compute per iteration, and the LLM's idle
    compute time between its first and last computation (its bubbles)."""
    w = schedule.work
    encoder = max(n * (w.fwd[e].compute_us + w.bwd[e].compute_us)
                  for n in schedule.partition for e in range(len(w.fwd)))
    bubbles = max(gaps.total() for gaps, _ in stage_gaps(schedule.timeline))
    return encoder / 1e3, bubbles / 1e3


def print_case(name: str, case: dict) -> None:
    balanced = "-" if case["balanced_s"] is None else f"{case['balanced_s']:.4f}"
    print(f"== {name}: LLM {case['llm_plan']}; Megatron-LM {case['megatron_s']:.4f} s, balanced {balanced} s; "
          f"per GPU per iteration, at most {case['encoder_ms']:.1f} ms of encoder compute (whole kernels' plan) "
          f"and {case['bubbles_ms']:.1f} ms of LLM bubbles")
    print(f"{'kernels':<28}{'encoder plan':<16}{'coarse s':>10}{'Optimus s':>11}{'bwd first s':>13}{'best':>10}"
          f"{'vs whole':>10}")
    whole = case["rows"][0]["optimus_s"]
    for row in case["rows"]:
        label = f"pieces <= {row['piece_us']:g} us" if row["split"] == "equal" else \
            {"whole": "whole", "fit": "pieces fit to bubbles"}[row["split"]]
        label += "" if row["overhead"] else " free"
        best = min(row["optimus_s"], row["backward_first_s"])
        print(f"{label:<28}{row['encoder_plan']:<16}{row['coarse_s']:>10.4f}{row['optimus_s']:>11.4f}"
              f"{row['backward_first_s']:>13.4f}{best:>10.4f}{100 * (best / whole - 1):>+9.2f}%")
    print()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pieces", nargs="+", type=float, default=list(PIECES_US), metavar="US",
                        help=f"piece sizes in us (default {' '.join(f'{p:g}' for p in PIECES_US)}); each runs "
                             "with the launch overhead charged and free")
    parser.add_argument("--only", nargs="+", choices=sorted(CASES), metavar="CASE",
                        help=f"cases to run (default all: {', '.join(CASES)})")
    parser.add_argument("--json", metavar="OUT", help="write every figure as JSON")
    args = parser.parse_args(argv)
    if not all(math.isfinite(p) and p > 0 for p in args.pieces):
        print("whatif_kernel_split: error: --pieces: piece sizes must be positive numbers of us", file=sys.stderr)
        return 2
    if args.json and not Path(args.json).parent.is_dir():  # before minutes of scheduling, not after
        print(f"whatif_kernel_split: error: --json: directory {Path(args.json).parent} does not exist; create it "
              "first", file=sys.stderr)
        return 2
    rows: list[Row] = [("equal", p, charged) for p in args.pieces for charged in (True, False)]
    rows += [("fit", None, charged) for charged in (True, False)]
    results = {}
    try:
        for name in args.only or CASES:
            path, overrides = CASES[name]
            results[name] = run_case(load_config(REPO / "configs" / "paper" / path, overrides), rows)
            print_case(name, results[name])
        if args.json:
            atomic_write_text(args.json, json.dumps(results, indent=2) + "\n")
    except OptimusError as exc:
        print(f"whatif_kernel_split: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
