"""Encoder work as ops of about one kernel each, with explicit per-op forward and backward.

A model describes one encoder stage as ``Block``s (patch embedding, one transformer layer, the
projector), each a chain of ``Step``s: small differentiable functions over a named activation
state (``hidden``, ``residual``). A step names the cost model's kernel it belongs to in forward and
in backward, or None where it launches no kernel of its own in that direction (a residual add, the
identity side of a tensor-parallel collective); such a step rides with a neighbouring kernel of its
block, the previous one when there is one. Grouping the steps by kernel gives the ``EncoderOp``s
the bubble scheduler places, in the order of ``encoder_costs.build_encoder_work``'s stage chains
(with TP > 1 the backward collectives sit where their data is ready, see ``vit``).

Per-op backward: a forward op keeps, per compute step, its inputs and its outputs' graph; the
backward op calls ``torch.autograd.backward`` on those outputs with their gradients, which
accumulates parameter ``.grad`` and leaves the input gradients on the op's detached inputs (autograd
leaves) for the op before it, then drops them. A collective step has an explicit adjoint and saves
nothing. So any prefix of a microbatch's ops can run now and the rest later, microbatches
interleaved, and the gradients are those of ordinary autograd through the whole stage. With
recomputation a layer's forward keeps only the state entering the recomputed part; the
``recompute_*`` ops rebuild it.

Host cost: an autograd call per op is host work the GPU waits for at small kernels. Backward ops
that run together (a hook point's consecutive ops, declared up front: ``MicrobatchRun``'s
``backward_runs``) share one graph, cut only at the run's edges, and one autograd call (a collective
inside it runs its adjoint as an autograd function).

Pieces: a splittable op (a transformer layer's compute kernels, without dropout) also runs as pieces
of its tokens (rows of dim 0), each a ``Piece`` of fractions, in order from 0 to 1, so that a kernel
can be cut to fit short bubbles. A piece of a forward op runs its steps on the piece's rows
(attention: the piece's queries against every key) and keeps only the op's inputs. A piece of a
backward op takes a GEMM's gradients directly from the saved input and recomputes any other step on
the piece's rows, so the forward and backward of one microbatch may be cut differently; the
gradients are autograd's, summed over the pieces.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch

from optimus_mllm.config import Recompute

Tensor = torch.Tensor
OpKind = Literal["forward", "recompute", "backward"]
HIDDEN = "hidden"  # the one state entry that enters and leaves every block
Piece = tuple[float, float]  # [lo, hi): a share of an op's tokens, as fractions of its rows
WHOLE: Piece = (0.0, 1.0)


@dataclass(frozen=True)
class Step:
    """One differentiable piece of a block: ``forward(*state[reads]) -> state[writes]``.

    ``adjoint`` set makes it a collective: run under no_grad, its backward is
    ``adjoint(*grads of writes) -> grads of reads``; otherwise autograd differentiates ``forward``.
    ``seeded`` (dropout): ``forward(seed, *state[reads])`` with the microbatch's dropout seed, so
    that a recomputed forward draws the same masks.

    Pieces of tokens (rows of dim 0): ``tokenwise``, each output row depends on the same rows of
    every input only; ``query_rows(seed, rows, *whole inputs)`` gives the outputs' rows ``rows``
    (attention: those queries against every key); ``linear`` = (weight, bias) of a step that is
    ``F.linear`` of its input, whose piece backward then takes the gradients directly instead of
    recomputing the piece.
    """

    forward: Callable[..., tuple[Tensor, ...]]
    fwd_kernel: str | None
    bwd_kernel: str | None
    reads: tuple[str, ...] = (HIDDEN,)
    writes: tuple[str, ...] = (HIDDEN,)
    trainable: bool = False  # uses parameters that want gradients
    adjoint: Callable[..., tuple[Tensor, ...]] | None = None
    seeded: bool = False
    tokenwise: bool = False
    query_rows: Callable[..., tuple[Tensor, ...]] | None = None
    linear: tuple[Tensor, Tensor | None] | None = None

    def run(self, seed: int, *inputs: Tensor) -> tuple[Tensor, ...]:
        return self.forward(seed, *inputs) if self.seeded else self.forward(*inputs)

    @property
    def is_collective(self) -> bool:
        return self.adjoint is not None


@dataclass(frozen=True)
class Block:
    """Steps that the cost model counts as one unit: ``layer`` -1 is the patch embedding or
    projector."""

    encoder: str
    layer: int
    steps: tuple[Step, ...]
    input_requires_grad: bool  # whether the stage needs the gradient of this block's input


@dataclass(frozen=True)
class BoundStep:
    """A step at its place in a stage: which of its inputs need gradients, whether it has a
    backward."""

    step: Step
    needs_grad: tuple[bool, ...]  # per entry of step.reads

    @property
    def differentiated(self) -> bool:
        return self.step.trainable or any(self.needs_grad)


@dataclass(frozen=True)
class EncoderOp:
    """One schedulable encoder op: the steps run for one kernel of the cost model's stage chain."""

    encoder: str
    layer: int
    name: str  # the cost model's kernel name (``recompute_`` + forward name for recomputation)
    is_comm: bool
    kind: OpKind
    steps: tuple[int, ...]  # indices into StageOps.steps, in execution order
    block: int  # index of the block in the stage
    record: bool = True  # forward: keep what the backward needs (False: no backward, or recomputed)
    checkpoint: bool = False  # forward: keep the entering state; recompute: restart from it
    splittable: bool = False  # runs as pieces of its tokens (a compute op, not a recomputation)


