"""Host cost of the encoder's kernel-level ops, on the CPU: one microbatch through the executor.

    python benchmarks/bench_host_cost.py [--config configs/tiny.yaml] [--num-layers N] [--repeats N]
        [--json OUT]

The config's encoders as one stage (DP1 PP1 TP1, one process, gloo) run one microbatch's forward and
backward through ``EncoderExecutor.on_event``, as training runs them, under three placements of its
ops at hook points:
- ``per op``: every op at a hook point of its own (the finest a schedule cuts);
- ``per layer``: each block's (a layer's, the patch embedding's, the projector's) forward ops at one
  hook point and its backward ops at another;
- ``per microbatch``: the forward at ``pre``, the backward at ``post`` (the coarse placement, what a
  one-GPU schedule gives);
and against them the same stage under plain autograd (``EncoderStage.forward`` then one
``torch.autograd.backward``). At tiny shapes the kernels take next to nothing, so the time is the
host's: the Python and autograd-engine work per op that the GPU run of ``bench_gpu.py`` found
dominant. Per placement: the thread's median CPU time over ``--repeats`` rounds (one thread, the
rows interleaved, so that other processes' load on a shared machine stays out), its ratio to
autograd, the autograd-engine calls (``torch.autograd.backward`` / ``torch.autograd.grad``), the
aten ops dispatched, and the largest parameter-gradient difference from autograd. CPU numbers, not
GPU ones.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml
from torch.utils._python_dispatch import TorchDispatchMode

from optimus_mllm.config import OptimusConfig, config_from_dict
from optimus_mllm.config.files import atomic_write_text
from optimus_mllm.planner import plan
from optimus_mllm.runtime.dropout import microbatch_seed
from optimus_mllm.runtime.executor import EncoderExecutor, Mailbox
from optimus_mllm.runtime.hook_plan import Event, EventKind, PlannedOp, StageHookPlan
from optimus_mllm.runtime.microbatches import MicrobatchNumbering
from optimus_mllm.runtime.optimus_encoder import OptimusEncoder
from optimus_mllm.scheduler.artifact import schedule_job_artifact

REPO = Path(__file__).resolve().parent.parent
FORMAT, VERSION = "optimus-bench-host-cost", 1
ITERATION = 0
Tensor = torch.Tensor


def one_process(path: str, num_layers: int | None) -> OptimusConfig:
    """The config at ``path`` on one process: DP1 PP1 TP1 for the LLM and the encoders, one
    microbatch; ``num_layers`` layers in every encoder where given."""
    raw = yaml.safe_load(Path(path).read_text())
    if num_layers is not None:
        for encoder in raw["model"]["encoders"]:
            encoder["num_layers"] = num_layers
    raw["cluster"].update(num_gpus=1, gpus_per_node=1)
    raw["parallel"] = {"llm": {"dp": 1, "pp": 1, "tp": 1, "vp": 1}, "encoder": {"pp": 1, "tp": 1}}
    raw["training"]["global_batch_size"] = raw["training"]["micro_batch_size"]
    return config_from_dict(raw)


@dataclass(frozen=True)
class Placement:
    """One microbatch's ops at hook points: the hook points in order, the first backward one."""

    name: str
    stage_plan: StageHookPlan
    events: tuple[Event, ...]
    first_backward: int  # index in ``events``


