"""The encoder ops' host cost: backward ops that run together at one hook point make one autograd
call, not one per step (``MicrobatchRun``'s groups, ``EncoderExecutor``'s batches), with the
gradients of plain autograd and every op still in the execution record at its hook point."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

import pytest
import torch
import torch.distributed as dist
import yaml

from optimus_mllm.config import OptimusConfig, config_from_dict
from optimus_mllm.planner import plan
from optimus_mllm.runtime.dropout import microbatch_seed
from optimus_mllm.runtime.encoder_ops import MicrobatchRun, StageOps
from optimus_mllm.runtime.executor import EncoderExecutor, Mailbox
from optimus_mllm.runtime.hook_plan import POST, PRE, Event, EventKind, StageHookPlan
from optimus_mllm.runtime.microbatches import MicrobatchNumbering
from optimus_mllm.runtime.optimus_encoder import OptimusEncoder
from optimus_mllm.scheduler.artifact import schedule_job_artifact

from support.paths import CONFIGS, load_script

Tensor = torch.Tensor


@dataclass
class OneStage:
    """A one-process job's encoder stage (tiny's ViT, DP1 PP1 TP1), one microbatch's data."""

    config: OptimusConfig
    optimus: OptimusEncoder
    images: tuple[Tensor, ...]
    output_grad: Tensor

    @property
    def ops(self) -> StageOps:
        return self.optimus.ops

    def autograd_grads(self) -> list[Tensor | None]:
        self.optimus.encoder.zero_grad(set_to_none=True)
        seed = microbatch_seed(self.config.training.seed, 0, 0)
        inputs = {e.name: x for e, x in zip(self.config.encoders, self.images)}
        out = self.optimus.encoder(inputs, seed)[self.config.encoders[0].name]
        torch.autograd.backward([out], [self.output_grad])
        return self.grads()

    def grads(self) -> list[Tensor | None]:
        return [p.grad for p in self.optimus.encoder.parameters()]


def _one_process_config() -> OptimusConfig:
    """tiny.yaml on one process, one microbatch a step."""
    raw = yaml.safe_load((CONFIGS / "tiny.yaml").read_text())
    raw["cluster"].update(num_gpus=1, gpus_per_node=1)
    raw["parallel"] = {"llm": {"dp": 1, "pp": 1, "tp": 1, "vp": 1}, "encoder": {"pp": 1, "tp": 1}}
    raw["training"]["global_batch_size"] = raw["training"]["micro_batch_size"]
    return config_from_dict(raw)


@pytest.fixture(scope="module")
def one_stage() -> Iterator[OneStage]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        config = _one_process_config()
        artifact = schedule_job_artifact(config, plan(config))
        numbering = MicrobatchNumbering.of_artifact(artifact, 1, 0)
        optimus = OptimusEncoder.build(
            config, artifact.llm_plan, artifact, numbering, 0, torch.device("cpu")
        )
        gen = torch.Generator().manual_seed(0)
        b, e = config.training.micro_batch_size, config.encoders[0]
        images = (torch.randn(b, e.seq_length, e.in_channels * e.patch_size**2, generator=gen),)
        grad = torch.randn(config.image_tokens, b, config.llm.hidden_size, generator=gen)
        yield OneStage(config, optimus, images, grad)
    finally:
        dist.destroy_process_group()


@pytest.fixture
def engine_calls() -> Iterator[list[int]]:
    """Counts calls into the autograd engine (``torch.autograd.backward`` and ``grad``), as the
    benchmark does."""
    with load_script("bench_host_cost").counted_engine_calls() as count:
        yield count


def _per_step_calls(ops: StageOps) -> int:
    """What one autograd call per backward step makes: every differentiated step but the
    collectives (none at TP1)."""
    return sum(b.differentiated and not b.step.is_collective for b in ops.steps)


def _run(stage: OneStage, backward_runs: list[range]) -> MicrobatchRun:
    stage.optimus.encoder.zero_grad(set_to_none=True)
    run = MicrobatchRun(
        stage.ops,
        {stage.config.encoders[0].name: stage.images[0]},
        microbatch_seed(stage.config.training.seed, 0, 0),
        backward_runs,
    )
    for k in range(len(stage.ops.fwd)):
        run.run_forward(k)
    run.set_output_grad({stage.config.encoders[0].name: stage.output_grad})
    at = {k: r for r in backward_runs for k in r}
    k = 0
    while k < len(stage.ops.bwd):
        ks = at.get(k, range(k, k + 1))
        run.run_backward_range(ks)
        k = ks.stop
    return run


