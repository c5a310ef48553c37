"""``optimus-profile``: measure what the scheduler costs on the machine the job runs on and write
a profile the cost model loads instead of its roofline and bandwidth constants.

    optimus-profile --config FILE.yaml --out P.json                       # one GPU or CPU process
    torchrun --nproc-per-node N -m optimus_mllm.cli.profile --config FILE.yaml --out P.json

Every compute kernel is timed at the config's shard shapes and precision: with CUDA events on a GPU,
by wall clock on CPU at the process's threads (torchrun gives each rank one). Run as a job of the
config's world size, every rank times the kernels at once (so a CPU's ranks share its memory as in
training, and the profile keeps their mean) and the job's communication is measured on the LLM
plan's own groups (``tools/comm_profiler.py``); on CPU ranks a few real steps of Megatron-LM's
placement then fit the schedule's host work per LLM op (``tools/step_profiler.py``). Point
``cost_model.profile`` at the file, or pass it to ``optimus-plan --profile``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from optimus_mllm.cli.common import ArgumentParser, add_config_arguments, run
from optimus_mllm.config import OptimusConfig, load_config
from optimus_mllm.errors import OptimusError
from optimus_mllm.planner.plans import ParallelPlan

PROG = "optimus-profile"


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog=PROG,
        description="Measure the forward and backward time of every compute kernel the scheduler "
        "costs (encoder and LLM layers at the planned TP shard shapes) on this GPU or CPU and, "
        "under torchrun with the config's world size, the job's communication; write the JSON "
        "profile the cost model loads instead of its roofline.",
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
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))

    def body() -> int:
        config = load_config(args.config, args.override)
        if world not in (1, config.cluster.num_gpus):
            raise OptimusError(
                f"a job of {world} ranks cannot measure config {config.name}'s communication: "
                f"run it with torchrun --nproc-per-node {config.cluster.num_gpus} (the config's "
                "cluster.num_gpus), or as one process to time its kernels only"
            )
        # fail before minutes of measuring, not after
        if not Path(args.out).resolve().parent.is_dir():
            raise OptimusError(
                f"--out {args.out}: directory {Path(args.out).parent} does not exist; create it "
                "first"
            )
        profile = _measure(config, args.warmup, args.repeats, world)
        if rank == 0:
            from optimus_mllm.tools.profiler import write_profile

            write_profile(profile, args.out)
            sys.stdout.write(format_profile(profile, args.out))
        return 0

    # every rank reads the same job, so every rank meets the same error; rank 0 says it
    return run(PROG, body) if rank == 0 else _quiet(body)


def _quiet(body: Callable[[], int]) -> int:
    try:
        return body()
    except OptimusError:
        return 2


def _measure(config: OptimusConfig, warmup: int, repeats: int, world: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from optimus_mllm.runtime.dtypes import DTYPES

    on_gpu = torch.cuda.is_available()
    if on_gpu:
        from optimus_mllm.runtime.gpu_status import warn_unverified

        warn_unverified("optimus-profile")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = "cuda" if on_gpu else "cpu"
    dtype = DTYPES[config.training.precision]
    if world == 1:  # megatron-core's layers need a process group, of this one process
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    else:
        dist.init_process_group("nccl" if on_gpu else "gloo")
    try:
        return _measure_job(config, warmup, repeats, device, dtype)
    finally:
        dist.destroy_process_group()


def _measure_job(
    config: OptimusConfig, warmup: int, repeats: int, device: str, dtype: Any
) -> dict[str, Any]:
    """Every rank times the kernels at once and, on CPU, the layers around them (at TP 1); then
    the communication on the LLM plan's groups."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    import megatron_patches
    from optimus_mllm.planner import plan
    from optimus_mllm.tools.comm_profiler import measure_communication
    from optimus_mllm.tools.layer_profiler import measure_layer_host
    from optimus_mllm.tools.profiler import profile_kernels, wallclock_timer

    world = dist.get_world_size()
    llm_plan = plan(config).llm_plan
    profile = profile_kernels(config, warmup=warmup, repeats=repeats, device=device, dtype=dtype)
    _mean_over_ranks(profile["kernels"], ("time_us", "spread_us"))
    if device == "cpu":
        megatron_patches.apply()  # megatron-core's layers on CPU, as the runtime runs them
        # TP 1 and one data-parallel rank: every rank times its own layers and optimizer
        parallel_state.initialize_model_parallel(pipeline_model_parallel_size=world)
        try:
            tensor_parallel.model_parallel_cuda_manual_seed(config.training.seed)
            host, per_param = measure_layer_host(
                config, llm_plan, warmup, repeats, dtype, wallclock_timer
            )
        finally:
            parallel_state.destroy_model_parallel()
        optimizer = [{"optimizer_us_per_param": per_param}]
        _mean_over_ranks(host, ("layer_us", "kernels_us", "host_us"))
        _mean_over_ranks(optimizer, ("optimizer_us_per_param",))
        profile.update(layer_host=host, **optimizer[0])
    if world == 1:
        return profile
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=llm_plan.tp, pipeline_model_parallel_size=llm_plan.pp
    )
    try:
        communication, not_measured = measure_communication(warmup, repeats)
    finally:
        parallel_state.destroy_model_parallel()
    profile.update(
        world_size=world,
        communication=communication,
        not_measured=not_measured,
        statistic="median per rank, mean over the ranks",
    )
    if device == "cpu" and world == config.cluster.num_gpus:
        from optimus_mllm.scheduler.baselines import megatron_lm_problem

        problem = megatron_lm_problem(config, llm_plan)
        if problem is None:
            profile["step_host"] = _measure_step_host(config, llm_plan, profile)
        else:  # said, not skipped silently: its predictions lack the schedule's host work
            profile["not_measured"] += (
                f"; the schedule's host work per LLM op, fitted to steps of Megatron-LM's "
                f"placement, which this job cannot run ({problem})"
            )
    return profile


