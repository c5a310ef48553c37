"""GPU benchmark of the Optimus runtime's device path, on one GPU, in one run.

    python benchmarks/bench_gpu.py [--config configs/gpu_single.yaml] [--json OUT] [--peak-tflops T]
    [--steps N]

1. kernel-level ops: the encoder's forward+backward as the runtime's kernel-sized ops vs the same
   encoder under plain autograd (time ratio; target <= 1.05): placed at one hook point, as a
   one-GPU schedule places them (the backward one autograd call), and, for the host cost per op,
   each at a hook point of its own;
2. overlap: a communication-like window on the main stream (an NCCL all-reduce over the visible GPUs
   where there are several, else a ``torch.cuda._sleep`` of measured length, named in the output)
   with one microbatch's encoder ops launched on the side stream at its start: the share of the
   encoder ops' time hidden (target >= 80 %), and the slowdown those ops cause to LLM-shaped GEMMs
   running alongside;
3. one bubble: the encoder ops that the schedule artifact places at one hook point, predicted by the
   roofline cost model and by a kernel profile measured here (``optimus_mllm.tools.profiler``) vs
   their measured time, batched as the executor runs them (target within 10 % with the profile);
4. a training step (ViT + GPT on this GPU, world of 1) with the Optimus runtime and the
   Megatron-style baseline: step time and MFU (target >= 40 %; Optimus no more than 2 % slower,
   there being no bubbles to fill on one GPU). Each mode trains in a process of its own
   (``--train-mode``): a closed trainer does not free all its tensors, and the two side by side
   would not fit an 80 GB GPU.

Before measuring, the memory model's figure for a training step is checked against the GPU's free
memory. Every number is measured in this run; without a CUDA GPU the script exits with status 2.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.metadata
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from optimus_mllm.config import OptimusConfig, load_config
from optimus_mllm.config.files import atomic_write_bytes, atomic_write_text
from optimus_mllm.costing.cost_model import CostModel, load_profile
from optimus_mllm.costing.memory_model import GIB
from optimus_mllm.errors import OptimusError
from optimus_mllm.planner import plan
from optimus_mllm.planner.planner import PlannerResult
from optimus_mllm.runtime.dtypes import DTYPES
from optimus_mllm.runtime.encoder_ops import WHOLE, MicrobatchRun, build_stage_ops
from optimus_mllm.runtime.executor import op_batches
from optimus_mllm.runtime.gpu_status import warn_unverified
from optimus_mllm.runtime.hook_plan import build_hook_plan
from optimus_mllm.runtime.streams import SideStream
from optimus_mllm.runtime.trainer import Trainer
from optimus_mllm.runtime.vit import EncoderStage
from optimus_mllm.scheduler.artifact import schedule_job_artifact
from optimus_mllm.scheduler.artifact_format import ScheduleArtifact
from optimus_mllm.scheduler.encoder_costs import build_encoder_work
from optimus_mllm.scheduler.metrics import model_flops_per_iteration
from optimus_mllm.tools.profiler import cuda_timer, median_us, profile_kernels, write_profile

REPO = Path(__file__).resolve().parent.parent

PROG = "bench_gpu.py"
MODES = ("baseline", "optimus")
FORMAT, VERSION = "optimus-bench-gpu", 1
TARGETS = {
    "kernel_level_ratio": 1.05,
    "hidden_share": 0.80,
    "profile_error": 0.10,
    "mfu": 0.40,
    "optimus_slowdown": 0.02,
}
Tensor = torch.Tensor


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Measure the Optimus runtime on one CUDA GPU."
    )
    parser.add_argument(
        "--config",
        default=str(REPO / "configs" / "gpu_single.yaml"),
        help="a one-GPU config (DP1 PP1 TP1), default configs/gpu_single.yaml",
    )
    parser.add_argument("--json", metavar="OUT", help="also write the results here as JSON")
    parser.add_argument(
        "--peak-tflops",
        type=float,
        help="the GPU's dense bf16 peak for MFU (default: the config's cluster.peak_tflops)",
    )
    parser.add_argument(
        "--steps", type=int, default=5, help="timed training steps per mode (default 5)"
    )
    parser.add_argument(
        "--warmup", type=int, default=2, help="untimed training steps first (default 2)"
    )
    parser.add_argument(
        "--profile-rows",
        type=int,
        default=0,
        metavar="N",
        help="with --train-mode: after the timed steps, one more step under torch.profiler, its "
        "top N ops by host time (and by GPU time on a GPU) printed",
    )
    parser.add_argument(
        "--trace",
        metavar="OUT",
        help="with --profile-rows: also write that step's timeline (Chrome trace JSON, gzipped "
        "when OUT ends in .gz): which stream ran what when, the host's gaps between launches",
    )
    parser.add_argument(
        "--train-mode",
        choices=MODES,
        help="only step 4 for this mode, its results to --json: what the whole run starts once "
        "per mode, in a process of its own (runs on the CPU too)",
    )
    return parser


# -- timing --------------------------------------------------------------------------------------


def gpu_ms(
    fn: Callable[[], object],
    repeats: int,
    warmup: int = 2,
    before: Callable[[], object] | None = None,
) -> float:
    """Median over ``repeats`` of ``fn``'s time on the current stream (CUDA events), host gaps
    included;
    ``before`` runs untimed ahead of each timed repeat."""

    def timer(f: Callable[[], object]) -> float:
        if before is not None:
            before()
        return cuda_timer(f)

    return median_us(fn, warmup, repeats, timer) / 1e3


class SleepClock:
    """``torch.cuda._sleep`` in milliseconds: its cycles per ms, measured once."""

    def __init__(self) -> None:
        cycles = 20_000_000
        torch.cuda._sleep(cycles // 10)
        self.cycles_per_ms = cycles / gpu_ms(lambda: torch.cuda._sleep(cycles), repeats=3, warmup=1)

    def sleep(self, ms: float) -> None:
        torch.cuda._sleep(max(1, int(ms * self.cycles_per_ms)))


# -- the encoder, standalone -----------------------------------------------------------------------


class Encoder:
    """The config's encoder stage (PP1, TP1 on this GPU) with inputs and an output gradient per
    microbatch."""

    def __init__(self, config: OptimusConfig, dtype: torch.dtype):
        import torch.distributed as dist

        self.config, self.dtype, self.device = config, dtype, torch.device("cuda")
        # megatron-core leaves its torch norms in fp32: every part in the training precision, as the
        # trainer casts them
        self.stage = EncoderStage(config, 0, 1, dist.new_group([0]), params_dtype=dtype).to(
            self.device, dtype
        )
        self.ops = build_stage_ops(self.stage.blocks(), config.training.recompute)
        t = config.training
        self.inputs = {
            e.name: torch.randn(
                t.micro_batch_size,
                e.seq_length,
                e.in_channels * e.patch_size**2,
                device=self.device,
                dtype=dtype,
            )
            for e in config.encoders
        }
        self.grads = {
            e.name: torch.randn(
                e.seq_length,
                t.micro_batch_size,
                config.llm.hidden_size,
                device=self.device,
                dtype=dtype,
            )
            * 1e-3
            for e in config.encoders
        }

    def new_run(self, backward_runs: list[range] | None = None) -> Any:
        return MicrobatchRun(self.ops, self.inputs, seed=0, backward_runs=backward_runs or [])

    def run_ops(self, one_hook_point: bool = True) -> None:
        """One microbatch's forward and backward as the executor runs its ops placed at one hook
        point (the backward one run: one autograd call), or each at a hook point of its own."""
        everything = range(len(self.ops.bwd))
        run = self.new_run([everything] if one_hook_point else [])
        for k in range(len(self.ops.fwd)):
            run.run_forward(k)
        run.set_output_grad(self.grads)
        if one_hook_point:
            run.run_backward_range(everything)
            return
        for k in everything:
            run.run_backward(k)

    def run_autograd(self) -> None:
        out = self.stage(self.inputs, 0)  # the seed of new_run
        torch.autograd.backward([out[n] for n in self.grads], [self.grads[n] for n in self.grads])

    def zero_grad(self) -> None:
        self.stage.zero_grad(set_to_none=True)

    def grads_of(self, fn: Callable[[], None]) -> list[Tensor]:
        self.zero_grad()
        fn()
        return [p.grad.float().clone() for p in self.stage.parameters() if p.grad is not None]


def measure_kernel_level(encoder: Encoder, repeats: int = 10) -> dict[str, Any]:
    """1. The runtime's kernel-level ops vs plain autograd, same encoder, same microbatch."""
    ops_ms = gpu_ms(encoder.run_ops, repeats, before=encoder.zero_grad)
    apart_ms = gpu_ms(partial(encoder.run_ops, False), repeats, before=encoder.zero_grad)
    autograd_ms = gpu_ms(encoder.run_autograd, repeats, before=encoder.zero_grad)
    reference = encoder.grads_of(encoder.run_autograd)
    ours = encoder.grads_of(encoder.run_ops)
    error = max(
        float((a - b).abs().max() / b.abs().max().clamp_min(1e-12)) for a, b in zip(ours, reference)
    )
    return {
        "ops": len(encoder.ops.fwd) + len(encoder.ops.bwd),
        "ops_ms": ops_ms,  # at one hook point, as a one-GPU schedule places them
        "op_per_hook_point_ms": apart_ms,
        "autograd_ms": autograd_ms,
        "ratio": ops_ms / autograd_ms,
        "op_per_hook_point_ratio": apart_ms / autograd_ms,
        "grad_max_rel_diff": error,
    }


