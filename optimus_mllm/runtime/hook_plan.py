"""From a schedule artifact to what each encoder stage runs at each hook point, free of deadlock.

The runtime observes a fixed sequence of events on every LLM pipeline stage, the same on each of its
TP ranks: ``pre`` (before the first LLM op), for each op in the artifact's op order for the stage
(megatron-core's, under the artifact's warm-up) ``op_start``, around each observable TP collective
of a forward op ``tp_before``/``tp_after``, ``op_end``, and ``post`` (``Event``). An artifact hook
names an LLM kernel; it maps to the last event at or before it. A stage runs its ops in the order
the artifact lists them, each at its hook's event (``artifact_checks`` refuses a list whose hooks or
chains are out of order, so that order is one the stage can run).

Encoder ops block on their inputs (CPU execution is inline), so a placement whose waits form a cycle
would hang. We model each event as two nodes, ``arrive`` (the LLM got there) and ``done`` (the
encoder ops placed there finished), with edges for program order, the LLM's P2P (the next op needs
the previous stage's output), encoder output A_i into the first LLM stage, gradient G_i out of it,
and the encoder pipeline's own P2P. Sends need no node: every message has a channel (a process
group) of its own and is waited for only at the end of the step (``messages``,
``megatron_patches.p2p``), so a send never blocks; and a receive that takes its channel's earlier
messages first waits for nothing more, since the sender sent those before the one wanted. If the
artifact's placement is cyclic (predicted times were wrong), the microbatch caught in a cycle runs
its encoder forward at ``pre`` or its backward at ``post``, as the coarse schedule would; the fully
coarse placement is acyclic, so this terminates. A wrong prediction therefore costs overlap, never
correctness. Pure Python: no torch.

Collectives on two streams (GPU). The encoder's TP collectives run on the side stream on their own
communicator while the LLM's run on the main stream on another, and NCCL can hang when ranks run
two communicators' kernels in different orders. Every rank of an encoder TP group sits on one LLM
stage (``encoder_stage_gpus``): it sees that stage's event sequence and runs the same stage plan at
each event, so every rank of the group enqueues the LLM's TP collectives and the encoder's in one
and the same interleaving. ``streams.training_device`` sets ``NCCL_LAUNCH_ORDER_IMPLICIT`` so that
NCCL runs them on the GPU in that host order. The encoder's DP and model-parallel collectives run
after the schedule, once the main stream has waited for the side stream, and every communicator
exists before the first step (``communicators``), so no NCCL set-up blocks a hook. Not covered: in
that launch order an NCCL send larger than its buffers holds the rank's later collectives until
its receiver posts the receive, a wait the model above (where sends never block) leaves out.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace
from enum import Enum
from typing import NamedTuple

from optimus_mllm.scheduler.artifact_format import Hook, LLMOp, ScheduleArtifact
from optimus_mllm.scheduler.pipeline_order import pipeline_producer


class EventKind(Enum):
    PRE = "pre"  # before the stage's first LLM op
    OP_START = "op_start"
    TP_BEFORE = "tp_before"  # an observable TP collective of a forward op is about to run
    TP_AFTER = "tp_after"  # ... has run
    OP_END = "op_end"
    POST = "post"  # after the stage's last LLM op


class Event(NamedTuple):
    """A moment of the LLM's execution on one stage that the runtime observes."""

    kind: EventKind
    op: int = -1  # the LLM op's index in the stage's op order; -1 for pre and post
    collective: int = -1  # for tp_*: the index among the op's observable collectives


PRE = Event(EventKind.PRE)
POST = Event(EventKind.POST)

# TP collectives that megatron-core's RowParallelLinear and VocabParallelEmbedding issue through a
# patchable call in forward
OBSERVABLE_COLLECTIVES = frozenset(
    {"tp_ar_embed", "tp_rs_embed", "tp_ar_attn", "tp_ar_mlp", "tp_rs_attn", "tp_rs_mlp"}
)


@dataclass(frozen=True)
class PlannedOp:
    """One encoder kernel-op of this stage, where the artifact put it and where it will run."""

    phase: str
    microbatch: int  # the LLM pipeline's numbering (the LLM microbatch it feeds)
    local_microbatch: int  # its encoder pipeline's numbering
    kernel_index: int  # position in the stage's forward or backward chain
    piece: tuple[float, float]  # the share of the kernel's tokens it runs: (0, 1) whole
    kernel: str
    encoder: str
    layer: int
    is_comm: bool
    assigned: Event  # where the artifact's hook falls
    event: Event  # where it runs: ``assigned`` unless the deadlock repair moved it
    start_us: float  # the artifact's predicted start: which schedule placed it