def _measure_step_host(
    config: OptimusConfig, llm_plan: ParallelPlan, profile: dict[str, Any]
) -> dict[str, Any]:
    """A few real steps of Megatron-LM's placement (the runtime's baseline), and the schedule's
    host work per LLM op fitted to them with the rest of ``profile``
    (``scheduler/step_host.py``)."""
    import tempfile

    from optimus_mllm.costing.cost_model import CostModel
    from optimus_mllm.scheduler.baselines import megatron_lm_baseline
    from optimus_mllm.scheduler.step_host import fit_config, fit_microbatch_host_us
    from optimus_mllm.tools.profiler import write_profile
    from optimus_mllm.tools.step_profiler import measure_baseline_step_us

    fit = fit_config(config, llm_plan)
    measured = [{"measured_step_us": measure_baseline_step_us(fit, llm_plan)}]
    _mean_over_ranks(measured, ("measured_step_us",))
    measured_us = measured[0]["measured_step_us"]
    with tempfile.TemporaryDirectory() as folder:  # the cost model reads a profile from a file
        path = str(Path(folder) / "profile.json")
        write_profile(profile, path)
        cost = CostModel.from_config(replace(fit, cost_model=replace(fit.cost_model, profile=path)))
    return {
        "microbatches": fit.num_microbatches_total // llm_plan.dp,
        "measured_step_us": measured_us,
        "predicted_step_us": megatron_lm_baseline(fit, llm_plan, cost).iteration_us,
        "microbatch_host_us": fit_microbatch_host_us(fit, llm_plan, cost, measured_us),
    }


def _mean_over_ranks(rows: list[dict[str, Any]], fields: tuple[str, ...]) -> None:
    """Replace ``fields`` of every row by their mean over the ranks (each has the same rows)."""
    import torch
    import torch.distributed as dist

    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    sums = torch.tensor(
        [[row[f] for f in fields] for row in rows], dtype=torch.float64, device=device
    )
    dist.all_reduce(sums)
    for row, total in zip(rows, sums.tolist()):
        row.update({f: t / dist.get_world_size() for f, t in zip(fields, total)})


def format_profile(profile: dict[str, Any], out: str) -> str:
    """The measured kernels against the roofline, one row each."""
    lines = [
        (
            f"config {profile['config']} on {profile['device']} (threads: {profile['threads']}), "
            f"{profile['dtype']}, kernel set "
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
    for c in profile.get("communication", []):
        lines.append(
            f"{c['collective']} over {c['group_size']} ranks ({c['group']}): "
            f"{c['latency_us']:.1f} us + {c['us_per_byte'] * 1e6:.1f} us/MB"
        )
    if "step_host" in profile:
        fit = profile["step_host"]
        lines.append(
            f"Megatron-LM's placement at {fit['microbatches']} microbatches: measured "
            f"{fit['measured_step_us'] / 1e6:.4f} s a step, kernels, layers, communication and "
            f"optimizer predict {fit['predicted_step_us'] / 1e6:.4f} s; the schedule's host work "
            f"{fit['microbatch_host_us'] / 1e3:.2f} ms per LLM op makes up the rest"
        )
    lines += [
        f"not measured: {profile['not_measured']}",
        f"wrote {len(profile['kernels'])} kernels to {out}",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