@dataclass(frozen=True)
class StageOps:
    """The forward and backward op chains of one encoder stage for one microbatch."""

    steps: tuple[BoundStep, ...]
    fwd: tuple[EncoderOp, ...]
    bwd: tuple[EncoderOp, ...]
    encoders: tuple[str, ...]  # in stage order
    input_grad_encoders: frozenset[str]  # encoders whose stage input gets a gradient
    output_grad_encoders: frozenset[str]  # encoders whose stage output needs a gradient
    # per step, per entry it reads: the step that wrote it (None: the stage's input)
    producers: tuple[tuple[int | None, ...], ...]

    def chain(self, phase: Literal["fwd", "bwd"]) -> list[tuple[str, int, str, bool]]:
        """(encoder, layer, kernel name, splittable) per op: comparable with a cost-model stage
        chain."""
        return [
            (op.encoder, op.layer, op.name, op.splittable)
            for op in (self.fwd if phase == "fwd" else self.bwd)
        ]


def build_stage_ops(blocks: Sequence[Block], recompute: Recompute = "none") -> StageOps:
    """Group a stage's blocks into ops, in the cost model's chain order.

    Forward: every block in stage order. Backward: per encoder, its blocks in reverse, each block's
    differentiated steps in reverse; ``recompute`` ("selective": the attention core, "full": whole
    layers) adds the ``recompute_*`` ops where ``cost_model.layer_kernels`` puts them.
    """
    steps: list[BoundStep] = []
    fwd: list[EncoderOp] = []
    bwd: dict[str, list[EncoderOp]] = {}
    input_grad: set[str] = set()
    producers: list[tuple[int | None, ...]] = []
    writer: dict[tuple[str, str], int] = {}  # (encoder, entry) -> the step that wrote it last
    for index, block in enumerate(blocks):
        if block.encoder not in bwd and block.input_requires_grad:  # the encoder's first block here
            input_grad.add(block.encoder)
        first = len(steps)
        steps += _bind(block)
        ids = range(first, len(steps))
        for i in ids:
            producers.append(tuple(writer.get((block.encoder, key)) for key in steps[i].step.reads))
            writer.update(((block.encoder, key), i) for key in steps[i].step.writes)
        block_fwd = _group(block, index, "forward", [(i, steps[i].step) for i in ids])
        diff = [(i, steps[i].step) for i in reversed(ids) if steps[i].differentiated]
        block_bwd = _group(block, index, "backward", diff)
        block_fwd, block_bwd = _with_recompute(block, block_fwd, block_bwd, recompute)
        fwd += block_fwd
        bwd.setdefault(block.encoder, [])[:0] = block_bwd  # blocks run backward in reverse
    encoders = tuple(bwd)  # insertion order: stage order
    return StageOps(
        steps=tuple(steps),
        fwd=tuple(fwd),
        bwd=tuple(op for enc in encoders for op in bwd[enc]),
        encoders=encoders,
        input_grad_encoders=frozenset(input_grad),
        output_grad_encoders=frozenset(enc for enc in encoders if bwd[enc]),
        producers=tuple(producers),
    )


