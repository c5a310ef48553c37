"""Independent checks that a schedule is executable, recomputed from its kernels, not from the
scheduler's state."""

from __future__ import annotations

from collections import Counter, defaultdict

from optimus_mllm.scheduler.bubble_scheduler import ChainPlacement, Schedule
from optimus_mllm.scheduler.encoder_costs import EncoderKernel
from optimus_mllm.scheduler.fine import MIN_PIECE_WORK_US, Cut

TOLERANCE_US = 1e-6


def schedule_violations(schedule: Schedule) -> list[str]:
    """Every way ``schedule`` breaks the rules; empty when it is valid.

    - on each GPU no two compute kernels overlap (LLM and encoder together), encoder communication
      kernels never overlap an LLM TP collective or each other;
    - every encoder kernel of every microbatch, stage and layer is placed exactly once (backward
      only for trainable work), a cut one as pieces of a splittable kernel that tile its tokens,
      take its time plus one launch per extra piece, and each hold at least
      ``fine.MIN_PIECE_WORK_US`` of its work;
    - kernels of a chain (and a cut kernel's pieces) run in order; a microbatch's forward reaches
      encoder stage e+1 only after stage e finished it, its backward the other way round;
    - EF_i <= F_i and EB_i >= B_i for every LLM microbatch i;
    - the iteration is no longer than the coarse schedule's.
    """
    problems: list[str] = []
    problems += _coverage(schedule)
    problems += _chain_order(schedule)
    problems += _overlaps(schedule)
    problems += _dependencies(schedule)
    if schedule.iteration_us > schedule.coarse_iteration_us + TOLERANCE_US:
        problems.append(
            f"iteration {schedule.iteration_us:.3f} us is longer than the coarse schedule's "
            f"{schedule.coarse_iteration_us:.3f} us"
        )
    return problems


def _chains_by_key(schedule: Schedule) -> dict[tuple[int, int, int, str], list[ChainPlacement]]:
    chains: dict[tuple[int, int, int, str], list[ChainPlacement]] = defaultdict(list)
    for c in schedule.chains:
        chains[(c.pipeline, c.stage, c.local_microbatch, c.phase)].append(c)
    return chains


def _coverage(schedule: Schedule) -> list[str]:
    w = schedule.work
    chains = _chains_by_key(schedule)
    problems = []
    expected = set()
    for j, count in enumerate(schedule.partition):
        for k in range(count):
            for e in range(len(w.fwd)):
                expected.add((j, e, k, "fwd"))
                if w.bwd[e].kernels:
                    expected.add((j, e, k, "bwd"))
    for key in expected:
        n = len(chains.get(key, []))
        if n != 1:
            problems.append(
                f"encoder pipeline {key[0]} stage {key[1]} microbatch {key[2]} {key[3]}: placed "
                f"{n} times"
            )
    for key in set(chains) - expected:
        problems.append(f"unexpected chain {key}")
    for c in schedule.chains:
        kernels = schedule.chain_kernels(c).kernels
        where = f"chain {c.pipeline}/{c.stage}/{c.local_microbatch} {c.phase}"
        if len(c.starts_us) != len(kernels):
            problems.append(f"{where}: {len(c.starts_us)} starts for {len(kernels)} kernels")
            continue
        for i, pieces in c.cuts:
            problems += _cut_problems(f"{where} kernel {i}", kernels[i], pieces, w.launch_us)
    # each encoder layer lives on exactly one stage: one QKV kernel per layer, layers 0..L-1
    qkv = Counter((k.encoder, k.layer) for chain in w.fwd for k in chain.kernels if k.name == "qkv")
    for encoder in {name for name, _ in qkv}:
        layers = sorted(layer for name, layer in qkv if name == encoder)
        if layers != list(range(len(layers))) or any(
            qkv[(encoder, layer)] != 1 for layer in layers
        ):
            problems.append(f"encoder {encoder}: layers are not each placed on exactly one stage")
    return problems


def _cut_problems(where: str, kernel: EncoderKernel, pieces: Cut, launch_us: float) -> list[str]:
    if not kernel.splittable or kernel.is_comm:
        return [f"{where} ({kernel.name}): cut, but it runs whole"]
    if (
        pieces[0][0] != 0.0
        or pieces[-1][1] != 1.0
        or any(a[1] != b[0] for a, b in zip(pieces, pieces[1:]))
    ):
        return [f"{where} ({kernel.name}): its pieces do not tile its tokens in order"]
    work = kernel.duration_us - launch_us
    smallest = min(hi - lo for lo, hi, _, _ in pieces)
    if smallest * work < MIN_PIECE_WORK_US - TOLERANCE_US:
        return [
            f"{where} ({kernel.name}): a piece holds {smallest * work:.3g} us of its work, below "
            f"the minimum {MIN_PIECE_WORK_US} us (a launch for next to no tokens)"
        ]
    if kernel.prices is not None:
        blocks = kernel.prices.blocks
        if any(
            abs(x * blocks - round(x * blocks)) > 1e-9 for lo, hi, _, _ in pieces for x in (lo, hi)
        ):
            return [f"{where} ({kernel.name}): its pieces are not whole blocks of {blocks}"]
    took = sum(end - start for _, _, start, end in pieces)
    due = sum(kernel.piece_us(lo, hi, launch_us) for lo, hi, _, _ in pieces)
    if abs(took - due) > TOLERANCE_US * len(pieces) or any(
        end - start < launch_us for _, _, start, end in pieces
    ):
        return [f"{where} ({kernel.name}): its pieces take {took:.3f} us, not {due:.3f}"]
    return []


