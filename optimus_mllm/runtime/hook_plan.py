"""From a schedule artifact to what each encoder stage runs at each hook point, free of deadlock.

The runtime observes a fixed sequence of events on every LLM pipeline stage, the same on each of its
TP ranks: ``pre`` (before the first LLM op), for each op in megatron-core's order ``op_start``,
around each observable TP collective of a forward op ``tp_before``/``tp_after``, ``op_end``, and
``post``. An artifact hook names an LLM kernel and a time; it maps to the last event at or before
it.

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
from typing import Any

from optimus_mllm.scheduler.llm_timeline import pipeline_producer, rank_op_order

# ("pre",) | ("op_start", k) | ("tp_before", k, n) | ("tp_after", k, n) | ("op_end", k) | ("post",)
Event = tuple
PRE: Event = ("pre",)
POST: Event = ("post",)

# TP collectives that megatron-core's RowParallelLinear and VocabParallelEmbedding issue through a
# patchable call in forward
OBSERVABLE_COLLECTIVES = frozenset(
    {"tp_ar_embed", "tp_rs_embed", "tp_ar_attn", "tp_ar_mlp", "tp_rs_attn", "tp_rs_mlp"}
)


@dataclass(frozen=True)
class PlannedOp:
    """One encoder kernel-op of this stage, where the artifact put it and where it will run."""

    phase: str
    microbatch: int  # global LLM microbatch
    local_microbatch: int
    kernel_index: int  # position in the stage's forward or backward chain
    piece: tuple[float, float]  # the share of the kernel's tokens it runs: (0, 1) whole
    kernel: str
    encoder: str
    layer: int
    is_comm: bool
    assigned: Event
    event: Event


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
    # per LLM stage: (microbatch, chunk, phase) per op
    op_order: dict[int, list[tuple[int, int, str]]]
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
    artifact: dict[str, Any], observable: frozenset[str] = OBSERVABLE_COLLECTIVES
) -> HookPlan:
    llm = artifact["llm_plan"]
    pp, vp, n_mb = llm["pp"], llm["vp"], artifact["num_microbatches"]
    kernels = artifact["llm_kernels"]
    op_order = {s: rank_op_order(n_mb, vp, artifact["warmup"][s], pp) for s in range(pp)}
    events = {s: _stage_events(s, op_order[s], kernels, observable) for s in range(pp)}
    mapper = {s: _HookMapper(s, op_order[s], kernels, observable) for s in range(pp)}
    stages = []
    for stage in artifact["encoder_stages"]:
        s = stage["llm_stage"]
        ops = [
            PlannedOp(
                op["phase"],
                op["microbatch"],
                op["local_microbatch"],
                op["kernel_index"],
                tuple(op["piece"]),
                op["kernel"],
                op["encoder"],
                op["layer"],
                op["is_comm"],
                mapper[s].event(op["hook"]),
                mapper[s].event(op["hook"]),
            )
            for op in stage["ops"]
        ]
        ops = _chain_ordered(ops, events[s])
        stages.append(
            StageHookPlan(
                stage["encoder_pipeline"], stage["encoder_stage"], s, tuple(stage["gpus"]), ops
            )
        )
    plan = HookPlan(events, op_order, tuple(stages), ())
    return _repair(plan, artifact)


def _chain_ordered(ops: list[PlannedOp], events: tuple[Event, ...]) -> tuple[PlannedOp, ...]:
    """A chain's ops run in kernel order (a kernel's pieces in token order): an op never runs at an
    earlier
    event than its predecessor."""
    position = {e: i for i, e in enumerate(events)}
    latest: dict[tuple[int, str], int] = {}
    fixed = []
    for op in sorted(
        ops, key=lambda op: (op.phase, op.local_microbatch, op.kernel_index, op.piece)
    ):
        key = (op.local_microbatch, op.phase)
        at = max(position[op.event], latest.get(key, 0))
        latest[key] = at
        fixed.append(replace(op, event=events[at]))
    # execution order: by event; chains in the order the artifact predicted them there; kernel order
    # inside
    rank = {
        (op.phase, op.local_microbatch, op.kernel_index, op.piece): i for i, op in enumerate(ops)
    }
    first: dict[tuple, int] = {}
    for op in fixed:
        key = (op.event, op.phase, op.local_microbatch)
        first[key] = min(
            first.get(key, len(ops)),
            rank[(op.phase, op.local_microbatch, op.kernel_index, op.piece)],
        )
    return tuple(
        sorted(
            fixed,
            key=lambda op: (
                position[op.event],
                first[(op.event, op.phase, op.local_microbatch)],
                op.kernel_index,
                op.piece,
            ),
        )
    )


def _stage_events(
    stage: int, order: list[tuple[int, int, str]], kernels: dict, observable: frozenset[str]
):
    events: list[Event] = [PRE]
    for k, (_, chunk, phase) in enumerate(order):
        events.append(("op_start", k))
        for n in range(
            len(_observed_collectives(kernels[f"{stage}/{chunk}/{phase}"], phase, observable))
        ):
            events += [("tp_before", k, n), ("tp_after", k, n)]
        events.append(("op_end", k))
    events.append(POST)
    return tuple(events)


def planned_collectives(
    artifact: dict[str, Any],
    stage: int,
    order: list[tuple[int, int, str]],
    observable: frozenset[str] = OBSERVABLE_COLLECTIVES,
) -> dict[int, list[str]]:
    """Per forward op of ``stage`` (index in ``order``): its observable TP collectives, in order."""
    return {
        k: _observed_collectives(artifact["llm_kernels"][f"{stage}/{chunk}/fwd"], phase, observable)
        for k, (_, chunk, phase) in enumerate(order)
        if phase == "fwd"
    }


def _observed_collectives(names: list[str], phase: str, observable: frozenset[str]) -> list[str]:
    # backward collectives run inside autograd, where no hook is reached: only op boundaries there
    return [name for name in names if name in observable] if phase == "fwd" else []


class _HookMapper:
    """Maps an artifact hook to the last observable event at or before the moment it names."""

    def __init__(
        self,
        stage: int,
        order: list[tuple[int, int, str]],
        kernels: dict,
        observable: frozenset[str],
    ):
        self.stage, self.kernels, self.observable = stage, kernels, observable
        self.index = {op: k for k, op in enumerate(order)}

    def event(self, hook: dict[str, Any]) -> Event:
        if hook["at"] == "before_first_compute":
            return PRE
        if hook["at"] == "after_last_compute":
            return POST
        phase, chunk = hook["phase"], hook["chunk"]
        k = self.index[(hook["microbatch"], chunk, phase)]
        names = self.kernels[f"{self.stage}/{chunk}/{phase}"]
        x = hook["kernel_index"]
        observed = [i for i, name in enumerate(names) if phase == "fwd" and name in self.observable]
        if x in observed:  # under the collective, or right after it
            return ("tp_after" if hook["after"] else "tp_before", k, observed.index(x))
        if hook["after"] and x == len(names) - 1:
            return ("op_end", k)
        earlier = [i for i in observed if i < x]
        return ("tp_after", k, len(earlier) - 1) if earlier else ("op_start", k)


# --------------------------------------------------------------------------------------------
# deadlock check and repair


def _repair(plan: HookPlan, artifact: dict[str, Any]) -> HookPlan:
    moved: list[tuple[int, str]] = []
    while True:
        stuck = _stuck_microbatches(plan, artifact)
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
                    plan.events[st.llm_stage],
                ),
            )
            for st in plan.stages
        )
        plan = replace(plan, stages=stages)
        moved.append((microbatch, phase))


def _reordered(ops: tuple[PlannedOp, ...], events: tuple[Event, ...]) -> tuple[PlannedOp, ...]:
    position = {e: i for i, e in enumerate(events)}
    # stable: chain order kept within an event
    return tuple(sorted(ops, key=lambda op: position[op.event]))


def _stuck_microbatches(plan: HookPlan, artifact: dict[str, Any]) -> set[tuple[int, str]]:
    """(microbatch, phase) of encoder work on a wait cycle; empty when the placement cannot
    deadlock."""
    nodes: dict[tuple[int, Event, str], int] = {}
    for s, events in plan.events.items():
        for e in events:
            for kind in ("arrive", "done"):
                nodes[(s, e, kind)] = len(nodes)
    edges: dict[int, list[int]] = defaultdict(list)
    owner: dict[int, set[tuple[int, str]]] = defaultdict(set)

    def edge(a: tuple, b: tuple) -> None:
        edges[nodes[a]].append(nodes[b])

    for s, events in plan.events.items():  # program order
        for a, b in zip(events, events[1:]):
            edge((s, a, "arrive"), (s, a, "done"))
            edge((s, a, "done"), (s, b, "arrive"))
        edge((s, events[-1], "arrive"), (s, events[-1], "done"))
    pp, vp = artifact["llm_plan"]["pp"], artifact["llm_plan"]["vp"]
    where = {s: {op: k for k, op in enumerate(order)} for s, order in plan.op_order.items()}
    for s, order in plan.op_order.items():  # the LLM's own P2P: an op needs its producer's output
        for k, (mb, chunk, phase) in enumerate(order):
            producer = pipeline_producer(s, chunk, phase, pp, vp)
            if producer is not None:
                ps, pchunk = producer
                pk = where[ps][(mb, pchunk, phase)]
                edge((ps, ("op_end", pk), "arrive"), (s, _after_start(plan.events[s], k), "arrive"))
    chains: dict[tuple[int, int, int, str], list[Event]] = defaultdict(list)
    for st in plan.stages:
        for op in st.ops:
            chains[(st.encoder_pipeline, st.encoder_stage, op.local_microbatch, op.phase)].append(
                op.event
            )
            owner[nodes[(st.llm_stage, op.event, "done")]].add((op.microbatch, op.phase))
    llm_stage = {(st.encoder_pipeline, st.encoder_stage): st.llm_stage for st in plan.stages}
    last = max(e for _, e in llm_stage)
    for i, (j, k) in enumerate(artifact["assignment"]):
        for e in range(last + 1):  # the encoder pipeline's own P2P, forward then backward
            if e > 0:
                edge(
                    (llm_stage[(j, e - 1)], chains[(j, e - 1, k, "fwd")][-1], "done"),
                    (llm_stage[(j, e)], chains[(j, e, k, "fwd")][0], "done"),
                )
            if e < last and chains.get((j, e, k, "bwd")):
                edge(
                    (llm_stage[(j, e + 1)], chains[(j, e + 1, k, "bwd")][-1], "done"),
                    (llm_stage[(j, e)], chains[(j, e, k, "bwd")][0], "done"),
                )
        first_fwd = where[0][(i, 0, "fwd")]  # A_i into the first LLM stage's chunk 0
        edge(
            (llm_stage[(j, last)], chains[(j, last, k, "fwd")][-1], "done"),
            (0, _after_start(plan.events[0], first_fwd), "arrive"),
        )
        if chains.get((j, last, k, "bwd")):  # G_i out of it
            last_bwd = where[0][(i, 0, "bwd")]
            edge(
                (0, ("op_end", last_bwd), "arrive"),
                (llm_stage[(j, last)], chains[(j, last, k, "bwd")][0], "done"),
            )
    remaining = _nodes_on_or_after_cycles(len(nodes), edges)
    return {mb_phase for node in remaining for mb_phase in owner.get(node, ())}


def _after_start(events: tuple[Event, ...], k: int) -> Event:
    """The event right after op k starts: where the LLM has needed its input."""
    return events[events.index(("op_start", k)) + 1]


def _nodes_on_or_after_cycles(n: int, edges: dict[int, list[int]]) -> set[int]:
    """Kahn's algorithm: the nodes never freed are on a cycle or wait behind one."""
    indegree = [0] * n
    for targets in edges.values():
        for b in targets:
            indegree[b] += 1
    ready = [v for v in range(n) if indegree[v] == 0]
    freed = 0
    while ready:
        v = ready.pop()
        freed += 1
        for b in edges.get(v, ()):
            indegree[b] -= 1
            if indegree[b] == 0:
                ready.append(b)
    return {v for v in range(n) if indegree[v] > 0} if freed < n else set()