# -- 2. overlap --------------------------------------------------------------------------------


def comm_window(clock: SleepClock, ms: float) -> tuple[str, Callable[[], None]]:
    """The LLM's communication-like window on the main stream: a real collective over every visible
    GPU where there are several, else a GPU sleep of ``ms``."""
    count = torch.cuda.device_count()
    if count > 1:
        import torch.cuda.nccl as nccl

        buffers = [
            torch.empty(64 << 20, dtype=torch.bfloat16, device=f"cuda:{i}") for i in range(count)
        ]
        if nccl.is_available(buffers):
            return (
                f"NCCL all-reduce of 128 MiB over {count} GPUs (torch.cuda.nccl)",
                lambda: nccl.all_reduce(buffers),
            )
    return f"torch.cuda._sleep of {ms:.2f} ms (one GPU: no collective)", lambda: clock.sleep(ms)


def measure_overlap(encoder: Encoder, clock: SleepClock, repeats: int = 5) -> dict[str, Any]:
    """2. Encoder ops on the side stream launched at the start of a main-stream window."""
    stream = SideStream(encoder.device)
    started = time.perf_counter()
    with stream.launch():
        encoder.run_ops()
    launch_ms = (time.perf_counter() - started) * 1e3
    stream.finish()
    torch.cuda.synchronize()
    # the GPU stays busy while the host enqueues: both sides start together
    gate_ms = 2 * launch_ms + 2

    def spanned(main: Callable[[], None] | None, side: bool) -> float:
        def body() -> None:
            if side:
                with stream.launch():  # the hook point
                    encoder.run_ops()
            if main is not None:
                main()
            stream.finish()

        return gpu_ms(body, repeats, before=lambda: (encoder.zero_grad(), clock.sleep(gate_ms)))

    encoder_ms = spanned(None, True)
    name, window = comm_window(clock, 1.5 * encoder_ms)
    window_ms = spanned(window, False)
    both_ms = spanned(window, True)
    hidden = (encoder_ms + window_ms - both_ms) / encoder_ms
    gemm_ms, gemm_with_ms = _gemm_slowdown(encoder, stream, clock, encoder_ms, gate_ms, repeats)
    return {
        "window": name,
        "encoder_ms": encoder_ms,
        "window_ms": window_ms,
        "both_ms": both_ms,
        "hidden_share": min(max(hidden, 0.0), 1.0),
        "host_launch_ms": launch_ms,
        "gemm_alone_ms": gemm_ms,
        "gemm_with_encoder_ms": gemm_with_ms,
        "gemm_slowdown": gemm_with_ms / gemm_ms - 1,
    }


