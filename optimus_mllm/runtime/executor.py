"""Run the encoder's kernel-level ops at the hook points of megatron-core's pipeline schedule.

``HookDriver`` turns what megatron-core lets us observe into the hook plan's events: its
``config.timers`` calls around every forward and backward step (``op_start`` / ``op_end``, the op
identified by megatron-core's own op order) and, through ``megatron_patches.hooks``, its
RowParallelLinear reductions (``tp_before`` / ``tp_after``). At each event ``EncoderExecutor`` runs the
encoder ops the plan puts there, through an ``EncoderStream`` (``streams``): inline on the CPU, on a
CUDA side stream ordered against the LLM's stream by events on a GPU.

Tensors move for real: a stage's output goes to the next encoder stage, the projected image tokens
A_i to the LLM's first stage, and its gradient G_i back, by P2P (tagged per microbatch) or a local
hand-over when the two ends share a rank. A receive blocks until the data is there; the hook plan
guarantees the placement cannot wait in a cycle, so wrong time predictions cost overlap only.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from optimus_mllm.config import OptimusConfig
from optimus_mllm.runtime.data import MicrobatchSource
from optimus_mllm.runtime.dtypes import DTYPES
from optimus_mllm.runtime.encoder_ops import MicrobatchRun, StageOps
from optimus_mllm.runtime.hook_plan import Event, StageHookPlan
from optimus_mllm.runtime.process_groups import EncoderProcessGroups
from optimus_mllm.runtime.streams import EncoderStream, InlineStream, to_device

# P2P tags, one range per kind of message, offset by the microbatch (and encoder) index
TAG_ACTIVATION, TAG_ACTIVATION_GRAD, TAG_EMBEDDINGS, TAG_EMBEDDINGS_GRAD = 1 << 20, 2 << 20, 3 << 20, 4 << 20


class HookDriver:
    """megatron-core's timer and reduction callbacks -> hook plan events for this rank's LLM stage."""

    def __init__(self, op_order: list[tuple[int, int, str]], listener: EncoderExecutor | None,
                 wait_for_input: Callable[[int, int, str], None] | None = None):
        self.op_order = op_order
        self.listener = listener
        self.wait_for_input = wait_for_input  # the LLM op's pipeline input, once encoder ops at op_start ran
        self.op = -1  # index of the LLM op running now
        self.collectives = 0  # reductions seen in the current op
        self.events: list[Event] = []

    @property
    def current(self) -> tuple[int, int, str]:
        """(microbatch, chunk, phase) of the LLM op running now."""
        return self.op_order[self.op]

    def fire(self, event: Event) -> None:
        self.events.append(event)
        if self.listener is not None:
            self.listener.on_event(event)

    def timers(self) -> _Timers:
        return _Timers(self)

    def on_timer(self, name: str, edge: str) -> None:
        phase = {"forward-compute": "fwd", "backward-compute": "bwd"}.get(name)
        if phase is None:
            return
        if edge == "start":
            self.op += 1
            self.collectives = 0
            if self.op_order[self.op][2] != phase:
                raise RuntimeError(f"megatron-core ran a {phase} as op {self.op}; the plan expects "
                                   f"{self.op_order[self.op]}: the schedule artifact's warm-up does not match")
            self.fire(("op_start", self.op))
            if self.wait_for_input is not None:
                self.wait_for_input(*self.op_order[self.op])
        else:
            self.fire(("op_end", self.op))

    def on_reduction(self, edge: str) -> None:
        if self.op < 0 or self.current[2] != "fwd":
            return
        self.fire(("tp_before" if edge == "before" else "tp_after", self.op, self.collectives))
        if edge == "after":
            self.collectives += 1


class _Timers:
    """Stands in for megatron's ``config.timers``: ``timers(name, log_level=...)`` -> start()/stop()."""

    def __init__(self, driver: HookDriver):
        self.driver = driver

    def __call__(self, name: str, log_level: int | None = None) -> _Timer:
        return _Timer(self.driver, name)