def _chain_order(schedule: Schedule) -> list[str]:
    w = schedule.work
    problems = []
    chains = _chains_by_key(schedule)
    span: dict[tuple[int, int, int, str], tuple[float, float]] = {}
    for key, placed in chains.items():
        runs = schedule.runs(placed[0])
        for a, b in zip(runs, runs[1:]):
            if b.start_us < a.end_us - TOLERANCE_US:
                problems.append(
                    f"chain {key}: kernel {a.kernel.name} of layer {a.kernel.layer} overlaps the "
                    "next one"
                )
        if runs:
            span[key] = (runs[0].start_us, runs[-1].end_us)
    pp_enc = len(w.fwd)
    for (j, e, k, phase), (start, _) in span.items():
        if phase == "fwd" and e > 0 and (j, e - 1, k, "fwd") in span:
            if start < span[(j, e - 1, k, "fwd")][1] + w.p2p_us - TOLERANCE_US:
                problems.append(
                    f"pipeline {j} microbatch {k}: forward on stage {e} starts before stage "
                    f"{e - 1} "
                    "finished and sent it"
                )
        if phase == "bwd" and e < pp_enc - 1 and (j, e + 1, k, "bwd") in span:
            if start < span[(j, e + 1, k, "bwd")][1] + w.p2p_us - TOLERANCE_US:
                problems.append(
                    f"pipeline {j} microbatch {k}: backward on stage {e} starts before stage "
                    f"{e + 1} "
                    "finished and sent it"
                )
    return problems


def _overlaps(schedule: Schedule) -> list[str]:
    """Per encoder stage (its GPUs share one LLM stage's timeline): compute and comm stream
    conflicts."""
    w, tl, t0 = schedule.work, schedule.timeline, schedule.llm_origin_us
    llm_by_stage = {}
    for s in range(tl.pp):
        compute, comm, hidden = tl.kernel_intervals(s)  # hidden collectives hold the links too
        # on CPU ranks the thread waiting for a TP collective is the one that runs the encoder
        busy = compute + comm if tl.tp_comm_is_busy else compute
        llm_by_stage[s] = (
            [(a + t0, b + t0, "llm") for a, b in busy],
            [(a + t0, b + t0, "llm") for a, b in comm + hidden],
        )
    encoder_compute: dict[tuple[int, int], list] = defaultdict(list)
    encoder_comm: dict[tuple[int, int], list] = defaultdict(list)
    for c in schedule.chains:
        for run in schedule.runs(c):
            k = run.kernel
            if run.end_us <= run.start_us:
                continue
            item = (
                run.start_us,
                run.end_us,
                f"encoder {k.name} (layer {k.layer}, mb {c.local_microbatch})",
            )
            (encoder_comm if k.is_comm else encoder_compute)[(c.pipeline, c.stage)].append(item)
    problems = []
    for j in range(w.num_pipelines):
        for e in range(len(w.fwd)):
            llm_compute, llm_comm = llm_by_stage[w.llm_stage(j, e)]
            where = f"GPUs {list(w.stage_gpus[j][e])}"
            problems += _first_overlap(
                llm_compute + encoder_compute[(j, e)], f"{where} compute stream"
            )
            problems += _first_overlap(llm_comm + encoder_comm[(j, e)], f"{where} links")
    return problems


def _first_overlap(intervals: list[tuple[float, float, str]], where: str) -> list[str]:
    intervals = sorted(intervals)
    for (a0, b0, n0), (a1, b1, n1) in zip(intervals, intervals[1:]):
        if a1 < b0 - TOLERANCE_US and not (n0 == n1 == "llm"):
            return [f"{where}: {n0} [{a0:.3f}, {b0:.3f}) overlaps {n1} [{a1:.3f}, {b1:.3f})"]
    return []


def _dependencies(schedule: Schedule) -> list[str]:
    w = schedule.work
    chains = _chains_by_key(schedule)
    last = len(w.fwd) - 1
    problems = []
    forward, backward = schedule.forward_dependency_us, schedule.backward_dependency_us
    for i, (j, k) in enumerate(schedule.assignment):
        ef = schedule.runs(chains[(j, last, k, "fwd")][0])[-1].end_us + w.to_llm_us[j]
        if ef > forward[i] + TOLERANCE_US:
            problems.append(
                f"microbatch {i}: encoder output arrives at {ef:.3f} after F_{i} = {forward[i]:.3f}"
            )
        if w.bwd[last].kernels:
            eb = chains[(j, last, k, "bwd")][0].starts_us[0]
            if eb < backward[i] + w.to_llm_us[j] - TOLERANCE_US:
                problems.append(
                    f"microbatch {i}: encoder backward starts at {eb:.3f} before B_{i} = "
                    f"{backward[i]:.3f} "
                    "plus the gradient transfer"
                )
    return problems
