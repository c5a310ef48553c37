"""Run the encoder's kernel-level ops at the hook points of megatron-core's pipeline schedule.

``HookDriver`` turns what megatron-core lets us observe into the hook plan's events: its
``config.timers`` calls around every forward and backward step (``op_start`` / ``op_end``, the op
identified by megatron-core's own op order) and, through ``megatron_patches.hooks``, its
RowParallelLinear reductions (``tp_before`` / ``tp_after``). At each event ``EncoderExecutor`` runs
the encoder ops the plan puts there, through an ``EncoderStream`` (``streams``): inline on the CPU,
on a CUDA side stream ordered against the LLM's stream by events on a GPU.

Tensors move for real: a stage's output goes to the next encoder stage, the projected image tokens
A_i to the LLM's first stage, and its gradient G_i back, through ``messages.Messenger`` (a channel
per kind and direction, each message naming its microbatch) or a local hand-over when the two ends
share a rank. A receive blocks until the data is there; the hook plan guarantees the placement
cannot wait in a cycle, so wrong time predictions cost overlap only.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch

from optimus_mllm.config import OptimusConfig
from optimus_mllm.runtime.data import ImageSource
from optimus_mllm.runtime.dropout import microbatch_seed
from optimus_mllm.runtime.encoder_ops import WHOLE, MicrobatchRun, Piece, StageOps
from optimus_mllm.runtime.hook_plan import Event, EventKind, HookPlan, PlannedOp, StageHookPlan
from optimus_mllm.runtime.messages import Incoming, Messenger
from optimus_mllm.runtime.microbatches import MicrobatchNumbering
from optimus_mllm.runtime.process_groups import Channel, EncoderProcessGroups
from optimus_mllm.runtime.streams import EncoderStream, InlineStream, to_device
from optimus_mllm.scheduler.artifact_format import LLMOp


class EventListener(Protocol):
    def on_event(self, event: Event, ran_at: Event) -> None: ...


@dataclass(frozen=True)
class ExecutedOp:
    """Where an encoder op really ran, as the engine's callbacks saw it, beside where it was
    scheduled."""

    phase: str
    local_microbatch: int
    kernel_index: int
    piece: Piece
    ran_at: Event  # the event megatron-core's own callbacks had reached
    scheduled_at: Event  # the artifact's hook point
    # where the hook plan ran it: ``scheduled_at``, or pre / post where the deadlock repair moved
    # its microbatch (``hook_plan``)
    planned_at: Event
    stream: str
    scheduled_us: float  # the schedule's predicted start (per-iteration schedules differ in it)
    # the LLM microbatch it fed, which of that microbatch's feeders it was (0: the first images),
    # and the job's microbatch (the sample) whose images it ran
    microbatch: int
    part: int
    global_microbatch: int

    @property
    def moved(self) -> bool:
        return self.ran_at != self.scheduled_at

    @property
    def moved_by_repair(self) -> bool:
        """Moved because the artifact's placement would have waited in a cycle."""
        return self.planned_at != self.scheduled_at

    @property
    def moved_to_op_end(self) -> bool:
        """Moved because a TP collective planned in its LLM op never ran (``HookDriver``)."""
        return self.ran_at != self.planned_at