def _bind(block: Block) -> list[BoundStep]:
    """Follow which state entries need gradients through the block's steps."""
    needs = {HIDDEN: block.input_requires_grad}
    bound = []
    for step in block.steps:
        flags = tuple(needs.pop(key) for key in step.reads)
        out = step.trainable or any(flags)
        needs.update((key, out) for key in step.writes)
        bound.append(BoundStep(step, flags))
    return bound


def _group(
    block: Block, index: int, kind: OpKind, items: list[tuple[int, Step]]
) -> list[EncoderOp]:
    """One op per kernel; a step without a kernel joins the previous op of the block, else the
    next."""
    ops: list[EncoderOp] = []
    pending: list[int] = []
    for i, step in items:
        kernel = step.fwd_kernel if kind == "forward" else step.bwd_kernel
        if kernel is None:
            if ops:
                ops[-1] = replace(ops[-1], steps=(*ops[-1].steps, i))
            else:
                pending.append(i)
            continue
        ops.append(
            EncoderOp(
                block.encoder, block.layer, kernel, step.is_collective, kind, (*pending, i), index
            )
        )
        pending = []
    if pending:
        raise ValueError(f"{block.encoder} layer {block.layer}: {kind} steps without any kernel")
    steps = dict(items)
    return [replace(op, splittable=_splittable(op, [steps[i] for i in op.steps])) for op in ops]


def _splittable(op: EncoderOp, steps: list[Step]) -> bool:
    """Pieces of tokens: every step tokenwise, or one attention step alone (its piece reads every
    row)."""
    if op.is_comm:
        return False
    return all(step.tokenwise for step in steps) or (
        len(steps) == 1 and steps[0].query_rows is not None
    )


def _with_recompute(
    block: Block, fwd: list[EncoderOp], bwd: list[EncoderOp], recompute: Recompute
) -> tuple[list[EncoderOp], list[EncoderOp]]:
    """Forward ops as they record, and the block's backward ops with recomputation inserted."""
    if not bwd:
        return [replace(op, record=False) for op in fwd], []
    if block.layer < 0 or recompute == "none":
        return fwd, bwd
    if recompute == "full":
        redo = [
            replace(
                op,
                kind="recompute",
                name="recompute_" + op.name,
                checkpoint=i == 0,
                splittable=False,
            )
            for i, op in enumerate(fwd)
        ]
        return [
            replace(op, record=False, checkpoint=i == 0) for i, op in enumerate(fwd)
        ], redo + bwd
    # selective (Korthikanti et al.): only the attention core, just before its backward
    out_fwd, out_bwd = list(fwd), list(bwd)
    for i, op in enumerate(fwd):
        if op.name != "attn_core":
            continue
        out_fwd[i] = replace(op, record=False, checkpoint=True)
        at = next(j for j, b in enumerate(out_bwd) if set(b.steps) & set(op.steps))
        out_bwd.insert(
            at,
            replace(
                op, kind="recompute", name="recompute_attn_core", checkpoint=True, splittable=False
            ),
        )
    return out_fwd, out_bwd


@dataclass
class _OpenOp:
    """A split op part-way: the state entries (forward) or gradients (backward) it took, its outputs
    so far (row blocks, or whole-shaped sums), and its steps' inputs so far (forward: row blocks, or
    the whole input of an attention step)."""

    entering: dict[str, Tensor]
    rows: int
    blocks: dict[str, list[Tensor]] = field(default_factory=dict)
    sums: dict[str, Tensor] = field(default_factory=dict)
    inputs: dict[int, list[list[Tensor]]] = field(default_factory=dict)

    @classmethod
    def of(cls, entering: dict[str, Tensor]) -> _OpenOp:
        sizes = {x.shape[0] for x in entering.values()}
        if len(sizes) > 1:
            raise ValueError(
                f"a split op's inputs have {sorted(sizes)} rows; its pieces need one count"
            )
        return cls(entering, sizes.pop() if sizes else 0)

    def slice(self, piece: Piece) -> slice:
        return slice(round(piece[0] * self.rows), round(piece[1] * self.rows))