def _gemm_slowdown(
    encoder: Encoder,
    stream: Any,
    clock: SleepClock,
    encoder_ms: float,
    gate_ms: float,
    repeats: int,
) -> tuple[float, float]:
    """LLM fc1-shaped GEMMs on the main stream for about the encoder ops' time, alone and alongside
    them."""
    llm, t = encoder.config.llm, encoder.config.training
    x = torch.randn(
        t.micro_batch_size * llm.seq_length,
        llm.hidden_size,
        device=encoder.device,
        dtype=encoder.dtype,
    )
    w = torch.randn(
        llm.ffn_hidden_size, llm.hidden_size, device=encoder.device, dtype=encoder.dtype
    )
    one = gpu_ms(lambda: torch.nn.functional.linear(x, w), repeats)
    n = max(1, round(encoder_ms / one))

    def gemms() -> None:
        for _ in range(n):
            torch.nn.functional.linear(x, w)

    alone = gpu_ms(gemms, repeats)
    times = []
    for _ in range(repeats):
        encoder.zero_grad()
        clock.sleep(gate_ms)
        with stream.launch():
            encoder.run_ops()
        times.append(gpu_ms(gemms, 1, warmup=0))  # the main stream's GEMMs only, side stream busy
        stream.finish()
        torch.cuda.synchronize()
    return alone, statistics.median(times)