class HookDriver:
    """megatron-core's timer and reduction callbacks -> hook plan events for this rank's LLM stage.

    An LLM op is megatron-core's next ``forward-compute`` / ``backward-compute`` timer span, checked
    against the op order; a TP collective is named by the module that issues it
    (``megatron_patches.hooks``) and matched against the op's planned collectives
    (``collectives[op]``). A collective the plan lacks fires nothing and is recorded in
    ``unplanned``; a planned one that never came fires at the op's end, so the ops placed there
    still run, recorded as having run at ``op_end``.
    """

    def __init__(
        self,
        op_order: tuple[LLMOp, ...],
        listener: EventListener | None,
        wait_for_input: Callable[[LLMOp], None] | None = None,
        collectives: dict[int, list[str]] | None = None,
    ):
        self.op_order = op_order
        self.listener = listener
        # the LLM op's pipeline input, once encoder ops at op_start ran
        self.wait_for_input = wait_for_input
        self.collectives = collectives or {}
        self.op = -1  # index of the LLM op running now
        self.seen = 0  # planned collectives of the current op observed so far
        self.events: list[Event] = []
        self.unplanned: list[
            tuple[int, str | None]
        ] = []  # (op, collective) run by megatron-core, not planned

    @property
    def current(self) -> LLMOp:
        """The LLM op running now."""
        return self.op_order[self.op]

    def fire(self, event: Event, ran_at: Event | None = None) -> None:
        self.events.append(event)
        if self.listener is not None:
            self.listener.on_event(event, event if ran_at is None else ran_at)

    def timers(self, chained: Any = None) -> _Timers:
        """``config.timers`` for megatron-core's schedule; ``chained``, the user's Megatron
        ``Timers``, still times every call."""
        return _Timers(self, chained)

    def on_timer(self, name: str, edge: str) -> None:
        phase = {"forward-compute": "fwd", "backward-compute": "bwd"}.get(name)
        if phase is None:
            return
        if edge == "start":
            self.op += 1
            self.seen = 0
            if self.current.phase != phase:
                raise RuntimeError(
                    f"megatron-core ran a {phase} as op {self.op}; the plan expects "
                    f"{self.current}: the schedule artifact's warm-up does not match"
                )
            self.fire(Event(EventKind.OP_START, self.op))
            if self.wait_for_input is not None:
                self.wait_for_input(self.current)
        else:
            end = Event(EventKind.OP_END, self.op)
            for n in range(self.seen, len(self.collectives.get(self.op, ()))):
                self.fire(Event(EventKind.TP_BEFORE, self.op, n), end)
                self.fire(Event(EventKind.TP_AFTER, self.op, n), end)
            self.fire(end)

    def on_reduction(self, edge: str, collective: str | None) -> None:
        if self.op < 0 or self.current.phase != "fwd":
            return
        planned = self.collectives.get(self.op, ())
        if self.seen < len(planned) and planned[self.seen] == collective:
            kind = EventKind.TP_BEFORE if edge == "before" else EventKind.TP_AFTER
            self.fire(Event(kind, self.op, self.seen))
            self.seen += edge == "after"
        elif edge == "before":
            self.unplanned.append((self.op, collective))


class _Timers:
    """Stands in for megatron's ``config.timers``: ``timers(name, log_level=...)`` ->
    start()/stop()."""

    def __init__(self, driver: HookDriver, chained: Any = None):
        self.driver, self.chained = driver, chained

    def __call__(self, name: str, log_level: int | None = None) -> _Timer:
        return _Timer(
            self.driver,
            name,
            None if self.chained is None else self.chained(name, log_level=log_level),
        )


@dataclass
class _Timer:
    driver: HookDriver
    name: str
    chained: Any  # the user's timer of the same name, or None

    def start(self, barrier: bool = False) -> None:
        if self.chained is not None:
            self.chained.start(barrier=barrier)
        self.driver.on_timer(self.name, "start")

    def stop(self, barrier: bool = False) -> None:
        self.driver.on_timer(self.name, "stop")
        if self.chained is not None:
            self.chained.stop(barrier=barrier)


@dataclass
class Mailbox:
    """Hand-over of A_i / G_i between an encoder stage and the LLM on the same rank, and the stream
    the encoder ops run on: A_i is ready for the LLM once its ``ready`` event is consumed."""

    stream: EncoderStream = field(default_factory=InlineStream)
    # by (LLM microbatch, part): one encoder microbatch's share of its images
    embeddings: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    ready: dict[tuple[int, int], object] = field(default_factory=dict)
    gradients: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)

    def put_embeddings(self, key: tuple[int, int], embeddings: torch.Tensor) -> None:
        self.embeddings[key] = embeddings
        self.ready[key] = self.stream.publish(embeddings)

    def take_embeddings(self, key: tuple[int, int]) -> torch.Tensor:
        """A_i for the LLM: its stream waits here (not where A_i was made) for the encoder's last
        op."""
        self.stream.consume(self.ready.pop(key))
        return self.embeddings.pop(key)