def test_a_run_of_backward_ops_is_one_autograd_call(
    one_stage: OneStage, engine_calls: list[int]
) -> None:
    reference = [g.clone() for g in one_stage.autograd_grads()]
    engine_calls[0] = 0
    _run(one_stage, [range(len(one_stage.ops.bwd))])
    assert engine_calls[0] == 1 < _per_step_calls(one_stage.ops)
    assert all(torch.equal(a, b) for a, b in zip(one_stage.grads(), reference))

    engine_calls[0] = 0
    _run(one_stage, [])  # every op at a hook point of its own: one call per op, not per step
    assert engine_calls[0] == len(one_stage.ops.bwd) < _per_step_calls(one_stage.ops)
    assert all(torch.equal(a, b) for a, b in zip(one_stage.grads(), reference))


def test_ops_of_a_declared_run_do_not_run_alone(one_stage: OneStage) -> None:
    run = MicrobatchRun(
        one_stage.ops, {one_stage.config.encoders[0].name: one_stage.images[0]}, 0, [range(0, 3)]
    )
    for k in range(len(one_stage.ops.fwd)):
        run.run_forward(k)
    run.set_output_grad({one_stage.config.encoders[0].name: one_stage.output_grad})
    with pytest.raises(ValueError, match="declared to run with ops 0..2"):
        run.run_backward(0)
    with pytest.raises(ValueError, match="not declared a run"):
        run.run_backward_range(range(0, 2))


def _executor(stage: OneStage, stage_plan: StageHookPlan) -> EncoderExecutor:
    return EncoderExecutor(
        stage.config,
        stage_plan,
        stage.ops,
        stage.optimus.groups,
        stage.optimus.numbering,
        1,
        0,
        Mailbox(),
        lambda iteration, microbatch: stage.images,
        stage.optimus.messenger,
    )


def _execute(stage: OneStage, stage_plan: StageHookPlan) -> EncoderExecutor:
    """Microbatch 0's hook points in order, G_i handed back before the first backward one."""
    stage.optimus.encoder.zero_grad(set_to_none=True)
    executor = _executor(stage, stage_plan)
    for event in dict.fromkeys(op.event for op in stage_plan.ops):
        if stage_plan.ops_at(event)[0].phase == "bwd" and (0, 0) in executor.mailbox.ready:
            executor.mailbox.take_embeddings((0, 0))
            executor.mailbox.gradients[(0, 0)] = stage.output_grad
        executor.on_event(event, event)
    executor.finish()
    return executor


@pytest.mark.parametrize("placement", ["pre/post", "per op", "pairs"])
def test_the_executor_batches_a_hook_points_ops_into_one_call(
    one_stage: OneStage, engine_calls: list[int], placement: str
) -> None:
    ops = [op for op in one_stage.optimus.stage_plan.ops if op.local_microbatch == 0]
    assert {op.event for op in ops} == {PRE, POST}
    if placement != "pre/post":  # every op, or every two ops of a chain, at a hook point
        size = 1 if placement == "per op" else 2
        points: dict[tuple[str, int], Event] = {}
        ops = [
            replace(
                op,
                event=points.setdefault(
                    (op.phase, op.kernel_index // size), Event(EventKind.OP_START, len(points))
                ),
            )
            for op in ops
        ]
    stage_plan = replace(one_stage.optimus.stage_plan, ops=tuple(ops))
    reference = [g.clone() for g in one_stage.autograd_grads()]
    engine_calls[0] = 0
    executor = _execute(one_stage, stage_plan)
    bwd = len(one_stage.ops.bwd)
    expected = {"pre/post": 1, "per op": bwd, "pairs": (bwd + 1) // 2}
    assert engine_calls[0] == expected[placement] < _per_step_calls(one_stage.ops)
    assert all(torch.equal(a, b) for a, b in zip(one_stage.grads(), reference))
    # every op in the record, in order, at the hook point it ran at
    assert [(r.phase, r.kernel_index, r.ran_at) for r in executor.record] == [
        (op.phase, op.kernel_index, op.event) for op in ops
    ]