# -- 3. one bubble -------------------------------------------------------------------------------


def measure_bubble(
    encoder: Encoder, artifact: ScheduleArtifact, repeats: int = 3
) -> dict[str, Any]:
    """3. The encoder ops at the artifact's heaviest hook point: roofline and profile predictions vs
    measured."""
    config = encoder.config
    ops = build_hook_plan(artifact).for_gpu(0).ops
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "profile.json"
        write_profile(
            profile_kernels(config, device=encoder.device.type, dtype=encoder.dtype), path
        )
        profile = load_profile(path)
    roofline = _op_costs(encoder, artifact, CostModel.from_config(config))
    profiled = _op_costs(encoder, artifact, CostModel(config.cluster, config.cost_model, profile))
    events = {op.event for op in ops}

    def share(
        costs: dict[tuple[str, int], float], op: Any
    ) -> float:  # a piece: its share of the kernel
        return costs[(op.phase, op.kernel_index)] * (op.piece[1] - op.piece[0])

    event = max(events, key=lambda e: sum(share(roofline, op) for op in ops if op.event == e))
    group = [op for op in ops if op.event == event]
    measured = statistics.median(_time_group(encoder, group) for _ in range(repeats))
    predicted = sum(share(roofline, op) for op in group) / 1e3
    predicted_profile = sum(share(profiled, op) for op in group) / 1e3
    tp = artifact.encoder_plan.tp
    covered = sum(1 for op in group if (op.encoder, op.kernel, op.phase, tp) in profile)
    return {
        "event": [event.kind.value, event.op, event.collective],
        "ops": len(group),
        "microbatches": len({op.local_microbatch for op in group}),
        "measured_ms": measured,
        "roofline_ms": predicted,
        "profile_ms": predicted_profile,
        "roofline_error": predicted / measured - 1,
        "profile_error": predicted_profile / measured - 1,
        "ops_in_profile": covered,
    }


def _op_costs(
    encoder: Encoder, artifact: ScheduleArtifact, cost: Any
) -> dict[tuple[str, int], float]:
    """Predicted µs per (phase, op index) of the stage chain; checks that the chains match the
    runtime's ops."""
    work = build_encoder_work(
        encoder.config,
        artifact.llm_plan,
        artifact.encoder_plan,
        cost,
    )
    costs = {}
    for phase, chain in (("fwd", work.fwd[0]), ("bwd", work.bwd[0])):
        names = [(k.encoder, k.layer, k.name, k.splittable) for k in chain.kernels]
        if names != encoder.ops.chain(phase):
            raise OptimusError(f"the cost model's {phase} chain differs from the runtime's ops")
        costs.update({(phase, i): k.duration_us for i, k in enumerate(chain.kernels)})
    return costs