@dataclass(frozen=True)
class StageHookPlan:
    encoder_pipeline: int
    encoder_stage: int
    llm_stage: int
    gpus: tuple[int, ...]
    ops: tuple[PlannedOp, ...]  # in execution order

    def ops_at(self, event: Event) -> list[PlannedOp]:
        return [op for op in self.ops if op.event == event]

    def completion_order(self, phase: str) -> list[int]:
        """Local microbatches in the order this stage finishes their ``phase`` chain: the order the
        stage's outgoing messages of that phase leave in."""
        last = {
            op.local_microbatch: position
            for position, op in enumerate(self.ops)
            if op.phase == phase
        }
        return sorted(last, key=last.__getitem__)


@dataclass(frozen=True)
class HookPlan:
    events: dict[int, tuple[Event, ...]]  # per LLM stage, in order
    op_order: dict[int, tuple[LLMOp, ...]]  # per LLM stage: the artifact's
    stages: tuple[StageHookPlan, ...]
    # (LLM microbatch, phase) moved to pre/post by the repair
    moved_microbatches: tuple[tuple[int, str], ...]

    def for_gpu(self, gpu: int) -> StageHookPlan:
        return next(s for s in self.stages if gpu in s.gpus)

    def stage(self, encoder_pipeline: int, encoder_stage: int) -> StageHookPlan:
        return next(
            s
            for s in self.stages
            if (s.encoder_pipeline, s.encoder_stage) == (encoder_pipeline, encoder_stage)
        )


def build_hook_plan(
    artifact: ScheduleArtifact, observable: frozenset[str] = OBSERVABLE_COLLECTIVES
) -> HookPlan:
    """Every encoder stage's ops at the events their hooks fall on, in the artifact's order (which
    ``artifact_checks`` made one the stage can run: hooks in order, a chain's kernels in order)."""
    pp = artifact.llm_plan.pp
    op_order = dict(enumerate(artifact.llm_op_order))
    events = {s: _stage_events(artifact, s, observable) for s in range(pp)}
    mapper = {s: _HookMapper(artifact, s, observable) for s in range(pp)}
    stages = []
    for stage in artifact.encoder_stages:
        s = stage.llm_stage
        ops = []
        for op in stage.ops:
            event = mapper[s].event(op.hook)
            ops.append(
                PlannedOp(
                    phase=op.phase,
                    microbatch=op.microbatch,
                    local_microbatch=op.local_microbatch,
                    kernel_index=op.kernel_index,
                    piece=op.piece,
                    kernel=op.kernel,
                    encoder=op.encoder,
                    layer=op.layer,
                    is_comm=op.is_comm,
                    assigned=event,
                    event=event,
                    start_us=op.start_us,
                )
            )
        stages.append(
            StageHookPlan(stage.encoder_pipeline, stage.encoder_stage, s, stage.gpus, tuple(ops))
        )
    plan = HookPlan(events, op_order, tuple(stages), ())
    return _repair(plan, artifact)


def _stage_events(
    artifact: ScheduleArtifact, stage: int, observable: frozenset[str]
) -> tuple[Event, ...]:
    events: list[Event] = [PRE]
    for k, op in enumerate(artifact.llm_op_order[stage]):
        events.append(Event(EventKind.OP_START, k))
        for n in range(len(_observed_collectives(artifact.kernels_of(stage, op), op, observable))):
            events += [Event(EventKind.TP_BEFORE, k, n), Event(EventKind.TP_AFTER, k, n)]
        events.append(Event(EventKind.OP_END, k))
    events.append(POST)
    return tuple(events)


def planned_collectives(
    artifact: ScheduleArtifact,
    stage: int,
    observable: frozenset[str] = OBSERVABLE_COLLECTIVES,
) -> dict[int, list[str]]:
    """Per forward op of ``stage`` (index in its op order): its observable TP collectives, in
    order."""
    return {
        k: _observed_collectives(artifact.kernels_of(stage, op), op, observable)
        for k, op in enumerate(artifact.llm_op_order[stage])
        if op.phase == "fwd"
    }