class EncoderExecutor:
    """This rank's encoder stage: runs its planned ops at events and moves their inputs and
    outputs."""

    def __init__(
        self,
        config: OptimusConfig,
        stage_plan: StageHookPlan,
        ops: StageOps,
        groups: EncoderProcessGroups,
        numbering: MicrobatchNumbering,
        num_stages: int,
        iteration: int,
        mailbox: Mailbox,
        images: ImageSource,
        messenger: Messenger,
        images_per_microbatch: ImagesPerMicrobatch | None = None,
    ):
        """``images_per_microbatch``: each LLM microbatch's images this step, where they vary; an
        encoder microbatch without any (``chain_images``) has no encoder work: its ops are skipped
        and it sends nothing."""
        self.config, self.stage_plan, self.ops = config, stage_plan, ops
        self.images_per_microbatch = images_per_microbatch
        self.groups, self.messenger, self.numbering = groups, messenger, numbering
        self.iteration, self.mailbox, self.images = iteration, mailbox, images
        self.stream = mailbox.stream
        self.first, self.last = groups.coords.pp == 0, groups.coords.pp == num_stages - 1
        placed: dict[Event, list[PlannedOp]] = defaultdict(list)
        for op in stage_plan.ops:
            placed[op.event].append(op)
        self.by_event = {event: op_batches(ops) for event, ops in placed.items()}
        # per local microbatch: the backward ops that run together, declared to its run up front
        # so that its forward keeps their graph joined (``MicrobatchRun``)
        self.backward_runs: dict[int, list[range]] = defaultdict(list)
        for batches in self.by_event.values():
            for batch in batches:
                if batch.phase == "bwd" and len(batch.kernels) > 1:
                    self.backward_runs[batch.local_microbatch].append(batch.kernels)
        self.runs: dict[int, MicrobatchRun] = {}
        self.record: list[ExecutedOp] = []

    def on_event(self, event: Event, ran_at: Event) -> None:
        batches = self.by_event.get(event)
        if not batches:
            return
        stream = type(self.stream).__name__
        with self.stream.launch():
            for batch in batches:
                k = batch.local_microbatch
                if not self.chain_images(k):
                    continue
                self._run(batch.phase, k, batch.kernels, batch.piece)
                microbatch, part = self._embeddings_key(k)
                self.record += [
                    ExecutedOp(
                        op.phase,
                        op.local_microbatch,
                        op.kernel_index,
                        op.piece,
                        ran_at,
                        op.assigned,
                        op.event,
                        stream,
                        op.start_us,
                        microbatch,
                        part,
                        self._global_microbatch(k),
                    )
                    for op in batch.ops
                ]

    def finish(self) -> None:
        """After the LLM's last op: everything ran at ``post`` at the latest; let the LLM's stream
        wait for
        the encoder's (its gradients are reduced there next)."""
        self.stream.finish()
        assert not self.runs, (
            f"encoder microbatches {sorted(self.runs)} did not finish their backward"
        )

    def _run(self, phase: str, k: int, kernels: range, piece: Piece) -> None:
        """Ops ``kernels`` of microbatch ``k``'s ``phase`` chain (one op where ``piece`` is not
        whole)."""
        start = kernels.start == 0 and piece[0] == 0.0  # the chain's first op
        if phase == "fwd":
            if start:
                seed = microbatch_seed(
                    self.config.training.seed, self.iteration, self._global_microbatch(k)
                )
                self.runs[k] = MicrobatchRun(
                    self.ops, self._forward_input(k), seed, self.backward_runs.get(k, ())
                )
            run = self.runs[k]
            for index in kernels:
                run.run_forward(index, piece)
            if run.forward_done:
                self._send_output(k, run)
                # a frozen stage: nothing here runs backward, the microbatch is done
                if not self.ops.bwd:
                    del self.runs[k]
        else:
            run = self.runs[k]
            if start:
                run.set_output_grad(self._output_grad(k))
            if piece == WHOLE:
                run.run_backward_range(kernels)
            else:
                run.run_backward(kernels.start, piece)
            if run.backward_done:
                self._send_input_grad(k, run)
                del self.runs[k]

    def has_images(self, microbatch: int) -> bool:
        """Whether LLM microbatch ``microbatch`` has encoder work this step."""
        return self.images_of(microbatch) > 0

    def images_of(self, microbatch: int) -> int:
        """LLM microbatch ``microbatch``'s images this step."""
        count = self.images_per_microbatch
        return self.config.training.micro_batch_size if count is None else count(microbatch)

    def chain_images(self, k: int) -> range:
        """The images of its LLM microbatch that this encoder pipeline's local microbatch ``k``
        runs (all of them unless the schedule splits them over several encoder microbatches)."""
        j = self.groups.coords.pipeline
        return self.numbering.chain_images(j, k, self.images_of(self._llm_microbatch(k)))

    # -- where inputs come from and outputs go ---------------------------------------------------

    def _global_microbatch(self, k: int) -> int:
        return self.numbering.global_index(self._llm_microbatch(k))

    def _llm_microbatch(self, k: int) -> int:
        """The LLM microbatch this encoder pipeline's local microbatch ``k`` feeds."""
        return self.numbering.llm(self.groups.coords.pipeline, k)

    def _forward_input(self, k: int) -> dict[str, torch.Tensor]:
        if self.first:
            images = self.images(self.iteration, self._global_microbatch(k))
            part = self.chain_images(k)
            device = self.stream.device
            return {
                enc.name: to_device(image[part.start : part.stop], device)
                for enc, image in zip(self.config.encoders, images)
            }
        return {
            e.name: self.messenger.recv("activation", self.groups.prev_stage_rank, (k, i))
            for i, e in enumerate(self.config.encoders)
        }

    def _send_output(self, k: int, run: MicrobatchRun) -> None:
        if not self.last:
            for i, e in enumerate(self.config.encoders):
                self.messenger.send(
                    "activation", self.groups.next_stage_rank, run.output[e.name], (k, i)
                )
            return
        # [image tokens, b, h]
        embeddings = torch.cat([run.output[e.name] for e in self.config.encoders], dim=0)
        key = self._embeddings_key(k)
        for link in self.groups.embedding_sends:
            if link.llm_rank == self.groups.rank:
                self.mailbox.put_embeddings(key, embeddings.detach())
            else:
                self.messenger.send("embeddings", link.llm_rank, embeddings, key)

    def _embeddings_key(self, k: int) -> tuple[int, int]:
        """(LLM microbatch, part): which images of which LLM microbatch local microbatch ``k``'s
        A_i and G_i are."""
        j = self.groups.coords.pipeline
        return self.numbering.llm(j, k), self.numbering.part(j, k)

    def _output_grad(self, k: int) -> dict[str, torch.Tensor]:
        if not self.last:
            return {
                e.name: self.messenger.recv("activation_grad", self.groups.next_stage_rank, (k, i))
                for i, e in enumerate(self.config.encoders)
                if e.name in self.ops.output_grad_encoders
            }
        key = self._embeddings_key(k)
        link = self.groups.gradient_recv
        if link.llm_rank == self.groups.rank:
            grad = self.stream.adopt(self.mailbox.gradients.pop(key))  # made on the LLM's stream
        else:
            grad = self.messenger.recv("embeddings_grad", link.llm_rank, key)
        return dict(
            zip(
                (e.name for e in self.config.encoders),
                grad.split([e.image_tokens for e in self.config.encoders], dim=0),
            )
        )

    def _send_input_grad(self, k: int, run: MicrobatchRun) -> None:
        if self.first:
            return
        for i, e in enumerate(self.config.encoders):
            grad = run.input_grad[e.name]
            if grad is not None:
                self.messenger.send("activation_grad", self.groups.prev_stage_rank, grad, (k, i))