def _time_group(encoder: Encoder, group: list) -> float:
    """Bring each microbatch to just before its first op in ``group`` (untimed), then time the
    group, batched as the executor runs it (``op_batches``)."""
    batches = op_batches(group)
    runs: dict[int, Any] = {}
    for op in group:
        if op.local_microbatch in runs:
            continue
        declared = [
            b.kernels
            for b in batches
            if (b.phase, b.local_microbatch) == ("bwd", op.local_microbatch) and len(b.kernels) > 1
        ]
        run = runs[op.local_microbatch] = encoder.new_run(declared)
        forward_until = op.kernel_index if op.phase == "fwd" else len(encoder.ops.fwd)
        for k in range(forward_until):
            run.run_forward(k)
        if op.phase == "bwd":
            run.set_output_grad(encoder.grads)
            for k in range(op.kernel_index):
                run.run_backward(k)
        if op.piece[0] > 0:  # the kernel's earlier pieces
            (run.run_forward if op.phase == "fwd" else run.run_backward)(
                op.kernel_index, (0.0, op.piece[0])
            )

    def body() -> None:
        for batch in batches:
            run = runs[batch.local_microbatch]
            if batch.phase == "fwd":
                for k in batch.kernels:
                    run.run_forward(k, batch.piece)
            elif batch.piece == WHOLE:
                run.run_backward_range(batch.kernels)
            else:
                run.run_backward(batch.kernels.start, batch.piece)

    encoder.zero_grad()
    torch.cuda.synchronize()
    return gpu_ms(body, repeats=1, warmup=0)


# -- 4. training step ------------------------------------------------------------------------------


def measure_training(
    config: OptimusConfig, peak_tflops: float, steps: int, warmup: int = 2
) -> dict[str, Any]:
    """4. Step time and MFU of the Optimus runtime and the Megatron-style baseline on this GPU, each
    trained in a process of its own, so that its memory is all returned before the next is built."""
    flops = model_flops_per_iteration(config)
    result: dict[str, Any] = {"model_tflops_per_step": flops / 1e12, "peak_tflops": peak_tflops}
    for mode in MODES:
        measured = train_in_subprocess(config, mode, steps, warmup)
        result[mode] = {**measured, "mfu": flops / measured["step_s"] / (peak_tflops * 1e12)}
    result["optimus_slowdown"] = result["optimus"]["step_s"] / result["baseline"]["step_s"] - 1
    return result


def train_in_subprocess(
    config: OptimusConfig, mode: str, steps: int, warmup: int
) -> dict[str, Any]:
    """``train_one_mode`` in a new process (this script with ``--train-mode``); its output goes to
    this process's."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / f"{mode}.json"
        command = [
            sys.executable,
            str(Path(__file__).resolve()),
            *("--config", str(config.source), "--train-mode", mode),
            *("--steps", str(steps), "--warmup", str(warmup), "--json", str(out)),
        ]
        returncode = subprocess.run(command, check=False).returncode
        if returncode != 0:
            raise OptimusError(
                f"the {mode} training step failed in its process (exit {returncode}); its output "
                "is above"
            )
        return json.loads(out.read_text())


def train_one_mode(
    config: OptimusConfig,
    mode: str,
    steps: int,
    warmup: int,
    profile_rows: int = 0,
    trace: str | None = None,
) -> dict[str, Any]:
    """Train ``warmup`` then ``steps`` timed steps of ``mode`` in this process, then (with
    ``profile_rows``) one more step under torch.profiler, whose tables it prints and whose timeline
    goes to ``trace`` if given."""
    planned = plan(config)
    artifact = schedule_job_artifact(config, planned) if mode == "optimus" else None
    trainer = Trainer(config, planned.llm_plan, mode, artifact)
    try:
        # a step ends with the loss on the host
        losses = [trainer.train_step(i).loss for i in range(warmup)]
        _synchronize()
        started = time.perf_counter()
        losses += [trainer.train_step(warmup + i).loss for i in range(steps)]
        step_s = (time.perf_counter() - started) / steps
        if profile_rows:  # untimed: the profiler slows the host
            print(f"{mode}: one training step under torch.profiler")
            step = partial(trainer.train_step, warmup + steps)
            print(profile_table(step, profile_rows, trace))
    finally:
        trainer.close()
    return {"step_s": step_s, "losses": losses, "process": os.getpid()}


def profile_table(fn: Callable[[], object], rows: int, trace: str | None = None) -> str:
    """``fn`` under torch.profiler: its top ``rows`` ops by host time, and by GPU time on a GPU --
    where a mode's step time goes, host launch overhead included; its timeline to ``trace``
    (gzipped if the name ends in .gz) if given."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as profiler:
        started = time.perf_counter()
        fn()
        _synchronize()
        wall_ms = (time.perf_counter() - started) * 1e3
    if trace:
        write_trace(profiler, trace)
    averages = profiler.key_averages()
    # the host time outside every op (Python, the executor's bookkeeping) is wall minus the ops'
    tables = [
        f"wall {wall_ms:.1f} ms (profiled)",
        averages.table(sort_by="self_cpu_time_total", row_limit=rows),
    ]
    if torch.cuda.is_available():
        tables.append(averages.table(sort_by="self_cuda_time_total", row_limit=rows))
    return "\n".join(tables)