def _taken(op: EncoderOp, steps: tuple[BoundStep, ...], kind: OpKind) -> list[str]:
    """The entries an op takes: those its steps read (forward) or whose gradients they take
    (backward) before one of its own steps makes them."""
    made: set[str] = set()
    taken: list[str] = []
    for i in op.steps:
        step = steps[i].step
        takes, makes = (step.reads, step.writes) if kind == "forward" else (step.writes, step.reads)
        taken += [key for key in takes if key not in made and key not in taken]
        made.update(makes)
    return taken


def _backward_groups(ops: StageOps, runs: Sequence[range]) -> tuple[int, ...]:
    """Per step, the group whose backward runs as one autograd call (-1: a step without backward):
    the steps of each sub-run of one encoder's consecutive backward ops in one of ``runs`` (a
    recomputation ends one), and those of every other backward op alone."""
    run_of = {k: run.start for run in runs for k in run}
    group = [-1] * len(ops.steps)
    current, last = -1, None
    for k, op in enumerate(ops.bwd):
        if op.kind == "recompute":
            last = None
            continue
        key = (run_of.get(k, -1 - k), op.encoder)
        if key != last:
            current, last = current + 1, key
        for i in op.steps:
            group[i] = current
    return tuple(group)


@dataclass
class _Segment:
    """Backward steps of one group, gathered for one ``torch.autograd.backward``: the outputs whose
    gradients come from outside it (``roots``), the inputs it hands gradients out from
    (``leaves``), and the entries whose gradients flow between its own steps inside the graph
    (``inside``: read joined, their writer not added yet)."""

    grads: dict[str, Tensor]
    roots: list[tuple[Tensor, Tensor]] = field(default_factory=list)
    leaves: dict[str, Tensor] = field(default_factory=dict)
    inside: set[str] = field(default_factory=set)

    def add(
        self,
        bound: BoundStep,
        inputs: list[Tensor],
        outputs: tuple[Tensor, ...],
        joined: tuple[bool, ...],
    ) -> None:
        """The next step, in backward order."""
        step = bound.step
        for key, out in zip(step.writes, outputs):
            if key in self.inside:
                self.inside.discard(key)
                continue
            if key in self.leaves:  # read as a fresh leaf by a later step of this segment
                if not out.requires_grad:  # nothing to take that leaf's gradient
                    del self.leaves[key]
                    continue
                self.flush()
            g = self.grads.pop(key, None)
            if g is not None and out.requires_grad:
                self.roots.append((out, g))
        for key, x, flag, joined_ in zip(step.reads, inputs, bound.needs_grad, joined):
            if joined_:
                self.inside.add(key)
            elif flag:
                self.leaves[key] = x

    def flush(self) -> None:
        """One autograd call over the steps added; their input gradients into ``grads``."""
        if self.inside:
            raise RuntimeError(
                f"the backward of {sorted(self.inside)} was cut from the steps that wrote them: "
                "ops whose forward joined them must run their backward together"
            )
        if self.roots:
            torch.autograd.backward([out for out, _ in self.roots], [g for _, g in self.roots])
        self.grads.update((key, leaf.grad) for key, leaf in self.leaves.items())
        self.roots, self.leaves = [], {}


