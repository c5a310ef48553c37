"""Randomized plan equivalence: the Optimus runtime trains every plan to a single rank's numbers.

    python -m tests.support.check_plans --seeds N [--start S] [--steps K (5)] [--runtime
    optimus|balanced]
                                  [--json OUT] [--timeout SEC]

Each seed draws a small job from configs/tiny.yaml (``draw_job``): an LLM plan (PP 1/2/4, V 1/2/3,
TP 1/2, DP 1/2, at most 8 ranks), a microbatch count per pipeline that is or is not a multiple of PP
(a multiple with V > 1, as megatron-core's interleaved schedule needs), micro batch 1-3, one or two
encoders, maybe one frozen, maybe a 2x2 spatial merge before a projector, model shapes that divide
the plan (sometimes grouped-query attention or a gated linear unit), and sometimes LLM sequence
parallelism (TP 2) or tied input and output embeddings. ``schedule_job`` plans and schedules it: the
encoder plan is the scheduler's choice or one of the planner's other plans, forced through
``parallel.encoder``; the warm-up is the scheduler's (adjusted where it differs from megatron-core's
default) or, for some interleaved jobs, a reduced one that ``llm_timeline.simulate`` runs without
deadlock, forced into the artifact; and for some jobs every encoder layer kernel runs in random
pieces of its tokens, each hooked where the whole kernel was
(``tests/support/artifact_utils.split_kernels``: the cuts the scheduler makes to fit short bubbles,
which these small jobs' kernels never need). The Optimus runtime then trains ``--steps`` steps on
``world`` gloo ranks, and the Megatron-style baseline the same steps on one rank (every microbatch
there, no parallelism) from the same plan-independent weights (``runtime/weights.py``) and data,
both with megatron-core's training stack (DDP, distributed optimizer, AdamW, clipping at 1.0,
warm-up + cosine LR: ``SCHEDULE``); losses, gradient norms (relative to the norm where it exceeds
1), final weights and last-step gradients, whole and by global name, must agree within
``TOLERANCE``.

``--runtime balanced`` runs the same jobs under the Megatron-LM balanced baseline instead (encoder
and LLM layers split together over the LLM plan's virtual stages, as the scheduler may choose it),
against the same one-rank reference; a job it cannot run (two encoders, a tied embedding whose
copies the split puts on one rank) is a SKIP row that says why.

Run it from the repository's root. Ranks run through ``distributed_utils.run_distributed`` (beside
this module in ``tests/support``), whose timeout turns a hang into a failure (HANG). One
table row per seed, then ``N passed, M failed`` (and ``K skipped``) and the warm-ups covered; exit
code 1 if any seed failed, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Literal

import numpy as np

from optimus_mllm.config import load_config
from optimus_mllm.config.files import atomic_write_text
from optimus_mllm.costing.cost_model import CostModel
from optimus_mllm.planner import ParallelPlan, plan
from optimus_mllm.scheduler.artifact import schedule_job_artifact
from optimus_mllm.scheduler.artifact_format import ScheduleArtifact
from optimus_mllm.scheduler.baselines import balanced_problem
from optimus_mllm.scheduler.llm_costs import llm_op_work, llm_p2p_us
from optimus_mllm.scheduler.llm_timeline import PipelineDeadlock, simulate

from .artifact_utils import split_kernels, with_warmup
from .distributed_utils import run_distributed
from .p2p_audit import nccl_violations, recorded_p2p
from .paths import REPO

TINY = str(REPO / "configs" / "tiny.yaml")
TOLERANCE = 1e-5
# AdamW (the config's default, clipping at 1.0) with a one-step warm-up, then cosine decay over 5
# steps
SCHEDULE = (
    "training.lr=1e-3",
    "training.min_lr=1e-4",
    "training.lr_warmup_iters=1",
    "training.lr_decay_style=cosine",
    "training.lr_decay_iters=5",
)
MAX_WORLD = 8
WarmupKind = Literal["default", "adjusted", "forced"]
Status = Literal["PASS", "FAIL", "HANG", "SKIP"]
Runtime = Literal["optimus", "balanced"]

# A second encoder, smaller than tiny's ViT, with a linear projector: image tokens 16 + 4 < 64.
_SECOND_ENCODER = {
    "name": "vit2",
    "hidden_size": 16,
    "num_attention_heads": 2,
    "ffn_hidden_size": 32,
    "seq_length": 4,
    "patch_size": 2,
    "in_channels": 1,
    "projector": {"type": "linear"},
}


@dataclass(frozen=True)
class Job:
    """A randomly drawn job: the LLM plan, the batch, and the model as overrides of
    configs/tiny.yaml."""

    seed: int
    dp: int
    pp: int
    tp: int
    vp: int
    num_microbatches: int  # per LLM pipeline
    micro_batch: int
    model: tuple[str, ...]  # plan-independent overrides: model shapes, encoders, training seed
    # "single", "dual", with "+frozen" if one encoder is frozen, "+clip" for a clip embedding
    encoders: str
    # "sp" (sequence parallel), "tied" (embeddings), "rope", "silu", "rms" (RMSNorm) joined by "+",
    # or "-"
    llm: str
    force_encoder_plan: bool  # one of the planner's plans instead of the scheduler's choice
    force_warmup: bool  # a reduced warm-up instead of the scheduler's, where V > 1 allows one
    cut_kernels: bool = False  # the encoder layers' kernels in random pieces of their tokens

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.tp

    def overrides(self) -> list[str]:
        """The Optimus job's config overrides (the encoder plan comes later, from
        ``schedule_job``)."""
        return [
            *self._common(self.world),
            f"parallel.llm={{dp: {self.dp}, pp: {self.pp}, tp: {self.tp}, vp: {self.vp}}}",
        ]

    def reference_overrides(self) -> list[str]:
        """The same model, data and global batch on one rank without any parallelism."""
        return [*self._common(1), "parallel.llm={dp: 1, pp: 1, tp: 1, vp: 1}"]

    def _common(self, world: int) -> list[str]:
        global_batch = self.dp * self.num_microbatches * self.micro_batch
        return [
            *self.model,
            *SCHEDULE,
            f"cluster.num_gpus={world}",
            f"cluster.gpus_per_node={world}",
            f"training.micro_batch_size={self.micro_batch}",
            f"training.global_batch_size={global_batch}",
        ]


def draw_job(seed: int) -> Job:
    """A small job that every plan dimension divides, drawn from ``seed`` alone."""
    rng = random.Random(seed)
    pp = rng.choice([1, 2, 2, 4, 4])
    tp = rng.choice([1, 2])
    dp = rng.choice([1, 2]) if 2 * pp * tp <= MAX_WORLD else 1
    vp = 1 if pp == 1 else rng.choice([1, 2, 3])
    if vp > 1:  # megatron-core's interleaved schedule: a multiple of PP, at least PP
        num_microbatches = pp * rng.choice([1, 2])
    else:
        num_microbatches = rng.randint(1, 2 * pp + 1)
    layers_per_chunk = rng.choice([1, 2]) if pp * vp <= 4 else 1
    model = [
        f"model.llm.num_layers={pp * vp * layers_per_chunk}",
        f"training.seed={rng.randrange(10_000)}",
    ]
    if rng.random() < 0.3:
        model.append("model.llm.num_query_groups=2")  # grouped-query attention: QKV rows per group
    if rng.random() < 0.3:
        model.append("model.llm.gated_linear_unit=true")  # fc1 holds [gate; up] per TP rank
    encoders = [{**_tiny_encoder(), "num_layers": rng.choice([2, 4])}]
    if rng.random() < 0.35:
        encoders.append({**_SECOND_ENCODER, "num_layers": rng.choice([2, 4])})
    label = "dual" if len(encoders) == 2 else "single"
    if rng.random() < 0.3:
        encoders[rng.randrange(len(encoders))]["frozen"] = True
        label += "+frozen"
    encoders_at = len(model)  # later draws rewrite this override
    model.append(f"model.encoders={json.dumps(encoders)}")
    micro_batch = rng.randint(1, 3)
    force_encoder_plan = rng.random() < 0.5
    force_warmup = vp > 1 and rng.random() < 0.4
    # drawn last, so that the draws above give the jobs they gave before these existed
    llm = []
    if tp > 1 and rng.random() < 0.5:
        model.append("training.sequence_parallel=true")
        llm.append("sp")
    if rng.random() < 0.5:
        model.append("model.llm.untie_embeddings_and_output_weights=false")
        llm.append("tied")
    # drawn after the above, so earlier seeds keep their jobs: RoPE, SiLU MLPs (LLM and encoders),
    # RMSNorm
    if rng.random() < 0.3:
        model.append("model.llm.position_embedding_type=rope")
        llm.append("rope")
    if rng.random() < 0.3:
        model.append("model.llm.activation=silu")
        for encoder in encoders:
            encoder["activation"] = "silu"
        model[encoders_at] = f"model.encoders={json.dumps(encoders)}"
        llm.append("silu")
    if rng.random() < 0.2:
        model.append("model.llm.normalization=RMSNorm")
        llm.append("rms")
    if rng.random() < 0.3:  # CLIPViTModel's clip embedding (ln_pre) for the first encoder
        encoders[0]["model_subtype"] = "clip"
        model[encoders_at] = f"model.encoders={json.dumps(encoders)}"
        label += "+clip"
    # a 2x2 spatial merge before the first encoder's projector (16 patches, 4 tokens)
    if rng.random() < 0.3:
        encoders[0]["projector"] = {**encoders[0]["projector"], "spatial_merge": 2}
        model[encoders_at] = f"model.encoders={json.dumps(encoders)}"
        label += "+merge"
    # the scheduler cuts a kernel to fit short bubbles where it pays; tiny jobs' kernels fit whole,
    # so cut here
    cut_kernels = rng.random() < 0.5
    return Job(
        seed=seed,
        dp=dp,
        pp=pp,
        tp=tp,
        vp=vp,
        num_microbatches=num_microbatches,
        micro_batch=micro_batch,
        model=tuple(model),
        encoders=label,
        llm="+".join(llm) or "-",
        force_encoder_plan=force_encoder_plan,
        force_warmup=force_warmup,
        cut_kernels=cut_kernels,
    )


def _tiny_encoder() -> dict[str, Any]:
    return asdict(load_config(TINY).model.encoders[0])


@dataclass(frozen=True)
class Setup:
    """What the Optimus run executes: its config overrides and schedule artifact."""

    job: Job
    overrides: tuple[str, ...]
    artifact: ScheduleArtifact
    encoder_plan_forced: bool
    warmup_kind: WarmupKind


def schedule_job(job: Job) -> Setup:
    """Plan and schedule ``job``, forcing the encoder plan and the warm-up where the job says so."""
    rng = random.Random(f"{job.seed}:schedule")
    overrides = job.overrides()
    forced_plan = False
    if job.force_encoder_plan:
        candidates = [c.plan for c in plan(load_config(TINY, overrides)).candidates]
        if candidates:
            chosen = rng.choice(candidates)
            overrides.append(f"parallel.encoder={{pp: {chosen.pp}, tp: {chosen.tp}}}")
            forced_plan = True
    config = load_config(TINY, overrides)
    planned = plan(config)
    artifact = schedule_job_artifact(config, planned)
    kind: WarmupKind = "adjusted" if artifact.warmup != artifact.default_warmup else "default"
    if job.force_warmup:
        avoid = {artifact.warmup, artifact.default_warmup}
        warmup = reduced_warmup(config, planned.llm_plan, list(artifact.default_warmup), avoid, rng)
        if warmup is not None:
            artifact = with_warmup(artifact, list(warmup))
            kind = "forced"
    if job.cut_kernels:
        artifact = split_kernels(
            artifact, TINY, sorted({round(rng.uniform(0.05, 0.95), 3) for _ in range(2)}), overrides
        )
    return Setup(job, tuple(overrides), artifact, forced_plan, kind)


def reduced_warmup(
    config: Any,
    llm_plan: ParallelPlan,
    default: list[int],
    avoid: set[tuple[int, ...]],
    rng: random.Random,
    tries: int = 200,
) -> tuple[int, ...] | None:
    """A warm-up of at most megatron-core's ``default`` per stage that the LLM timeline runs without
    deadlock, outside ``avoid``; None if ``tries`` draws find none.

    Drawn from the last stage back, each stage at least its successor's count: a stage with fewer
    warm-up forwards than the next one waits for a backward before it has sent the next one the
    forwards that backward needs, so such draws mostly deadlock.
    """
    cost = CostModel.from_config(config)
    work, p2p = llm_op_work(config, llm_plan, cost), llm_p2p_us(config, llm_plan, cost)
    for _ in range(tries):
        warmup: list[int] = []
        for d in reversed(default):
            warmup.insert(0, rng.randint(min(warmup[0] if warmup else 0, d), d))
        if tuple(warmup) in avoid:
            continue
        try:
            simulate(
                llm_plan.pp,
                llm_plan.vp,
                config.num_microbatches_total // llm_plan.dp,
                work,
                p2p,
                warmup,
            )
        except PipelineDeadlock:
            continue
        return tuple(warmup)
    return None


# -- one rank ---------------------------------------------------------------------------------


def train_rank(
    overrides: list[str], mode: str, artifact: ScheduleArtifact | None, steps: int
) -> dict[str, Any]:
    """On one rank: train ``steps`` steps; the losses, every whole (weight, gradient) held here, and
    the rank's P2P calls (tests/p2p_audit.py).

    Runs in the processes ``run_distributed`` spawns, so it imports the runtime itself.
    """
    from megatron.core import parallel_state

    from optimus_mllm.runtime.trainer import Trainer
    from optimus_mllm.runtime.weights import (
        global_parameter_names,
        llm_global_parameter_names,
        whole_parameters,
    )

    config = load_config(TINY, overrides)
    trainer = Trainer(config, plan(config).llm_plan, mode, artifact)
    with recorded_p2p() as p2p:
        results = [trainer.train_step(i) for i in range(steps)]
    trainer.gather_gradients()
    tensors = whole_parameters(
        llm_global_parameter_names(trainer.chunks), parallel_state.get_tensor_model_parallel_group()
    )
    for stage in trainer.encoder_stages:
        tensors.update(whole_parameters(global_parameter_names(stage), stage.tp_group))
    trainer.close()
    # NumPy copies: tensors would travel back as shared-memory handles that die with the process
    return {
        "losses": [r.loss for r in results],
        "norms": [r.grad_norm for r in results],
        "p2p": p2p,
        "tensors": {
            name: (w.numpy(), None if g is None else g.numpy()) for name, (w, g) in tensors.items()
        },
    }


# -- comparison -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Diffs:
    loss: float
    grad: float
    weight: float
    problem: str | None  # a structural mismatch (missing names, a gradient on one side only)

    @property
    def passed(self) -> bool:
        return self.problem is None and max(self.loss, self.grad, self.weight) <= TOLERANCE


def compare(
    ranks: list[dict[str, Any]], reference: dict[str, Any], audit_p2p: bool = True
) -> Diffs:
    """Largest differences of the ranks from the one-rank reference.

    The job's loss of a step is the mean over its last-stage ranks (each DP replica's mean over its
    microbatches, repeated on its TP ranks). Every rank's copy of a tensor is compared, so TP ranks
    and DP replicas that disagree with each other fail too. With ``audit_p2p`` (the Optimus
    runtime's own P2P), the ranks' P2P calls must obey NCCL's matching rules (``nccl_violations``):
    gloo forgives what NCCL would match wrongly. megatron-core's own P2P (the balanced baseline)
    keeps other rules: both directions on the PP group, ordered by even and odd rank, one of them on
    the world group at PP2.
    """
    steps = len(reference["losses"])
    per_step = [[r["losses"][i] for r in ranks if r["losses"][i] is not None] for i in range(steps)]
    if any(not losses for losses in per_step):
        return Diffs(np.inf, np.inf, np.inf, "no rank reported a loss")
    loss = max(
        abs(float(np.mean(losses)) - ref) for losses, ref in zip(per_step, reference["losses"])
    )
    if any(None in (norm, ref) for r in ranks for norm, ref in zip(r["norms"], reference["norms"])):
        return Diffs(loss, np.inf, np.inf, "a step skipped its update on one side only")
    # the gradient norm spans every rank's LLM and encoder parts: one global value, on every rank.
    # It is an fp32 sum of squares that each plan adds up in another order (seed 13's first step:
    # 26.8 off by 1.0e-5 while every gradient agreed to 1.5e-7), so it is compared relative to its
    # size, where above 1
    grad = max(
        abs(norm - ref) / max(1.0, abs(ref))
        for r in ranks
        for norm, ref in zip(r["norms"], reference["norms"])
    )
    expected = reference["tensors"]
    seen: set[str] = set()
    weight = 0.0
    for r in ranks:
        for name, (w, g) in r["tensors"].items():
            if name not in expected:
                return Diffs(loss, np.inf, np.inf, f"{name} is not in the reference")
            ref_w, ref_g = expected[name]
            if (g is None) != (ref_g is None):
                return Diffs(loss, np.inf, np.inf, f"{name}: a gradient on one side only")
            seen.add(name)
            weight = max(weight, _max_abs(w, ref_w))
            grad = max(grad, 0.0 if g is None else _max_abs(g, ref_g))
    missing = sorted(set(expected) - seen)
    problem = f"{len(missing)} reference tensors on no rank, e.g. {missing[0]}" if missing else None
    violations = (
        nccl_violations([record for r in ranks for record in r["p2p"]]) if audit_p2p else []
    )
    if violations and problem is None:
        problem = f"NCCL would mismatch: {violations[0]} ({len(violations)} in all)"
    return Diffs(loss, grad, weight, problem)


def _max_abs(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max()) if a.shape == b.shape else np.inf


# -- one seed ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    seed: int
    world: int
    llm_plan: str  # DP/PP/TP/V
    encoder_plan: str  # DP/PP/TP, "*" if forced, "c" if its kernels run in pieces
    microbatches: int  # per LLM pipeline
    micro_batch: int
    encoders: str
    llm: str  # sp / tied / sp+tied / -
    warmup: str
    warmup_kind: str  # default, adjusted (the scheduler's) or forced
    loss_diff: float | None  # None where the run did not finish
    grad_diff: float | None
    weight_diff: float | None
    seconds: float
    status: Status
    note: str  # why it failed: a mismatch, or the tail of a rank's traceback


def check_seed(seed: int, steps: int, timeout: float, runtime: Runtime = "optimus") -> Row:
    """Draw, schedule and run seed ``seed``'s job (under ``runtime``) and its one-rank reference;
    never raises for the job."""
    start = time.monotonic()
    job = draw_job(seed)
    setup = None
    try:
        if runtime == "balanced":
            config = load_config(TINY, job.overrides())
            problem = balanced_problem(config, plan(config).llm_plan)
            if problem:
                return _row(job, None, None, "SKIP", problem, time.monotonic() - start, runtime)
            ranks = run_distributed(
                train_rank, job.world, job.overrides(), "balanced", None, steps, timeout=timeout
            )
        else:
            setup = schedule_job(job)
            ranks = run_optimus(setup, steps, timeout)
        diffs = compare(ranks, run_reference(job, steps, timeout), audit_p2p=runtime == "optimus")
    except TimeoutError as exc:
        return _row(job, setup, None, "HANG", str(exc), time.monotonic() - start, runtime)
    except Exception as exc:  # noqa: BLE001 - a failing job is a row of the table, not a crash
        return _row(
            job,
            setup,
            None,
            "FAIL",
            _symptom(f"{type(exc).__name__}: {exc}"),
            time.monotonic() - start,
            runtime,
        )
    status: Status = "PASS" if diffs.passed else "FAIL"
    note = diffs.problem or ("" if diffs.passed else f"differences above {TOLERANCE:g}")
    return _row(job, setup, diffs, status, note, time.monotonic() - start, runtime)


def run_optimus(setup: Setup, steps: int, timeout: float) -> list[dict[str, Any]]:
    return run_distributed(
        train_rank,
        setup.job.world,
        list(setup.overrides),
        "optimus",
        setup.artifact,
        steps,
        timeout=timeout,
    )


def run_reference(job: Job, steps: int, timeout: float) -> dict[str, Any]:
    (result,) = run_distributed(
        train_rank, 1, job.reference_overrides(), "baseline", None, steps, timeout=timeout
    )
    return result


def _row(
    job: Job,
    setup: Setup | None,
    diffs: Diffs | None,
    status: Status,
    note: str,
    seconds: float,
    runtime: Runtime = "optimus",
) -> Row:
    encoder_plan, warmup, kind = "?", "?", "?"
    # no encoder plan: the encoder's layers are in the LLM's virtual stages
    if runtime == "balanced":
        encoder_plan, warmup, kind = "balanced", "-", "default"
    elif setup is not None:
        e = setup.artifact.encoder_plan
        encoder_plan = (
            f"{e.dp}/{e.pp}/{e.tp}"
            + ("*" if setup.encoder_plan_forced else "")
            + ("c" if job.cut_kernels else "")
        )
        warmup, kind = ",".join(map(str, setup.artifact.warmup)), setup.warmup_kind
    return Row(
        seed=job.seed,
        world=job.world,
        llm_plan=f"{job.dp}/{job.pp}/{job.tp}/{job.vp}",
        encoder_plan=encoder_plan,
        microbatches=job.num_microbatches,
        micro_batch=job.micro_batch,
        encoders=job.encoders,
        llm=job.llm,
        warmup=warmup,
        warmup_kind=kind,
        loss_diff=diffs.loss if diffs else None,
        grad_diff=diffs.grad if diffs else None,
        weight_diff=diffs.weight if diffs else None,
        seconds=round(seconds, 1),
        status=status,
        note=note,
    )


def _symptom(text: str, lines: int = 6) -> str:
    """The first line (which rank failed) and the last ``lines`` (where and why) of a failure."""
    parts = text.strip().splitlines()
    return "\n".join(parts if len(parts) <= lines + 2 else [parts[0], "  ...", *parts[-lines:]])


# -- table and command line --------------------------------------------------------------------

_COLUMNS = (
    ("seed", 5),
    ("world", 5),
    ("LLM D/P/T/V", 11),
    ("enc D/P/T", 9),
    ("#mb", 4),
    ("mbs", 3),
    ("encoders", 13),
    ("llm", 16),
    ("warm-up", 12),
    ("kind", 8),
    ("|dloss|", 8),
    ("|dgrad|", 8),
    ("|dweight|", 9),
    ("sec", 6),
    ("status", 6),
)


def header() -> str:
    return " ".join(name.rjust(width) for name, width in _COLUMNS)


def format_row(row: Row) -> str:
    cells = (
        row.seed,
        row.world,
        row.llm_plan,
        row.encoder_plan,
        row.microbatches,
        row.micro_batch,
        row.encoders,
        row.llm,
        row.warmup,
        row.warmup_kind,
        _sci(row.loss_diff),
        _sci(row.grad_diff),
        _sci(row.weight_diff),
        f"{row.seconds:.1f}",
        row.status,
    )
    return " ".join(str(cell).rjust(width) for cell, (_, width) in zip(cells, _COLUMNS))


def _sci(value: float | None) -> str:
    return "-" if value is None else f"{value:.1e}"


def summary(rows: list[Row]) -> list[str]:
    """``N passed, M failed`` (and ``K skipped``) on its own line, then the warm-ups the passing
    runs covered."""
    passed = [r for r in rows if r.status == "PASS"]
    skipped = sum(r.status == "SKIP" for r in rows)
    adjusted = sum(r.warmup_kind == "adjusted" for r in passed)
    forced = sum(r.warmup_kind == "forced" for r in passed)
    return [
        f"{len(passed)} passed, {len(rows) - len(passed) - skipped} failed"
        + (f", {skipped} skipped" if skipped else ""),
        f"warm-ups covered by passing runs: {adjusted} adjusted by the scheduler, {forced} forced, "
        f"{len(passed) - adjusted - forced} megatron-core default",
    ]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, as the project's other commands
        print(f"check_plans: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = _Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, required=True, help="how many seeds to run")
    parser.add_argument("--start", type=int, default=0, help="the first seed (default 0)")
    parser.add_argument("--steps", type=int, default=5, help="training steps per run (default 5)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds one run may take before it counts as a hang (default 300)",
    )
    parser.add_argument(
        "--runtime",
        choices=("optimus", "balanced"),
        default="optimus",
        help="the runtime under test: Optimus's schedule (default) or the balanced baseline",
    )
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args(argv)
    for name, low in (("seeds", 1), ("start", 0), ("steps", 1)):
        if getattr(args, name) < low:
            parser.error(f"--{name} must be at least {low}, got {getattr(args, name)}")
    if not args.timeout > 0:
        parser.error(f"--timeout must be positive, got {args.timeout}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(header(), flush=True)
    rows = []
    for seed in range(args.start, args.start + args.seeds):
        rows.append(check_seed(seed, args.steps, args.timeout, args.runtime))
        print(format_row(rows[-1]), flush=True)
    for row in rows:
        if row.status not in ("PASS", "SKIP"):
            print(f"\nseed {row.seed} {row.status}: {row.note}")
    print("\n" + "\n".join(summary(rows)))
    if args.json:
        atomic_write_text(
            args.json,
            json.dumps(
                {"tolerance": TOLERANCE, "steps": args.steps, "rows": [asdict(r) for r in rows]},
                indent=1,
            )
            + "\n",
        )
    return 0 if all(r.status in ("PASS", "SKIP") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