def _observed_collectives(
    names: tuple[str, ...], op: LLMOp, observable: frozenset[str]
) -> list[str]:
    # backward collectives run inside autograd, where no hook is reached: only op boundaries there
    return [name for name in names if name in observable] if op.phase == "fwd" else []


class _HookMapper:
    """Maps an artifact hook to the last observable event at or before the moment it names."""

    def __init__(self, artifact: ScheduleArtifact, stage: int, observable: frozenset[str]):
        self.artifact, self.stage, self.observable = artifact, stage, observable
        self.index = {op: k for k, op in enumerate(artifact.llm_op_order[stage])}

    def event(self, hook: Hook) -> Event:
        if hook.at == "before_first_compute":
            return PRE
        if hook.at == "after_last_compute":
            return POST
        kernel = hook.llm_kernel
        k = self.index[kernel.op]
        names = self.artifact.kernels_of(self.stage, kernel.op)
        x = kernel.kernel_index
        fwd = kernel.op.phase == "fwd"
        observed = [i for i, name in enumerate(names) if fwd and name in self.observable]
        if x in observed:  # under the collective, or right after it
            kind = EventKind.TP_AFTER if kernel.after else EventKind.TP_BEFORE
            return Event(kind, k, observed.index(x))
        if kernel.after and x == len(names) - 1:
            return Event(EventKind.OP_END, k)
        earlier = [i for i in observed if i < x]
        if earlier:
            return Event(EventKind.TP_AFTER, k, len(earlier) - 1)
        return Event(EventKind.OP_START, k)


# --------------------------------------------------------------------------------------------
# deadlock check and repair


def _repair(plan: HookPlan, artifact: ScheduleArtifact) -> HookPlan:
    graph = _WaitGraph(plan, artifact)  # the LLM's part once: only encoder ops move below
    moved: list[tuple[int, str]] = []
    while True:
        stuck = graph.stuck(plan.stages)
        if not stuck:
            return replace(plan, moved_microbatches=tuple(moved))
        # nodes behind a cycle are reported too; a moved microbatch is coarse and needs no second
        # move
        candidates = stuck - set(moved)
        if not candidates:
            raise AssertionError(f"coarse placement of {sorted(stuck)} still waits in a cycle")
        microbatch, phase = min(candidates)
        target = PRE if phase == "fwd" else POST
        stages = tuple(
            replace(
                st,
                ops=_reordered(
                    tuple(
                        replace(op, event=target)
                        if (op.microbatch, op.phase) == (microbatch, phase)
                        else op
                        for op in st.ops
                    ),
                    graph.position[st.llm_stage],
                ),
            )
            for st in plan.stages
        )
        plan = replace(plan, stages=stages)
        moved.append((microbatch, phase))


def _reordered(ops: tuple[PlannedOp, ...], position: dict[Event, int]) -> tuple[PlannedOp, ...]:
    # stable: chain order kept within an event
    return tuple(sorted(ops, key=lambda op: position[op.event]))


def _stuck_microbatches(plan: HookPlan, artifact: ScheduleArtifact) -> set[tuple[int, str]]:
    """(microbatch, phase) of encoder work on a wait cycle; empty when the placement cannot
    deadlock."""
    return _WaitGraph(plan, artifact).stuck(plan.stages)