class MicrobatchRun:
    """One microbatch on one encoder stage, advanced one op at a time.

    Forward ops run in chain order (``run_forward(k)`` with k = 0, 1, ...), at any moments; once all
    have run, ``output`` is the stage's output per encoder (send it on, or feed it to the LLM after
    the projector). ``set_output_grad`` takes the gradient of that output from the next stage or the
    LLM; the backward ops then run in their chain order, and ``input_grad`` is what to send to the
    previous stage (None on stage 0 and for frozen encoders). Parameter gradients accumulate into
    ``.grad`` as each backward op runs, so microbatches may interleave freely. ``seed`` seeds the
    microbatch's dropout masks (``dropout.microbatch_seed``).

    Host cost: the steps of one backward op, or of a run of consecutive backward ops the caller
    declares in ``backward_runs`` and runs with ``run_backward_range`` (whole, at one hook point),
    form a group. The forward keeps one autograd graph across a group's steps instead of cutting it
    at every step (a step reads its group's entries as they are, not as fresh leaves), so that the
    group's backward is one ``torch.autograd.backward`` call, with the same gradients. A forward op
    that runs in pieces has no graph: from then on its groups' steps cut theirs again.
    """

    def __init__(
        self,
        ops: StageOps,
        inputs: Mapping[str, Tensor],
        seed: int,
        backward_runs: Sequence[range] = (),
    ):
        if set(inputs) != set(ops.encoders):
            raise ValueError(
                f"inputs for encoders {sorted(inputs)}, this stage runs {list(ops.encoders)}"
            )
        self.ops, self.seed = ops, seed
        self._runs: dict[int, range] = {}  # backward op -> the declared run it is in
        for run in backward_runs:
            inside = run.step == 1 and 0 <= run.start and run.stop <= len(ops.bwd)
            if not inside or self._runs.keys() & set(run):
                raise ValueError(f"backward runs {list(backward_runs)} overlap or leave the chain")
            self._runs.update((k, run) for k in run if len(run) > 1)
        self._group = _backward_groups(ops, backward_runs)
        self._group_sizes: dict[int, int] = {}
        for g in self._group:
            self._group_sizes[g] = self._group_sizes.get(g, 0) + 1
        self._cut: set[int] = set()  # groups a forward in pieces cut
        self._state = {enc: {HIDDEN: inputs[enc].detach()} for enc in ops.encoders}
        self._grads: dict[str, dict[str, Tensor]] = {enc: {} for enc in ops.encoders}
        # per step: its inputs, the outputs of its forward graph (None: it ran in pieces, without
        # one) and which inputs it read joined to their writer's graph
        self._saved: dict[int, tuple[list[Tensor], tuple[Tensor, ...] | None, tuple[bool, ...]]]
        self._saved = {}
        self._checkpoints: dict[int, dict[str, Tensor]] = {}
        self._recompute: dict[str, dict[str, Tensor]] = {}
        self._next_fwd = 0
        self._next_bwd = 0
        self._fwd_at = self._bwd_at = 0.0  # how far into its tokens the next op has run
        self._open: _OpenOp | None = None  # the split op part-way
        self._has_output_grad = False

    @property
    def next_forward(self) -> int:
        return self._next_fwd

    @property
    def next_backward(self) -> int:
        return self._next_bwd

    @property
    def forward_done(self) -> bool:
        return self._next_fwd == len(self.ops.fwd)

    @property
    def backward_done(self) -> bool:
        return self._has_output_grad and self._next_bwd == len(self.ops.bwd)

    @property
    def output_grad_set(self) -> bool:
        return self._has_output_grad

    @property
    def output(self) -> dict[str, Tensor]:
        if not self.forward_done:
            raise RuntimeError(
                f"output before the forward finished ({self._next_fwd}/{len(self.ops.fwd)} ops)"
            )
        return {enc: state[HIDDEN].detach() for enc, state in self._state.items()}

    def set_output_grad(self, grads: Mapping[str, Tensor]) -> None:
        """Gradient of ``output`` for every encoder in ``ops.output_grad_encoders`` (others
        ignored)."""
        if not self.forward_done:
            raise RuntimeError("output gradient before the forward finished")
        missing = self.ops.output_grad_encoders - set(grads)
        if missing:
            raise ValueError(f"no output gradient for encoders {sorted(missing)}")
        for enc in self.ops.output_grad_encoders:
            self._grads[enc] = {HIDDEN: grads[enc]}
        self._has_output_grad = True

    @property
    def input_grad(self) -> dict[str, Tensor | None]:
        if not self.backward_done:
            raise RuntimeError(
                f"input gradient before the backward finished "
                f"({self._next_bwd}/{len(self.ops.bwd)} ops)"
            )
        return {
            enc: self._grads[enc].get(HIDDEN) if enc in self.ops.input_grad_encoders else None
            for enc in self.ops.encoders
        }

    def run_forward(self, k: int, piece: Piece = WHOLE) -> None:
        """Run forward op ``k`` of the stage chain, or the piece ``piece`` of its tokens; ops run in
        order, a split op's pieces from 0 to 1."""
        op = self._check("forward", self.ops.fwd, k, self._next_fwd, self._fwd_at, piece)
        state = self._state[op.encoder]
        if op.checkpoint and piece[0] == 0.0:
            self._checkpoints[op.block] = dict(state)
        if piece == WHOLE:
            for i in op.steps:
                self._forward_step(i, state, op.record)
        else:
            self._forward_piece(op, state, piece)
        self._fwd_at = 0.0 if piece[1] == 1.0 else piece[1]
        self._next_fwd += piece[1] == 1.0

    def run_backward(self, k: int, piece: Piece = WHOLE) -> None:
        """Run backward op ``k`` of the stage chain (recomputation included), or the piece ``piece``
        of its tokens; ops run in order, a split op's pieces from 0 to 1."""
        if k in self._runs:
            run = self._runs[k]
            raise ValueError(
                f"backward op {k} was declared to run with ops {run.start}..{run.stop - 1}: "
                "run_backward_range"
            )
        self._run_backward(range(k, k + 1), piece)

    def run_backward_range(self, ks: range) -> None:
        """Run backward ops ``ks`` whole, in order: one op, or a run declared in ``backward_runs``
        (its groups' backward one autograd call each)."""
        if len(ks) == 1:
            self.run_backward(ks.start)
        elif self._runs.get(ks.start) != ks:
            raise ValueError(f"backward ops {list(ks)} were not declared a run (backward_runs)")
        else:
            self._run_backward(ks, WHOLE)

    def _run_backward(self, ks: range, piece: Piece) -> None:
        if not self._has_output_grad:
            raise RuntimeError("backward before set_output_grad")
        chain = [
            self._check("backward", self.ops.bwd, k, self._next_bwd + n, self._bwd_at, piece)
            for n, k in enumerate(ks)
        ]
        segment: _Segment | None = None
        for op in chain:
            grads = self._grads[op.encoder]
            if segment is None or segment.grads is not grads:
                if segment is not None:
                    segment.flush()
                segment = _Segment(grads)
            if op.kind == "recompute":
                segment.flush()
                if op.checkpoint:
                    self._recompute[op.encoder] = self._checkpoints.pop(op.block)
                for i in op.steps:
                    self._forward_step(i, self._recompute[op.encoder], True)
            elif piece != WHOLE or any(
                self._saved[i][1] is None for i in op.steps if i in self._saved
            ):  # a piece, or a forward that ran in pieces and kept no graph
                segment.flush()
                self._backward_piece(op, piece)
            else:
                for i in op.steps:
                    if i in self._saved:
                        segment.add(self.ops.steps[i], *self._saved.pop(i))
                    else:  # a collective outside any graph: its adjoint
                        segment.flush()
                        self._adjoint(i, grads)
        if segment is not None:
            segment.flush()
        self._bwd_at = 0.0 if piece[1] == 1.0 else piece[1]
        self._next_bwd += len(ks) - (piece[1] != 1.0)
        if self.backward_done:
            self._recompute.clear()

    def _check(
        self, kind: str, chain: tuple[EncoderOp, ...], k: int, next_k: int, at: float, piece: Piece
    ) -> EncoderOp:
        if k != next_k:
            raise ValueError(f"{kind} op {k} requested, op {next_k} is next")
        if piece[0] != at or not piece[0] < piece[1] <= 1.0:
            raise ValueError(
                f"{kind} op {k}: piece {piece} requested, its tokens from {at} on are next"
            )
        op = chain[k]
        if piece != WHOLE and not op.splittable:
            raise ValueError(f"{kind} op {k} ({op.name}) does not run in pieces")
        return op

    def _forward_piece(self, op: EncoderOp, state: dict[str, Tensor], piece: Piece) -> None:
        """Rows ``piece`` of a forward op, without autograd: its steps' inputs are kept for the
        backward."""
        if piece[0] == 0.0:
            self._open = _OpenOp.of(
                {key: state.pop(key) for key in _taken(op, self.ops.steps, "forward")}
            )
            self._cut.update(self._group[i] for i in op.steps)  # no graph to join from here on
        open_ = self._open
        rows = open_.slice(piece)
        local = {key: x[rows] for key, x in open_.entering.items()}
        with torch.no_grad():
            # a piece of no whole row runs nothing
            for i in op.steps if rows.start < rows.stop else ():
                bound = self.ops.steps[i]
                step = bound.step
                inputs = [local.pop(key) for key in step.reads]
                if step.query_rows is not None:  # the op's only step: every row of its input
                    inputs = [open_.entering[key] for key in step.reads]
                    outputs = step.query_rows(self.seed, rows, *inputs)
                else:
                    outputs = step.run(self.seed, *inputs)
                if op.record and bound.differentiated and not step.is_collective:
                    kept = open_.inputs.setdefault(i, [[] for _ in step.reads])
                    for parts, x in zip(kept, inputs):
                        parts[:] = [x] if step.query_rows is not None else [*parts, x]
                local.update(zip(step.writes, outputs))
        if rows.start < rows.stop:
            for key, x in local.items():
                open_.blocks.setdefault(key, []).append(x)
        if piece[1] == 1.0:
            state.update((key, torch.cat(parts)) for key, parts in open_.blocks.items())
            for i, kept in open_.inputs.items():
                self._saved[i] = ([torch.cat(parts) for parts in kept], None, ())
            self._open = None

    def _backward_piece(self, op: EncoderOp, piece: Piece) -> None:
        """Rows ``piece`` of a backward op: the gradients of the op's inputs, row by row (an
        attention piece: summed over every row), and its parameters' gradients accumulated through
        autograd."""
        grads = self._grads[op.encoder]
        if piece[0] == 0.0:
            taken = _taken(op, self.ops.steps, "backward")
            self._open = _OpenOp.of({key: grads.pop(key) for key in taken if key in grads})
        open_ = self._open
        rows = open_.slice(piece)
        local = {key: g[rows] for key, g in open_.entering.items()}
        for i in op.steps if rows.start < rows.stop else ():
            bound = self.ops.steps[i]
            step = bound.step
            in_grads = self._input_grads(i, [local.pop(key, None) for key in step.writes], rows)
            for key, g, flag in zip(step.reads, in_grads, bound.needs_grad):
                if not flag or g is None:
                    continue
                if step.query_rows is not None:
                    open_.sums[key] = open_.sums[key] + g if key in open_.sums else g
                else:
                    local[key] = g
        if rows.start < rows.stop:
            for key, g in local.items():
                open_.blocks.setdefault(key, []).append(g)
        if piece[1] == 1.0:
            grads.update((key, torch.cat(parts)) for key, parts in open_.blocks.items())
            grads.update(open_.sums)
            for i in op.steps:
                self._saved.pop(i, None)
            self._open = None

    def _step_backward_rows(self, index: int, rows: slice, out_grads: list[Tensor | None]) -> tuple:
        """One step's backward on ``rows`` from its saved input: a GEMM's gradients directly, any
        other step's by autograd through its forward recomputed on those rows."""
        bound = self.ops.steps[index]
        step = bound.step
        inputs = [x.detach() for x in self._saved[index][0]]
        if all(g is None for g in out_grads):
            return tuple(None for _ in step.reads)
        if step.linear is not None:  # y = x W^T + b
            (x,), (g,) = inputs, out_grads
            weight, bias = step.linear
            x, g2 = x[rows].flatten(0, -2), g.flatten(0, -2)
            with torch.no_grad():
                roots = [(weight, g2.t() @ x)] if weight.requires_grad else []
                if bias is not None and bias.requires_grad:
                    roots.append((bias, g2.sum(0)))
                input_grad = g @ weight if bound.needs_grad[0] else None
            if roots:  # through autograd, so that the parameters' gradient hooks (DDP) run
                torch.autograd.backward([p for p, _ in roots], [d for _, d in roots])
            return (input_grad,)
        whole = step.query_rows is not None
        leaves = [
            (x if whole else x[rows]).requires_grad_(flag)
            for x, flag in zip(inputs, bound.needs_grad)
        ]
        with torch.enable_grad():
            outputs = (
                step.query_rows(self.seed, rows, *leaves) if whole else step.run(self.seed, *leaves)
            )
        roots = [
            (out, g) for out, g in zip(outputs, out_grads) if g is not None and out.requires_grad
        ]
        if roots:
            torch.autograd.backward([out for out, _ in roots], [g for _, g in roots])
        return tuple(leaf.grad for leaf in leaves)

    def _forward_step(self, index: int, state: dict[str, Tensor], record: bool) -> None:
        bound = self.ops.steps[index]
        step = bound.step
        inputs = [state.pop(key) for key in step.reads]
        group = self._group[index]
        # a collective joins its group's graph (its adjoint inside); alone, it runs its adjoint
        if (
            record
            and bound.differentiated
            and (not step.is_collective or self._group_sizes[group] > 1)
        ):
            joined = tuple(self._joined(index, r, x) for r, x in enumerate(inputs))
            args = [
                x if j else x.detach().requires_grad_(flag)
                for x, j, flag in zip(inputs, joined, bound.needs_grad)
            ]
            with torch.enable_grad():
                outputs = (
                    _CollectiveFunction.apply(step, *args)
                    if step.is_collective
                    else step.run(self.seed, *args)
                )
            self._saved[index] = (args, outputs, joined)
        else:
            with torch.no_grad():
                outputs = step.run(self.seed, *inputs)
        state.update(zip(step.writes, outputs))

    def _joined(self, index: int, read: int, x: Tensor) -> bool:
        """Whether step ``index`` reads its ``read``-th input as it is, in its writer's graph: the
        writer kept one and is of the same group, which no forward in pieces cut."""
        writer, group = self.ops.producers[index][read], self._group[index]
        return (
            x.requires_grad
            and writer is not None
            and self._group[writer] == group
            and group not in self._cut
        )

    def _adjoint(self, index: int, grads: dict[str, Tensor]) -> None:
        """A collective step's backward outside any graph: its explicit adjoint."""
        bound = self.ops.steps[index]
        step = bound.step
        assert step.adjoint is not None, f"step {index} kept no graph and is no collective"
        with torch.no_grad():
            in_grads = step.adjoint(*(grads.pop(key, None) for key in step.writes))
        grads.update(
            (key, g) for key, g, flag in zip(step.reads, in_grads, bound.needs_grad) if flag
        )

    def _input_grads(self, index: int, out_grads: list[Tensor | None], rows: slice) -> tuple:
        """A step's input gradients on ``rows`` from its outputs': a collective's adjoint, else from
        the step's saved input (``_step_backward_rows``)."""
        step = self.ops.steps[index].step
        if step.adjoint is not None:
            with torch.no_grad():
                return step.adjoint(*out_grads)
        return self._step_backward_rows(index, rows, out_grads)


class _CollectiveFunction(torch.autograd.Function):
    """A collective step inside an ordinary autograd graph: forward, then its explicit adjoint."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, step: Step, *inputs: Tensor
    ) -> tuple[Tensor, ...]:
        ctx.step = step
        return step.forward(*inputs)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        return (None, *ctx.step.adjoint(*grads))


def run_steps(steps: Sequence[Step], x: Tensor, seed: int) -> Tensor:
    """All steps at once as one autograd graph: the whole-module forward that ops must match."""
    state = {HIDDEN: x}
    for step in steps:
        inputs = [state.pop(key) for key in step.reads]
        outputs = (
            _CollectiveFunction.apply(step, *inputs)
            if step.is_collective
            else step.run(seed, *inputs)
        )
        state.update(zip(step.writes, outputs))
    return state[HIDDEN]