ImagesPerMicrobatch = Callable[[int], int]  # this replica's LLM microbatch -> its images


@dataclass(frozen=True)
class OpBatch:
    """Consecutive ops of one microbatch's chain placed at one hook point, run by one call: whole
    ops, or one op's piece."""

    phase: str
    local_microbatch: int
    kernels: range  # positions in the chain
    piece: Piece
    ops: tuple[PlannedOp, ...]


def op_batches(ops: list[PlannedOp]) -> list[OpBatch]:
    """The ops of one hook point, in order, consecutive whole ops of one chain batched."""
    batches: list[OpBatch] = []
    for op in ops:
        last = batches[-1] if batches else None
        if (
            last is not None
            and last.piece == op.piece == WHOLE
            and (last.phase, last.local_microbatch) == (op.phase, op.local_microbatch)
            and last.kernels.stop == op.kernel_index
        ):
            batches[-1] = replace(
                last, kernels=range(last.kernels.start, op.kernel_index + 1), ops=(*last.ops, op)
            )
        else:
            kernels = range(op.kernel_index, op.kernel_index + 1)
            batches.append(OpBatch(op.phase, op.local_microbatch, kernels, op.piece, (op,)))
    return batches


def embeddings_shape(config: OptimusConfig, images: int) -> tuple[int, int, int]:
    """A_i and G_i: [image tokens, images, LLM hidden]."""
    return (config.image_tokens, images, config.llm.hidden_size)