def write_trace(profiler: Any, path: str) -> None:
    """The profiled step's Chrome trace at ``path``, gzipped when it ends in .gz, written whole or
    not at all."""
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "trace.json"
        profiler.export_chrome_trace(str(raw))
        data = raw.read_bytes()
    atomic_write_bytes(path, gzip.compress(data) if path.endswith(".gz") else data)


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def memory_problem(config: OptimusConfig, planned: PlannerResult, free_bytes: int) -> str | None:
    """The memory model's figure for one training step beside the GPU's free memory: a sentence
    when it does not fit, else None. Both modes hold the same weights and states on this one GPU,
    each in its own process; the figure is the fullest encoder plan's (LLM and encoder
    colocated)."""
    need = max(candidate.memory.total for candidate in planned.candidates)
    if need <= free_bytes:
        return None
    return (
        f"{config.source}: the memory model puts a training step at {need / GIB:.1f} GiB, but the "
        f"GPU has {free_bytes / GIB:.1f} GiB free; shrink the model or the micro batch in the "
        "config"
    )


# -- the run -------------------------------------------------------------------------------------


def environment(config: OptimusConfig, peak_tflops: float) -> dict[str, Any]:
    return {
        "gpu": torch.cuda.get_device_name(),
        "gpus_visible": torch.cuda.device_count(),
        "torch": torch.__version__,
        "megatron_core": _version("megatron-core", "megatron_core"),
        "transformer_engine": _version("transformer-engine", "transformer_engine"),
        "config": config.source,
        "peak_tflops": peak_tflops,
        "command": shlex.join([sys.executable, *sys.argv]),
    }


def _version(*names: str) -> str:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "not installed"


def _init_world_of_one() -> None:
    """A torch.distributed world of this one process (NCCL; gloo without a GPU): megatron-core and
    the encoder need groups."""
    import torch.distributed as dist

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    backend = "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
        backend = "nccl"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def run(config: OptimusConfig, peak_tflops: float, steps: int, warmup: int) -> dict[str, Any]:
    planned = plan(config)
    problem = memory_problem(config, planned, torch.cuda.mem_get_info()[0])
    if problem:
        raise OptimusError(problem)
    artifact = schedule_job_artifact(config, planned)
    results: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "environment": environment(config, peak_tflops),
        "targets": TARGETS,
    }
    encoder = Encoder(config, DTYPES[config.training.precision])
    clock = SleepClock()
    results["kernel_level"] = measure_kernel_level(encoder)
    results["overlap"] = measure_overlap(encoder, clock)
    results["bubble"] = measure_bubble(encoder, artifact)
    del encoder
    torch.cuda.empty_cache()
    results["training"] = measure_training(config, peak_tflops, steps, warmup)
    return results


