"""``optimus-profile``: measure the kernels the scheduler costs on this GPU and write a kernel
profile.

Point ``cost_model.profile`` at the written file (or pass it to ``benchmarks/bench_scheduler.py
--profile``) and the cost model uses the measured times instead of its roofline.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from optimus_mllm.cli.common import ArgumentParser, add_config_arguments, run
from optimus_mllm.config import load_config
from optimus_mllm.errors import OptimusError
from optimus_mllm.runtime.gpu_status import warn_unverified

PROG = "optimus-profile"
NO_GPU = (
    "no CUDA GPU is visible; run it on a GPU machine (the cost model uses its roofline without a "
    "profile)"
)


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog=PROG,
        description="Measure the forward and backward time of every compute kernel "
        "the scheduler costs (encoder and LLM layers at the planned TP "
        "shard shapes) with CUDA events; write the JSON profile the "
        "cost model loads instead of its roofline.",
    )
    add_config_arguments(parser, "configs/paper/fig5_8gpu.yaml")
    parser.add_argument(
        "--out", default="kernel_profile.json", help="profile to write (default: %(default)s)"
    )
    parser.add_argument(
        "--warmup", type=int, default=5, help="untimed runs per kernel (default: %(default)s)"
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=20,
        help="timed runs per kernel, the median is kept (default: %(default)s)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        parser.error(
            f"--repeats must be >= 1 and --warmup >= 0, got {args.repeats} and {args.warmup}"
        )

    def body() -> int:
        import torch

        if not torch.cuda.is_available():
            raise OptimusError(NO_GPU)
        warn_unverified("optimus-profile")
        # fail before minutes of measuring, not after
        if not Path(args.out).resolve().parent.is_dir():
            raise OptimusError(
                f"--out {args.out}: directory {Path(args.out).parent} does not exist; create it "
                "first"
            )
        from optimus_mllm.tools.profiler import profile_kernels, write_profile

        config = load_config(args.config, args.override)
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[
            config.training.precision
        ]
        profile = profile_kernels(config, warmup=args.warmup, repeats=args.repeats, dtype=dtype)
        write_profile(profile, args.out)
        sys.stdout.write(format_profile(profile, args.out))
        return 0

    return run(PROG, body)


def format_profile(profile: dict[str, Any], out: str) -> str:
    """The measured kernels against the roofline, one row each."""
    lines = [
        (
            f"config {profile['config']} on {profile['device']}, {profile['dtype']}, kernel set "
            f"{profile['kernel_set']}; median of {profile['repeats']} after {profile['warmup']} "
            "warm-up"
        ),
        f"{'module':<12}{'kernel':<24}{'phase':<6}{'tp':>3}"
        f"{'measured us':>13}{'roofline us':>13}{'ratio':>7}",
    ]
    for k in profile["kernels"]:
        ratio = k["time_us"] / k["roofline_us"] if k["roofline_us"] else float("nan")
        lines.append(
            f"{k['module']:<12}{k['kernel']:<24}{k['phase']:<6}{k['tp']:>3}{k['time_us']:>13.1f}"
            f"{k['roofline_us']:>13.1f}{ratio:>7.2f}"
        )
    lines += [
        f"not measured: {profile['not_measured']}",
        f"wrote {len(profile['kernels'])} kernels to {out}",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
