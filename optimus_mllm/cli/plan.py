"""``optimus-plan``: run the model planner on a YAML config and print (or save) the plans."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from typing import Any

from optimus_mllm.cli.common import ArgumentParser, run
from optimus_mllm.config import load_config
from optimus_mllm.io_utils import atomic_write_text
from optimus_mllm.memory_model import GIB, MemoryBreakdown
from optimus_mllm.planner import PlannerResult, plan

PROG = "optimus-plan"


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog=PROG, description="Choose the LLM plan and enumerate colocated encoder plans "
                                                   "(Optimus model planner).")
    parser.add_argument("--config", required=True, help="YAML config, e.g. configs/paper/strong_3072.yaml")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config field, e.g. training.micro_batch_size=1 (repeatable)")
    parser.add_argument("--json", metavar="OUT", help="also write the result as JSON to OUT")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> int:
        config = load_config(args.config, args.override)
        result = plan(config)
        if args.json:
            atomic_write_text(args.json, json.dumps(result_to_dict(result), indent=2) + "\n")
        sys.stdout.write(format_result(result))
        return 0

    return run(PROG, body)


def _gib(value: float) -> str:
    return f"{value / GIB:.2f}"


def format_result(result: PlannerResult) -> str:
    lines = [
        f"config {result.config_name}: {result.num_gpus} GPUs of {result.gpu_memory_bytes / GIB:g} GiB",
        f"LLM plan ({result.llm_plan_origin}): {result.llm_plan}, {result.num_microbatches} microbatches per "
        f"LLM pipeline",
    ]
    for rejected in result.llm_rejected:
        lines.append(f"  tried first, rejected: {rejected.plan}: {rejected.reason}")
    lines += ["", f"encoder plans ({len(result.candidates)} kept, ranked by {result.ranking}):"]
    header = (f"{'rank':>4}  {'encoder plan':<16}{'m':>4}  {'params':>7}{'grads':>7}{'optim':>7}{'activ':>7}"
              f"{'total':>8}  {'overhead':>8}  {'max mb':>6}  partitions")
    lines += [header, "  " + "-" * (len(header) - 2)]
    for i, c in enumerate(result.candidates, 1):
        mem: MemoryBreakdown = c.memory
        parts = c.partitions
        partitions = f"{len(parts.partitions)} of {parts.num_compositions}"
        if parts.truncated:
            partitions += " (capped)"
        lines.append(f"{i:>4}  {str(c.plan):<16}{c.m:>4}  {_gib(mem.params):>7}{_gib(mem.grads):>7}"
                     f"{_gib(mem.optimizer):>7}{_gib(mem.activations):>7}{_gib(mem.total):>8}  "
                     f"{_gib(c.overhead_bytes):>8}  {c.max_microbatches_per_pipeline:>6}  {partitions}")
    lines += ["", "  memory columns: GiB on the fullest GPU (LLM + encoder); overhead: paper §4.5, "
                  "k(DP_enc - DP_llm)Φ_enc/n_gpu in GiB;",
              "  max mb: most microbatches one encoder pipeline can hold activations for; partitions: kept "
              "(symmetry-reduced, capped) of all compositions of the microbatches over the m pipelines"]
    if result.pruned:
        lines += ["", f"pruned encoder plans ({len(result.pruned)}):"]
        lines += [f"  {str(p.plan):<16}{p.reason}" for p in result.pruned]
    if result.candidates:
        lines += ["", f"chosen: LLM {result.llm_plan} | encoder {result.candidates[0].plan}"]
    else:
        lines += ["", "chosen: none: no encoder plan fits; see the reasons above"]
    return "\n".join(lines) + "\n"


def result_to_dict(result: PlannerResult) -> dict[str, Any]:
    def memory(mem: MemoryBreakdown) -> dict[str, float]:
        return {**asdict(mem), "total": mem.total}

    return {
        "config": result.config_name,
        "num_gpus": result.num_gpus,
        "gpu_memory_bytes": result.gpu_memory_bytes,
        "llm_plan": result.llm_plan.as_dict(),
        "llm_plan_origin": result.llm_plan_origin,
        "llm_rejected": [{"plan": p.plan.as_dict(), "reason": p.reason} for p in result.llm_rejected],
        "num_microbatches": result.num_microbatches,
        "ranking": result.ranking,
        "encoder_plans": [
            {
                "plan": c.plan.as_dict(),
                "m": c.m,
                "memory_bytes": memory(c.memory),
                "llm_memory_bytes": memory(c.llm_memory),
                "encoder_memory_bytes": memory(c.encoder_memory),
                "overhead_bytes": c.overhead_bytes,
                "max_microbatches_per_pipeline": c.max_microbatches_per_pipeline,
                "num_compositions": c.partitions.num_compositions,
                "partitions_truncated": c.partitions.truncated,
                "partitions": [list(p) for p in c.partitions.partitions],
            }
            for c in result.candidates
        ],
        "pruned": [{"plan": p.plan.as_dict(), "reason": p.reason} for p in result.pruned],
    }


if __name__ == "__main__":
    sys.exit(main())