def hidden_shape(config: OptimusConfig, encoder: int, tp: int, images: int) -> tuple[int, int, int]:
    """Activations between encoder stages: [tokens on this TP rank (patches and class token),
    images, hidden]."""
    e = config.encoders[encoder]
    sp = config.training.sequence_parallel and tp > 1
    return (e.layer_tokens // tp if sp else e.layer_tokens, images, e.hidden_size)


def incoming_messages(
    config: OptimusConfig,
    plan: HookPlan,
    groups: EncoderProcessGroups,
    output_grad_encoders: frozenset[str],
    numbering: MicrobatchNumbering,
    m: int,
    num_stages: int,
    images: ImagesPerMicrobatch | None = None,
) -> Incoming:
    """What arrives on each channel this rank receives on, in its sender's order (hook plan, LLM op
    order), each message shaped for its encoder microbatch's share (``chain_images``) of its LLM
    microbatch's ``images`` (default: ``micro_batch_size``); one without images sends nothing."""
    images = images if images is not None else _one_per_sample(config)
    j, e, tp = groups.coords.pipeline, groups.coords.pp, groups.tp_group.size()
    rank = groups.rank

    def runs(pipeline: int, k: int) -> int:
        """The images local microbatch ``k`` of encoder pipeline ``pipeline`` runs."""
        return len(numbering.chain_images(pipeline, k, images(numbering.llm(pipeline, k))))

    incoming: Incoming = {}
    if e > 0:
        order = plan.stage(j, e - 1).completion_order("fwd")
        incoming[Channel("activation", groups.prev_stage_rank, rank)] = [
            ((k, i), hidden_shape(config, i, tp, runs(j, k)))
            for k in order
            if runs(j, k)
            for i in range(len(config.encoders))
        ]
    if e < num_stages - 1:
        wanted = [i for i, enc in enumerate(config.encoders) if enc.name in output_grad_encoders]
        order = plan.stage(j, e + 1).completion_order("bwd")
        incoming[Channel("activation_grad", groups.next_stage_rank, rank)] = [
            ((k, i), hidden_shape(config, i, tp, runs(j, k)))
            for k in order
            if runs(j, k)
            for i in wanted
        ]
    for link in groups.embedding_recvs:
        if not link.local:
            pipeline = link.encoder_dp - numbering.llm_dp * m
            order = plan.stage(pipeline, num_stages - 1).completion_order("fwd")
            incoming[Channel("embeddings", link.encoder_rank, rank)] = [
                (
                    (numbering.llm(pipeline, k), numbering.part(pipeline, k)),
                    embeddings_shape(config, runs(pipeline, k)),
                )
                for k in order
                if runs(pipeline, k)
            ]
    link = groups.gradient_recv
    if link is not None and not link.local:
        # G_i leaves the LLM's first stage at its backward, one message per feeder, in their order
        incoming[Channel("embeddings_grad", link.llm_rank, rank)] = [
            ((op.microbatch, part), embeddings_shape(config, runs(j, source.local_microbatch)))
            for op in plan.op_order[0]
            if op.chunk == 0 and op.phase == "bwd"
            for part, source in enumerate(numbering.feeders(op.microbatch))
            if source.encoder_pipeline == j and runs(j, source.local_microbatch)
        ]
    return incoming


def _one_per_sample(config: OptimusConfig) -> ImagesPerMicrobatch:
    def images(microbatch: int) -> int:
        return config.training.micro_batch_size

    return images