@dataclass
class _Timer:
    driver: HookDriver
    name: str

    def start(self, barrier: bool = False) -> None:
        self.driver.on_timer(self.name, "start")

    def stop(self, barrier: bool = False) -> None:
        self.driver.on_timer(self.name, "stop")


@dataclass
class Mailbox:
    """Hand-over of A_i / G_i between an encoder stage and the LLM on the same rank, and the stream the
    encoder ops run on: A_i is ready for the LLM once its ``ready`` event is consumed."""

    stream: EncoderStream = field(default_factory=InlineStream)
    embeddings: dict[int, torch.Tensor] = field(default_factory=dict)
    ready: dict[int, object] = field(default_factory=dict)
    gradients: dict[int, torch.Tensor] = field(default_factory=dict)

    def put_embeddings(self, microbatch: int, embeddings: torch.Tensor) -> None:
        self.embeddings[microbatch] = embeddings
        self.ready[microbatch] = self.stream.publish(embeddings)

    def take_embeddings(self, microbatch: int) -> torch.Tensor:
        """A_i for the LLM: its stream waits here (not where A_i was made) for the encoder's last op."""
        self.stream.consume(self.ready.pop(microbatch))
        return self.embeddings.pop(microbatch)


class EncoderExecutor:
    """This rank's encoder stage: runs its planned ops at events and moves their inputs and outputs."""

    def __init__(self, config: OptimusConfig, plan: StageHookPlan, ops: StageOps, groups: EncoderProcessGroups,
                 assignment: list[tuple[int, int]], llm_dp: int, num_stages: int, iteration: int, mailbox: Mailbox,
                 data: MicrobatchSource):
        self.config, self.plan, self.ops, self.groups = config, plan, ops, groups
        self.iteration, self.mailbox, self.data = iteration, mailbox, data
        self.stream = mailbox.stream
        self.llm_microbatch = {tuple(a): i for i, a in enumerate(assignment)}
        self.llm_dp = llm_dp
        self.first, self.last = groups.coords.pp == 0, groups.coords.pp == num_stages - 1
        self.by_event: dict[Event, list] = defaultdict(list)
        for op in plan.ops:
            self.by_event[op.event].append(op)
        self.runs: dict[int, MicrobatchRun] = {}
        self.pending: list[dist.Work] = []
        self.log: list[tuple[Event, str, int, int]] = []  # (event, phase, local microbatch, op index)

    def on_event(self, event: Event) -> None:
        ops = self.by_event.get(event)
        if not ops:
            return
        with self.stream.launch():
            for op in ops:
                self._run(op.phase, op.local_microbatch, op.kernel_index)
                self.log.append((event, op.phase, op.local_microbatch, op.kernel_index))

    def finish(self) -> None:
        """After the LLM's last op: everything ran at ``post`` at the latest; wait for our sends, and let the
        LLM's stream wait for the encoder's (its gradients are reduced there next)."""
        for work in self.pending:
            work.wait()
        self.pending.clear()
        self.stream.finish()
        assert not self.runs, f"encoder microbatches {sorted(self.runs)} did not finish their backward"

    def _run(self, phase: str, k: int, index: int) -> None:
        if phase == "fwd":
            if index == 0:
                self.runs[k] = MicrobatchRun(self.ops, self._forward_input(k))
            run = self.runs[k]
            run.run_forward(index)
            if run.forward_done:
                self._send_output(k, run)
        else:
            run = self.runs[k]
            if index == 0:
                run.set_output_grad(self._output_grad(k))
            run.run_backward(index)
            if run.backward_done:
                self._send_input_grad(k, run)
                del self.runs[k]

    # -- where inputs come from and outputs go ---------------------------------------------------

    def _global_microbatch(self, k: int) -> int:
        i = self.llm_microbatch[(self.groups.coords.pipeline, k)]
        return self.llm_dp * len(self.llm_microbatch) + i

    def _forward_input(self, k: int) -> dict[str, torch.Tensor]:
        if self.first:
            mb = self.data(self.iteration, self._global_microbatch(k))
            device = self.stream.device
            return {enc.name: to_device(image, device) for enc, image in zip(self.config.encoders, mb.images)}
        return {name: self._recv(shape, self.groups.prev_stage_rank, TAG_ACTIVATION, k, i)
                for i, (name, shape) in enumerate(self._hidden_shapes().items())}

    def _hidden_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shape of the activations between encoder stages: [tokens on this TP rank, batch, hidden]."""
        tp = self.groups.tp_group.size()
        sp = self.config.training.sequence_parallel and tp > 1
        return {e.name: (e.seq_length // tp if sp else e.seq_length, self.config.training.micro_batch_size,
                         e.hidden_size) for e in self.config.encoders}

    def _send_output(self, k: int, run: MicrobatchRun) -> None:
        if not self.last:
            for i, name in enumerate(self._hidden_shapes()):
                self._send(run.output[name], self.groups.next_stage_rank, TAG_ACTIVATION, k, i)
            return
        embeddings = torch.cat([run.output[e.name] for e in self.config.encoders], dim=0)  # [image tokens, b, h]
        i = self.llm_microbatch[(self.groups.coords.pipeline, k)]
        for link in self.groups.embedding_sends:
            if link.llm_rank == self.groups.rank:
                self.mailbox.put_embeddings(i, embeddings.detach())
            else:
                self._send(embeddings, link.llm_rank, TAG_EMBEDDINGS, i, 0)

    def _output_grad(self, k: int) -> dict[str, torch.Tensor]:
        if not self.last:
            shapes = self._hidden_shapes()
            return {name: self._recv(shapes[name], self.groups.next_stage_rank, TAG_ACTIVATION_GRAD, k, i)
                    for i, name in enumerate(shapes) if name in self.ops.output_grad_encoders}
        i = self.llm_microbatch[(self.groups.coords.pipeline, k)]
        link = self.groups.gradient_recv
        if link.llm_rank == self.groups.rank:
            grad = self.stream.adopt(self.mailbox.gradients.pop(i))  # made on the LLM's stream
        else:
            grad = self._recv(embeddings_shape(self.config), link.llm_rank, TAG_EMBEDDINGS_GRAD, i, 0)
        return dict(zip((e.name for e in self.config.encoders),
                        grad.split([e.seq_length for e in self.config.encoders], dim=0)))

    def _send_input_grad(self, k: int, run: MicrobatchRun) -> None:
        if self.first:
            return
        for i, name in enumerate(self._hidden_shapes()):
            grad = run.input_grad[name]
            if grad is not None:
                self._send(grad, self.groups.prev_stage_rank, TAG_ACTIVATION_GRAD, k, i)

    def _send(self, tensor: torch.Tensor, peer: int, base: int, k: int, i: int) -> None:
        self.pending.append(dist.isend(tensor.detach().contiguous(), peer, tag=base + k * 16 + i))

    def _recv(self, shape: tuple[int, ...], peer: int, base: int, k: int, i: int) -> torch.Tensor:
        buffer = torch.empty(shape, dtype=self._dtype(), device=self.stream.device)
        dist.recv(buffer, peer, tag=base + k * 16 + i)
        return buffer

    def _dtype(self) -> torch.dtype:
        return DTYPES[self.config.training.precision]


def embeddings_shape(config: OptimusConfig) -> tuple[int, int, int]:
    """A_i and G_i: [image tokens, micro batch, LLM hidden]."""
    return (sum(e.seq_length for e in config.encoders), config.training.micro_batch_size, config.llm.hidden_size)


def recv_embeddings(config: OptimusConfig, peer: int, microbatch: int,
                    device: torch.device | str = "cpu") -> torch.Tensor:
    buffer = torch.empty(embeddings_shape(config), dtype=DTYPES[config.training.precision], device=device)
    dist.recv(buffer, peer, tag=TAG_EMBEDDINGS + microbatch * 16)
    return buffer


def send_embeddings_grad(grad: torch.Tensor, peer: int, microbatch: int) -> dist.Work:
    return dist.isend(grad.contiguous(), peer, tag=TAG_EMBEDDINGS_GRAD + microbatch * 16)