def table(results: dict[str, Any]) -> str:
    env, k, o, b, t = (
        results[n] for n in ("environment", "kernel_level", "overlap", "bubble", "training")
    )
    rows = [
        (
            "1 kernel-level ops / plain autograd",
            f"{k['ratio']:.3f} ({k['ops_ms']:.2f} / {k['autograd_ms']:.2f} ms, "
            f"{k['ops']} ops, grad diff {k['grad_max_rel_diff']:.1e})",
            f"<= {TARGETS['kernel_level_ratio']}",
            k["ratio"] <= TARGETS["kernel_level_ratio"],
        ),
        (
            "  an op per hook point",
            f"{k['op_per_hook_point_ratio']:.3f} ({k['op_per_hook_point_ms']:.2f} ms)",
            "",
            None,
        ),
        (
            "2 encoder time hidden in window",
            f"{o['hidden_share']:.1%} (encoder {o['encoder_ms']:.2f} ms, window "
            f"{o['window_ms']:.2f} ms, both {o['both_ms']:.2f} ms)",
            f">= {TARGETS['hidden_share']:.0%}",
            o["hidden_share"] >= TARGETS["hidden_share"],
        ),
        ("  window", o["window"], "", None),
        (
            "  LLM GEMM slowdown alongside",
            f"{o['gemm_slowdown']:+.1%} ({o['gemm_alone_ms']:.2f} -> "
            f"{o['gemm_with_encoder_ms']:.2f} ms)",
            "",
            None,
        ),
        (
            f"3 one bubble ({b['ops']} ops at {tuple(b['event'])})",
            f"measured {b['measured_ms']:.2f} ms",
            "",
            None,
        ),
        (
            "  roofline prediction",
            f"{b['roofline_ms']:.2f} ms ({b['roofline_error']:+.1%})",
            "",
            None,
        ),
        (
            "  profile prediction",
            f"{b['profile_ms']:.2f} ms ({b['profile_error']:+.1%}; "
            f"{b['ops_in_profile']}/{b['ops']} ops profiled)",
            f"within {TARGETS['profile_error']:.0%}",
            abs(b["profile_error"]) <= TARGETS["profile_error"],
        ),
    ]
    for mode in ("baseline", "optimus"):
        m = t[mode]
        rows.append(
            (
                f"4 training step, {mode}",
                f"{m['step_s'] * 1e3:.1f} ms, MFU {m['mfu']:.1%}",
                f">= {TARGETS['mfu']:.0%}",
                m["mfu"] >= TARGETS["mfu"],
            )
        )
    rows.append(
        (
            "  Optimus vs baseline",
            f"{t['optimus_slowdown']:+.2%}",
            f"<= +{TARGETS['optimus_slowdown']:.0%}",
            t["optimus_slowdown"] <= TARGETS["optimus_slowdown"],
        )
    )
    header = [
        f"bench_gpu: {env['gpu']} | torch {env['torch']} | megatron-core {env['megatron_core']} | "
        f"transformer-engine {env['transformer_engine']} | "
        f"peak {env['peak_tflops']:g} TFLOP/s bf16",
        f"command: {env['command']}",
        "",
    ]
    width = max(len(r[0]) for r in rows)
    lines = [f"{'measurement':<{width}}  {'result':<70}  {'target':<11}  ok"]
    for name, value, target, ok in rows:
        lines.append(
            f"{name:<{width}}  {value:<70}  {target:<11}  "
            f"{'' if ok is None else ('yes' if ok else 'NO')}"
        )
    return "\n".join(header + lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.trace and not (args.train_mode and args.profile_rows):
        print(
            f"{PROG}: error: --trace writes the step --train-mode profiles; give --train-mode MODE "
            "--profile-rows N with it",
            file=sys.stderr,
        )
        return 2
    if args.train_mode:
        return _train_mode_main(args)
    if not torch.cuda.is_available():
        print(
            f"{PROG}: error: no CUDA GPU is visible; run it on a machine with an NVIDIA GPU "
            "(nothing is measured or printed without one)",
            file=sys.stderr,
        )
        return 2
    warn_unverified("benchmarks/bench_gpu.py")
    try:
        config = load_config(args.config)
        if config.cluster.num_gpus != 1:
            raise OptimusError(
                f"{args.config}: cluster.num_gpus is {config.cluster.num_gpus}; this benchmark "
                "trains on one GPU (see configs/gpu_single.yaml)"
            )
        _init_world_of_one()
        results = run(
            config, args.peak_tflops or config.cluster.peak_tflops, args.steps, args.warmup
        )
    except OptimusError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    print(table(results))
    if args.json:
        atomic_write_text(args.json, json.dumps(results, indent=2) + "\n")
    return 0


def _train_mode_main(args: argparse.Namespace) -> int:
    """``--train-mode``: one mode's training step, in this process, its results to ``--json``."""
    if not args.json:
        print(
            f"{PROG}: error: --train-mode writes its results to --json OUT; give one",
            file=sys.stderr,
        )
        return 2
    try:
        config = load_config(args.config)
        _init_world_of_one()
        results = train_one_mode(
            config, args.train_mode, args.steps, args.warmup, args.profile_rows, args.trace
        )
    except OptimusError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    atomic_write_text(args.json, json.dumps(results) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