@dataclass
class Bench:
    """The one-stage encoder of a one-process job, its schedule's ops, one microbatch's data."""

    config: OptimusConfig
    optimus: OptimusEncoder
    images: tuple[Tensor, ...]
    output_grad: Tensor

    @classmethod
    def build(cls, config: OptimusConfig) -> Bench:
        artifact = schedule_job_artifact(config, plan(config))
        numbering = MicrobatchNumbering.of_artifact(artifact, 1, 0)
        optimus = OptimusEncoder.build(
            config, artifact.llm_plan, artifact, numbering, 0, torch.device("cpu")
        )
        gen = torch.Generator().manual_seed(0)
        b = config.training.micro_batch_size
        images = tuple(
            torch.randn(b, e.seq_length, e.in_channels * e.patch_size**2, generator=gen)
            for e in config.encoders
        )
        grad = torch.randn(config.image_tokens, b, config.llm.hidden_size, generator=gen)
        return cls(config, optimus, images, grad)

    @property
    def stage(self) -> torch.nn.Module:
        return self.optimus.encoder

    def placement(self, name: str) -> Placement:
        """The schedule's ops of microbatch 0 at hook points: one per op, per block (forward and
        backward apart), or per phase (pre / post)."""
        ops = [op for op in self.optimus.stage_plan.ops if op.local_microbatch == 0]
        placed: list[PlannedOp] = []
        for op in ops:
            last = placed[-1] if placed else None
            together = last is not None and (
                name == "per microbatch"
                and last.phase == op.phase
                or name == "per layer"
                and (last.phase, last.encoder, last.layer) == (op.phase, op.encoder, op.layer)
            )
            at = last.event if together else Event(EventKind.OP_START, len(placed))
            placed.append(replace(op, assigned=at, event=at))
        events = tuple(dict.fromkeys(op.event for op in placed))
        first_backward = next(op.event for op in placed if op.phase == "bwd")
        return Placement(
            name,
            replace(self.optimus.stage_plan, ops=tuple(placed)),
            events,
            events.index(first_backward),
        )

    def new_executor(self, placement: Placement) -> EncoderExecutor:
        """What a training step builds once for all its microbatches: not timed."""
        return EncoderExecutor(
            self.config,
            placement.stage_plan,
            self.optimus.ops,
            self.optimus.groups,
            self.optimus.numbering,
            1,
            ITERATION,
            Mailbox(),
            lambda iteration, microbatch: self.images,
            self.optimus.messenger,
        )

    def run_executor(self, placement: Placement, executor: EncoderExecutor) -> None:
        """One microbatch, its hook points in order; A_i taken and G_i handed back in between."""
        for n, event in enumerate(placement.events):
            if n == placement.first_backward:
                executor.mailbox.take_embeddings((0, 0))
                executor.mailbox.gradients[(0, 0)] = self.output_grad
            executor.on_event(event, event)
        executor.finish()

    def run_autograd(self) -> None:
        seed = microbatch_seed(self.config.training.seed, ITERATION, 0)
        inputs = {e.name: x for e, x in zip(self.config.encoders, self.images)}
        outputs = self.stage(inputs, seed)
        embeddings = torch.cat([outputs[e.name] for e in self.config.encoders], dim=0)
        torch.autograd.backward([embeddings], [self.output_grad])

    def grads_of(self, fn: Callable[[], object]) -> list[Tensor | None]:
        self.stage.zero_grad(set_to_none=True)
        fn()
        return [None if p.grad is None else p.grad.clone() for p in self.stage.parameters()]