class _WaitGraph:
    """Each event of each LLM stage as two nodes, ``arrive`` and ``done`` (numbered
    ``2 * position`` and one more, after the stages before), with the edges the LLM alone fixes
    -- program order and its own P2P -- built once; ``stuck`` adds the encoder's for a placement.
    The repair moves encoder ops only, so it rebuilds none of the LLM's edges."""

    def __init__(self, plan: HookPlan, artifact: ScheduleArtifact):
        self.offset: dict[int, int] = {}
        self.position: dict[int, dict[Event, int]] = {}
        size = 0
        for s, events in plan.events.items():
            self.offset[s] = size
            self.position[s] = {e: i for i, e in enumerate(events)}
            size += 2 * len(events)
        self.size = size
        self.llm_edges: list[list[int]] = [[] for _ in range(size)]
        for s, events in plan.events.items():  # program order: arrive -> done -> next arrive
            base = self.offset[s]
            for i in range(len(events)):
                self.llm_edges[base + 2 * i].append(base + 2 * i + 1)
                if i + 1 < len(events):
                    self.llm_edges[base + 2 * i + 1].append(base + 2 * i + 2)
        pp, vp = artifact.llm_plan.pp, artifact.llm_plan.vp
        self.where = {
            s: {op: k for k, op in enumerate(order)} for s, order in plan.op_order.items()
        }
        # the LLM's own P2P: an op needs its producer's output
        for s, order in plan.op_order.items():
            for k, op in enumerate(order):
                producer = pipeline_producer(s, op.chunk, op.phase, pp, vp)
                if producer is not None:
                    ps, pchunk = producer
                    pk = self.where[ps][LLMOp(op.microbatch, pchunk, op.phase)]
                    self.llm_edges[self.arrive(ps, Event(EventKind.OP_END, pk))].append(
                        self.after_start(s, k)
                    )
        self.assignment = tuple(zip(artifact.assignment, artifact.feeds))

    def arrive(self, stage: int, event: Event) -> int:
        return self.offset[stage] + 2 * self.position[stage][event]

    def done(self, stage: int, event: Event) -> int:
        return self.arrive(stage, event) + 1

    def after_start(self, stage: int, k: int) -> int:
        """The arrive node of the event right after LLM op k starts: where it has needed its
        input."""
        return self.arrive(stage, Event(EventKind.OP_START, k)) + 2

    def stuck(self, stages: tuple[StageHookPlan, ...]) -> set[tuple[int, str]]:
        """(microbatch, phase) of encoder work on a wait cycle of this placement."""
        edges = [list(targets) for targets in self.llm_edges]
        owner: dict[int, set[tuple[int, str]]] = defaultdict(set)
        chains: dict[tuple[int, int, int, str], list[Event]] = defaultdict(list)
        for st in stages:
            for op in st.ops:
                chains[
                    (st.encoder_pipeline, st.encoder_stage, op.local_microbatch, op.phase)
                ].append(op.event)
                owner[self.done(st.llm_stage, op.event)].add((op.microbatch, op.phase))
        llm_stage = {(st.encoder_pipeline, st.encoder_stage): st.llm_stage for st in stages}
        last = max(e for _, e in llm_stage)
        # each encoder microbatch and the LLM microbatch it feeds (an imageless one is fed by none:
        # the LLM waits on no encoder for it)
        for source, i in self.assignment:
            j, k = source.encoder_pipeline, source.local_microbatch
            for e in range(last + 1):  # the encoder pipeline's own P2P, forward then backward
                if e > 0:
                    edges[
                        self.done(llm_stage[(j, e - 1)], chains[(j, e - 1, k, "fwd")][-1])
                    ].append(self.done(llm_stage[(j, e)], chains[(j, e, k, "fwd")][0]))
                if e < last and chains.get((j, e, k, "bwd")):
                    edges[
                        self.done(llm_stage[(j, e + 1)], chains[(j, e + 1, k, "bwd")][-1])
                    ].append(self.done(llm_stage[(j, e)], chains[(j, e, k, "bwd")][0]))
            first_fwd = self.where[0][LLMOp(i, 0, "fwd")]  # A_i into the first LLM stage's chunk 0
            edges[self.done(llm_stage[(j, last)], chains[(j, last, k, "fwd")][-1])].append(
                self.after_start(0, first_fwd)
            )
            if chains.get((j, last, k, "bwd")):  # G_i out of it
                last_bwd = self.where[0][LLMOp(i, 0, "bwd")]
                edges[self.arrive(0, Event(EventKind.OP_END, last_bwd))].append(
                    self.done(llm_stage[(j, last)], chains[(j, last, k, "bwd")][0])
                )
        remaining = _nodes_on_or_after_cycles(self.size, edges)
        return {mb_phase for node in remaining for mb_phase in owner.get(node, ())}


def _nodes_on_or_after_cycles(n: int, edges: list[list[int]]) -> set[int]:
    """Kahn's algorithm: the nodes never freed are on a cycle or wait behind one."""
    indegree = [0] * n
    for targets in edges:
        for b in targets:
            indegree[b] += 1
    ready = [v for v in range(n) if indegree[v] == 0]
    freed = 0
    while ready:
        v = ready.pop()
        freed += 1
        for b in edges[v]:
            indegree[b] -= 1
            if indegree[b] == 0:
                ready.append(b)
    return {v for v in range(n) if indegree[v] > 0} if freed < n else set()