class _CountAten(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.count += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def counted_engine_calls() -> Iterator[list[int]]:
    """Counts ``torch.autograd.backward`` and ``torch.autograd.grad`` calls while open."""
    count = [0]
    originals = torch.autograd.backward, torch.autograd.grad

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            count[0] += 1
            return fn(*args, **kwargs)

        return counted

    torch.autograd.backward, torch.autograd.grad = (wrap(fn) for fn in originals)
    try:
        yield count
    finally:
        torch.autograd.backward, torch.autograd.grad = originals


def median_cpu_ms(
    cases: list[tuple[Callable[[], Any], Callable[[Any], object]]],
    before: Callable[[], object],
    repeats: int,
) -> list[float]:
    """Per case (prepare, run), the median CPU time of the thread in ``run(prepare())`` over
    ``repeats`` rounds, each round running every case once in turn (three untimed rounds first): on
    a shared machine, CPU time and interleaving keep other processes' load out of the comparison."""
    times: list[list[float]] = [[] for _ in cases]
    for round_ in range(repeats + 3):
        for (prepare, run), kept in zip(cases, times):
            before()
            prepared = prepare()
            started = time.thread_time()
            run(prepared)
            if round_ >= 3:
                kept.append(time.thread_time() - started)
    return [statistics.median(kept) * 1e3 for kept in times]


def max_difference(ours: list[Tensor | None], reference: list[Tensor | None]) -> float:
    if [g is None for g in ours] != [g is None for g in reference]:
        return float("inf")
    return max(
        (float((a - b).abs().max()) for a, b in zip(ours, reference) if a is not None),
        default=0.0,
    )


def measure(bench: Bench, repeats: int) -> list[dict[str, Any]]:
    zero = lambda: bench.stage.zero_grad(set_to_none=True)  # noqa: E731
    reference = bench.grads_of(bench.run_autograd)
    rows: list[dict[str, Any]] = []
    cases: list[tuple[Callable[[], Any], Callable[[Any], object]]] = [
        (lambda: None, lambda _: bench.run_autograd())
    ]
    with counted_engine_calls() as engine, _CountAten() as aten:
        grads = bench.grads_of(bench.run_autograd)
    rows.append(
        {
            "placement": "autograd",
            "hook_points": 1,
            "ops": 0,
            "engine_calls": engine[0],
            "aten_ops": aten.count,
            "grad_max_abs_diff": max_difference(grads, reference),
        }
    )
    for name in ("per op", "per layer", "per microbatch"):
        placement = bench.placement(name)
        case = (
            lambda p=placement: bench.new_executor(p),
            lambda executor, p=placement: bench.run_executor(p, executor),
        )
        cases.append(case)
        executor = bench.new_executor(placement)
        with counted_engine_calls() as engine, _CountAten() as aten:
            grads = bench.grads_of(partial(bench.run_executor, placement, executor))
        rows.append(
            {
                "placement": name,
                "hook_points": len(placement.events),
                "ops": len(executor.record),
                "engine_calls": engine[0],
                "aten_ops": aten.count,
                "grad_max_abs_diff": max_difference(grads, reference),
            }
        )
    times = median_cpu_ms(cases, zero, repeats)
    for row, ms in zip(rows, times):
        row["cpu_ms"], row["ratio"] = ms, ms / times[0]
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        f"{'placement':<15} {'hook pts':>8} {'ops':>5} {'engine calls':>12} {'aten ops':>9} "
        f"{'CPU ms':>8} {'x autograd':>10} {'grad diff':>10}"
    )
    for r in rows:
        print(
            f"{r['placement']:<15} {r['hook_points']:>8} {r['ops']:>5} {r['engine_calls']:>12} "
            f"{r['aten_ops']:>9} {r['cpu_ms']:>8.2f} {r['ratio']:>10.2f} "
            f"{r['grad_max_abs_diff']:>10.1e}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "tiny.yaml"))
    parser.add_argument(
        "--num-layers", type=int, metavar="N", help="layers per encoder (default: the config's)"
    )
    parser.add_argument("--repeats", type=int, default=50, help="timed runs per row (default 50)")
    parser.add_argument("--json", metavar="OUT", help="also write the rows here as JSON")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats: give at least 1")
    torch.set_num_threads(1)
    config = one_process(args.config, args.num_layers)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        bench = Bench.build(config)
        encoders = ", ".join(
            f"{e.name} ({e.num_layers} layers, hidden {e.hidden_size})" for e in config.encoders
        )
        print(
            f"{config.name}: {encoders}, micro batch {config.training.micro_batch_size}; "
            f"torch {torch.__version__}, CPU, 1 thread, median of {args.repeats} interleaved rounds"
        )
        rows = measure(bench, args.repeats)
    finally:
        dist.destroy_process_group()
    print_table(rows)
    if args.json:
        atomic_write_text(
            Path(args.json),
            json.dumps({"format": FORMAT, "version": VERSION, "rows": rows}, indent=2) + "\n",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
