"""Each placement's step time, measured by training it, against the planner's prediction (issue 52
item 4).

    python benchmarks/bench_e2e.py --config configs/cpu/pp2_v1_heavy_vit.yaml [YAML ...] \\
        --nproc 2 --steps 5 [--profile P] [--rounds R] [--json OUT]

Per config: it profiles the machine with ``optimus-profile`` under torchrun as a job of ``--nproc``
ranks, unless given ``--profile`` (where profiling fails, it says so in one line and predicts with
the cost model's constants); it predicts every placement's iteration time
(``scheduler/placements.py``, what ``optimus-plan`` prints last); then it trains each placement the
job can run with ``optimus-train`` under torchrun for ``--steps`` steps, one thread a rank
(``OMP_NUM_THREADS=1``), and takes the median step time of the steps after the first two (start-up
and warm-up). Megatron-LM's placement runs with ``--baseline megatron-lm``, the balanced one with
``--baseline balanced``, and Optimus with ``--schedule``, its fastest schedule written here, so that
the Optimus row is Optimus even where the planner would run a baseline. The last step's loss is
kept per placement: the placements train the same model, so their losses should agree. A config
whose images vary (``data.images_per_sample``, as ``configs/cpu/pp2_v2_varying_images.yaml``) and
that names no dataset trains on a sample webdataset drawn from its histogram (``sample_data``), its
predictions the means over the iterations ``optimus-plan`` draws; with
``training.schedule_per_iteration`` the Optimus row runs a schedule of each iteration's own.

It prints predicted against measured per placement, Optimus's speed-up over each baseline, measured
and predicted, and the placement the planner runs (``*``: what ``optimus-train`` runs with no
flag); ``--json OUT`` writes the rows. ``--nproc`` must be the configs' ``cluster.num_gpus`` (a
config is not rescaled) and at most this machine's cores.

With ``MEGATRON_LM_DIR`` naming a Megatron-LM checkout (tag ``core_v0.16.1``), each config that
Megatron-LM's flags express exactly (``script_flags``: else one line says why, e.g. a projector
that merges patches, or interleaved stages, which the script cannot run at this tag) also trains
the checkout's own ``pretrain_vlm.py`` on gloo ranks (``scripts/megatron_lm_compare.py``'s CPU
launcher), one thread a rank, for ``--steps`` iterations: unmodified (mode
``megatron-lm-script``), and with the one-line opt-in, ``--optimus-schedule auto`` and
``--optimus-profile`` the profile above (mode ``megatron-lm-script+optimus``). Measured is the
median of Megatron's own ``elapsed time per iteration`` after the first two; predicted, for the
unmodified script, Megatron-LM's placement as the flag prices it with the profile, and with the
flag, what the flag's start-up line says it runs. A line per config gives the speed-up a
Megatron-LM user gets from the one flag, measured and predicted.

With ``--rounds R`` it does all of that R times, round after round (each round profiles again),
and keeps each row's median over the rounds, with the range of its measurements, and as planned
the placement each config's rounds planned most often: this machine's speed drifts by 10-15 %
within minutes, which one round cannot tell from a wrong prediction.

A measurement, not a test: it needs an otherwise idle machine, as other work moves every number.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import ModuleType
from typing import Literal

from optimus_mllm.cli.common import ArgumentParser
from optimus_mllm.config import DataConfig, OptimusConfig, load_config
from optimus_mllm.config.files import atomic_write_text
from optimus_mllm.costing.cost_model import CostModel
from optimus_mllm.errors import OptimusError
from optimus_mllm.megatron.arguments import add_optimus_args
from optimus_mllm.megatron.arguments import build_parser as megatron_parser
from optimus_mllm.megatron.flags import config_from_megatron_args
from optimus_mllm.megatron.unread_flags import add_unread_flags
from optimus_mllm.planner import plan
from optimus_mllm.scheduler.artifact import write_artifact
from optimus_mllm.scheduler.baselines import runnable_megatron_lm_baseline
from optimus_mllm.scheduler.fingerprint import fingerprint_difference, schedule_fingerprint
from optimus_mllm.scheduler.placements import (
    PlacementMode,
    PlacementPrediction,
    job_placements,
)

REPO = Path(__file__).resolve().parent.parent


def _script(name: str) -> ModuleType:
    """``scripts/NAME.py``, a program rather than a package, loaded from its file."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up while it runs
    spec.loader.exec_module(module)
    return module


# Megatron-LM's pretrain_vlm.py on gloo ranks: its CPU flags, the one-line opt-in, the runs
compare = _script("megatron_lm_compare")

PROG = "bench_e2e"
NO_PROFILE = "the cost model's constants (no profile)"
WARMUP_STEPS = 2  # the steps left out of the median: start-up, then the first full step
# samples in the dataset ``sample_data`` makes: more than 6 steps of 8 samples draw, so a short
# run sees no sample twice
SAMPLE_DATA_SAMPLES = 64
# optimus-train's step line: "step 3/5 | loss 6.9783 | grad norm ... | 3271.8 ms | ..."
STEP_LINE = re.compile(r"^step (\d+)/\d+ \| loss (\S+) \| .* \| ([0-9.]+) ms \| ")
# the flags that make optimus-train run each placement (Optimus's adds its --schedule)
MODE_FLAGS: dict[PlacementMode, tuple[str, ...]] = {
    "megatron-lm": ("--baseline", "megatron-lm"),
    "balanced": ("--baseline", "balanced"),
    "optimus": (),
}


# Megatron-LM's own pretrain_vlm.py, unmodified and with the one-line opt-in and the flag
ScriptMode = Literal["megatron-lm-script", "megatron-lm-script+optimus"]
SCRIPT: ScriptMode = "megatron-lm-script"
SCRIPT_WITH_FLAG: ScriptMode = "megatron-lm-script+optimus"
# the flag's start-up line: "optimus: --optimus-schedule auto: ... 1.2345 s per iteration
# predicted ..." (its Optimus schedule's, or where it trains as Megatron-LM does, Megatron-LM's)
FLAG_LINE = re.compile(r"^optimus: --optimus-schedule auto: .*$", re.MULTILINE)
FLAG_PREDICTED = re.compile(r"([0-9.]+) s per iteration predicted")
# the one Megatron-LM tokenizer without files pads its vocabulary (plus its end-of-document token)
# to a multiple of --make-vocab-size-divisible-by (128) x TP
VOCAB_DIVISOR = 128


@dataclass(frozen=True)
class Measured:
    """One training run's median step after warm-up, its last step's loss and its step count."""

    step_s: float
    loss: float
    steps: int


@dataclass(frozen=True)
class Row:
    """One placement of one config: predicted and measured, or why there is no measurement."""

    config: str
    mode: PlacementMode | ScriptMode
    predicted_s: float | None
    measured_s: float | None
    planned: bool
    predicted_from: str  # the profile's path, or NO_PROFILE
    loss: float | None = None
    steps: int | None = None
    problem: str | None = None  # why the placement was not measured
    said: str | None = None  # the flag's start-up line (megatron-lm-script+optimus)
    # over --rounds: the fastest and slowest round's measurement (None: one round or none)
    measured_range_s: tuple[float, float] | None = None


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog=PROG,
        description="Train every placement of each config for real and print its median step "
        "time against the planner's prediction. A measurement, not a test: run it on an "
        "otherwise idle machine.",
    )
    parser.add_argument("--config", nargs="+", required=True, metavar="YAML", help="job configs")
    parser.add_argument(
        "--nproc",
        type=int,
        required=True,
        metavar="N",
        help="ranks (torchrun --nproc-per-node), one core each: must be every config's "
        "cluster.num_gpus (configs are not rescaled) and at most this machine's cores",
    )
    parser.add_argument(
        "--steps",
        type=int,
        required=True,
        metavar="S",
        help=f"training steps per placement, at least {WARMUP_STEPS + 1}: the first "
        f"{WARMUP_STEPS} are warm-up, the median of the rest is measured",
    )
    parser.add_argument(
        "--profile",
        metavar="P",
        help="kernel profile to predict with (optimus-profile --out) instead of profiling here",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        metavar="R",
        help="profile, predict and train every config R times, round after round, and keep each "
        "row's median over the rounds, with the range of its measurements: this machine's "
        "speed drifts by minutes (default: %(default)s)",
    )
    parser.add_argument("--json", metavar="OUT", help="also write the rows as JSON")
    return parser


def usage_problem(args: argparse.Namespace, cores: int) -> str | None:
    """What is wrong with the flags before any config is read, or None."""
    if args.steps < WARMUP_STEPS + 1:
        return (
            f"--steps {args.steps}: give at least {WARMUP_STEPS + 1}, the {WARMUP_STEPS} warm-up "
            "steps and one measured"
        )
    if args.nproc < 1:
        return f"--nproc {args.nproc}: give a positive number of ranks"
    if args.rounds < 1:
        return f"--rounds {args.rounds}: give at least 1"
    if args.nproc > cores:
        return (
            f"--nproc {args.nproc}: more ranks than this machine's {cores} cores; one thread a "
            "rank needs a core each"
        )
    for path in [*args.config, *([args.profile] if args.profile else [])]:
        if not Path(path).is_file():
            flag = "--profile" if path == args.profile else "--config"
            return f"{flag} {path}: no such file"
    checkout = compare.megatron_lm_dir()
    if checkout is not None and not (checkout / PRETRAIN_VLM).is_file():
        return (
            f"MEGATRON_LM_DIR {checkout}: no {PRETRAIN_VLM}; name a Megatron-LM checkout at tag "
            "core_v0.16.1, or unset it to leave out pretrain_vlm.py's rows"
        )
    return None


def config_problem(path: str, nproc: int) -> str | None:
    """Why ``path`` cannot be benchmarked on ``nproc`` ranks, in one line, or None."""
    try:
        config = load_config(path)
    except OptimusError as exc:
        return f"--config {path}: {exc}"
    if config.cluster.num_gpus != nproc:
        return (
            f"--nproc {nproc}: {path} has cluster.num_gpus={config.cluster.num_gpus}; give "
            f"--nproc {config.cluster.num_gpus} or a config of {nproc} ranks"
        )
    return None


def available_cores() -> int:
    """The cores this process may run on (its affinity, where the platform has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def parse_steps(text: str, warmup: int = WARMUP_STEPS) -> Measured | None:
    """The median step time after ``warmup`` steps and the last step's loss from optimus-train's
    output; None without a step past warm-up."""
    steps = [m for line in text.splitlines() if (m := STEP_LINE.match(line))]
    times = [float(m.group(3)) / 1000 for m in steps[warmup:]]
    if not times:
        return None
    return Measured(statistics.median(times), float(steps[-1].group(2)), len(steps))


def error_line(prog: str, stderr: str) -> str:
    """A failed command's own one-line error (``prog: error: ...``), else its last line."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    own = [line for line in lines if line.startswith(f"{prog}: error:")]
    return (own or lines or [f"{prog} failed with no output"])[-1]


def torchrun(nproc: int, module: str, args: list[str]) -> subprocess.CompletedProcess[str]:
    """``python -m torch.distributed.run --standalone`` of ``module``, one thread a rank."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", str(nproc), "-m", module, *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, check=False)


def profile_job(path: str, nproc: int, out: Path) -> str | None:
    """Profile the machine for the config with optimus-profile; its one-line error, or None."""
    done = torchrun(nproc, "optimus_mllm.cli.profile", ["--config", path, "--out", str(out)])
    return None if done.returncode == 0 else error_line("optimus-profile", done.stderr)


def sample_data(path: str, folder: Path) -> list[str]:
    """For a config whose images vary (``data.images_per_sample``) and that names no dataset: a
    sample webdataset drawn from its histogram (``scripts/make_sample_dataset.py``, images of its
    encoder's size, ``SAMPLE_DATA_SAMPLES`` samples, the config's seed) written under ``folder``,
    as the ``data.path`` override every run of the config takes; [] for any other config."""
    config = load_config(path)
    data = config.data
    if data.images_per_sample is None or data.path is not None:
        return []
    counts = sorted(data.images_per_sample)
    weights = {round(w, 9) for w in data.images_per_sample.values()}
    if counts != list(range(counts[0], counts[-1] + 1)) or len(weights) != 1:
        raise OptimusError(
            f"data.images_per_sample: the sample dataset this bench makes draws a sample's images "
            f"uniformly from a range of counts, not {dict(data.images_per_sample)}; give each "
            "count from the lowest to the highest the same weight, or a dataset as data.path"
        )
    if len(config.encoders) != 1:
        raise OptimusError("encoders: the sample dataset is for one encoder; give data.path")
    encoder = config.encoders[0]
    out = folder / f"{Path(path).stem}.data"
    make = _script("make_sample_dataset")
    args = ["--out", str(out), "--images-per-sample", f"{counts[0]}-{counts[-1]}"]
    args += ["--sizes", str(math.isqrt(encoder.seq_length) * encoder.patch_size)]
    args += ["--text-only", "0", "--num-samples", str(SAMPLE_DATA_SAMPLES)]
    if make.main([*args, "--seed", str(config.training.seed)]) != 0:
        raise OptimusError(f"scripts/make_sample_dataset.py {' '.join(args)} failed")
    return [f"data.path={out}"]


def predict(
    path: str, profile: str | None, schedule_out: Path, overrides: list[str]
) -> tuple[list[PlacementPrediction], bool]:
    """Every placement's prediction for the config (with ``overrides``) priced with ``profile``
    (None: the cost model's constants), and whether Optimus's schedule
    (``JobPlacements.schedule``) was written to ``schedule_out``."""
    config = load_config(path, [*_profile_override(profile), *overrides])
    planned = plan(config)
    job = job_placements(config, planned, CostModel.from_config(config))
    if job.schedule is not None:
        write_artifact(job.schedule, config, schedule_out)
    return job.placements, job.schedule is not None


def _profile_override(profile: str | None) -> list[str]:
    return [f"cost_model.profile={profile}"] if profile else []


def train(
    path: str,
    mode: PlacementMode,
    nproc: int,
    steps: int,
    profile: str | None,
    schedule: Path | None,
    overrides: list[str],
) -> Measured | str:
    """Train one placement for ``steps`` steps: its measurement, or why there is none (one line).

    Args:
        path: the config.
        mode: the placement.
        nproc: ranks.
        steps: training steps.
        profile: the profile it was predicted with, given to optimus-train too so that the job it
            plans is the one predicted.
        schedule: Optimus's schedule artifact (the ``optimus`` mode only).
        overrides: the config's further overrides (``sample_data``'s).
    """
    overrides = [f"training.train_iters={steps}", *_profile_override(profile), *overrides]
    args = ["--config", path, "--override", *overrides, *MODE_FLAGS[mode]]
    if schedule is not None:
        args += ["--schedule", str(schedule)]
    done = torchrun(nproc, "optimus_mllm.train", args)
    if done.returncode != 0:
        return error_line("optimus-train", done.stderr)
    measured = parse_steps(done.stdout)
    return measured if measured is not None else "optimus-train printed no step past warm-up"


# -- Megatron-LM's own pretrain_vlm.py ----------------------------------------------------------

# fields of the ViT's layers that pretrain_vlm.py copies from the LLM's TransformerConfig
_SHARED_LAYER_FIELDS = (
    "hidden_size",
    "num_attention_heads",
    "ffn_hidden_size",
    "kv_channels",
    "num_query_groups",
    "gated_linear_unit",
    "activation",
    "add_bias_linear",
    "normalization",
    "hidden_dropout",
    "attention_dropout",
)
# and of its projector, a copy of the LLM's MLP
_PROJECTOR_FIELDS = ("ffn_hidden_size", "activation", "gated_linear_unit", "add_bias_linear")


def script_flags(config: OptimusConfig) -> tuple[str, ...] | str:
    """The Megatron-LM command line with which ``pretrain_vlm.py`` (tag ``core_v0.16.1``) builds
    and trains the config's job on this machine's CPUs (``CPU_VLM_ARGS`` and the model's flags),
    or why no flags do (one line).

    Strict: beyond the refusals that name a field, the flags are read back as the flag reads them
    (``config_from_megatron_args``) and their job's schedule fingerprint (model, batch, precision,
    optimizer kind) and LLM plan must be the config's, but for the vocabulary, which the flags
    state less Megatron's end-of-document token.
    """
    problem = _unexpressed(config)
    if problem is not None:
        return problem
    flags = (*compare.CPU_VLM_ARGS, *_model_flags(config))
    try:
        built = flags_config(flags, config.cluster.num_gpus)
    except OptimusError as exc:
        return f"Megatron-LM's flags for it are refused: {exc}"
    difference = _flags_difference(config, built)
    if difference is not None:
        return f"pretrain_vlm.py's flags build another job: {difference}"
    return flags


def flags_config(flags: tuple[str, ...], nproc: int, profile: str | None = None) -> OptimusConfig:
    """The config ``--optimus-schedule`` reads off ``flags`` on ``nproc`` ranks of one machine,
    priced with ``profile`` (``--optimus-profile``)."""
    given = [*flags, *(["--optimus-profile", profile] if profile else [])]
    parser = megatron_parser(lambda p: add_unread_flags(add_optimus_args(p)))
    return config_from_megatron_args(parser.parse_args(given), nproc, nproc)


def _unexpressed(config: OptimusConfig) -> str | None:
    """What of the config Megatron-LM's pretrain_vlm.py cannot build or run, in one line."""
    if len(config.encoders) != 1:
        return f"model.encoders: {len(config.encoders)} encoders; pretrain_vlm.py builds one ViT"
    enc, llm, llm_plan = config.encoders[0], config.llm, config.parallel.llm
    if llm_plan is None or llm_plan.vp is None:
        return "parallel.llm: give dp, pp, tp and vp; pretrain_vlm.py takes them as flags"
    if llm_plan.vp != 1:
        return (
            f"parallel.llm.vp {llm_plan.vp}: pretrain_vlm.py cannot run interleaved at "
            "core_v0.16.1 (its providers take no vp_stage)"
        )
    if llm_plan.tp_mode != "1d" or config.parallel.encoder is not None:
        return "parallel: Megatron-LM runs 1-D TP and --optimus-schedule auto plans the encoder"
    if enc.name != "vit":
        return f"model.encoders[0].name {enc.name}: the flag names its ViT vit (profile keys)"
    for field in _SHARED_LAYER_FIELDS:
        if getattr(enc, field) != getattr(llm, field):
            return (
                f"model.encoders[0].{field} {getattr(enc, field)} is not model.llm's "
                f"{getattr(llm, field)}: pretrain_vlm.py's ViT is a copy of the LLM's layers"
            )
    if (llm.activation, llm.gated_linear_unit) not in (("gelu", False), ("silu", True)):
        return "model.llm.activation: Megatron-LM's flags give GELU, or SwiGLU with --swiglu"
    if (enc.model_subtype, enc.class_token, enc.in_channels) != ("clip", True, 3):
        return (
            "model.encoders[0]: pretrain_vlm.py builds CLIP (model_subtype clip) with its class "
            "token (class_token true) on 3-channel images"
        )
    projector = enc.projector
    if projector.type != "mlp" or projector.spatial_merge != 1:
        return (
            f"model.encoders[0].projector: {projector.type} with spatial_merge "
            f"{projector.spatial_merge}; pretrain_vlm.py's projector is an MLP merging no patches"
        )
    for field in _PROJECTOR_FIELDS:
        if getattr(projector, field) != getattr(llm, field):
            return (
                f"model.encoders[0].projector.{field} {getattr(projector, field)} is not "
                f"model.llm's {getattr(llm, field)}: pretrain_vlm.py's projector is the LLM's MLP"
            )
    if math.isqrt(enc.seq_length) ** 2 != enc.seq_length:
        return (
            f"model.encoders[0].seq_length {enc.seq_length}: pretrain_vlm.py's images are "
            "square (--img-h = --img-w); give a square number of patches"
        )
    divisor = VOCAB_DIVISOR * llm_plan.tp
    if llm.vocab_size % divisor:
        return (
            f"model.llm.vocab_size {llm.vocab_size}: Megatron-LM pads its vocabulary to a "
            f"multiple of {VOCAB_DIVISOR} x TP = {divisor}; give such a multiple"
        )
    # the placeholder names a token of the text, which mock data has none of
    if config.data != DataConfig(image_placeholder=config.data.image_placeholder):
        return "data: pretrain_vlm.py trains on Megatron's mock data, one image a sample"
    return None


def _model_flags(config: OptimusConfig) -> tuple[str, ...]:
    """pretrain_vlm.py's flags for the config's model, plan and training (where ``_unexpressed``
    finds nothing)."""
    enc, llm, training = config.encoders[0], config.llm, config.training
    llm_plan = config.parallel.llm
    assert llm_plan is not None
    side = math.isqrt(enc.seq_length) * enc.patch_size
    text = llm.seq_length - enc.image_tokens
    flags = [
        *("--encoder-num-layers", enc.num_layers, "--decoder-num-layers", llm.num_layers),
        *("--hidden-size", llm.hidden_size, "--ffn-hidden-size", llm.ffn_hidden_size),
        *("--num-attention-heads", llm.num_attention_heads, "--normalization", llm.normalization),
        *("--hidden-dropout", llm.hidden_dropout, "--attention-dropout", llm.attention_dropout),
        *("--seq-length", text, "--dataloader-seq-length", text),
        *("--max-position-embeddings", llm.seq_length),
        *("--position-embedding-type", llm.position_embedding_type),
        # the null tokenizer adds its end-of-document token
        *("--vocab-size", llm.vocab_size - 1),
        *("--img-h", side, "--img-w", side, "--patch-dim", enc.patch_size),
        *("--tensor-model-parallel-size", llm_plan.tp),
        *("--pipeline-model-parallel-size", llm_plan.pp),
        *("--micro-batch-size", training.micro_batch_size),
        *("--global-batch-size", training.global_batch_size),
        *("--train-iters", training.train_iters, "--seed", training.seed),
        *("--optimizer", training.optimizer, "--lr", training.lr, "--min-lr", training.min_lr),
        *("--lr-decay-style", training.lr_decay_style),
        *("--lr-warmup-iters", training.lr_warmup_iters),
        *("--weight-decay", training.weight_decay, "--clip-grad", training.clip_grad),
        *("--adam-beta1", training.adam_beta1, "--adam-beta2", training.adam_beta2),
        *("--adam-eps", training.adam_eps, "--sgd-momentum", training.sgd_momentum),
    ]
    if llm.kv_channels is not None:
        flags += ["--kv-channels", llm.kv_channels]
    if llm.num_query_groups is not None:
        flags += ["--group-query-attention", "--num-query-groups", llm.num_query_groups]
    switches = {
        "--swiglu": llm.gated_linear_unit,
        "--disable-bias-linear": not llm.add_bias_linear,
        "--untie-embeddings-and-output-weights": llm.untie_embeddings_and_output_weights,
        "--disable-vision-class-token": enc.drop_class_token,
        "--freeze-ViT": enc.frozen,
        "--bf16": training.precision == "bf16",
        "--fp16": training.precision == "fp16",
        "--sequence-parallel": training.sequence_parallel,
        "--use-distributed-optimizer": training.distributed_optimizer,
    }
    flags += [flag for flag, on in switches.items() if on]
    if training.recompute == "full":  # the config's full recompute: every layer, one at a time
        flags += ["--recompute-granularity", "full", "--recompute-method", "uniform"]
        flags += ["--recompute-num-layers", "1"]
    elif training.recompute == "selective":
        flags += ["--recompute-granularity", "selective"]
    return tuple(str(flag) for flag in flags)


def _flags_difference(config: OptimusConfig, built: OptimusConfig) -> str | None:
    """The first setting in which the flags' job differs from the config's, or None."""
    if built.parallel.llm != config.parallel.llm:
        return f"parallel.llm {built.parallel.llm}, the config has {config.parallel.llm}"
    # Megatron-LM's embedding is the padded vocabulary, one more than --vocab-size here
    llm = dataclasses.replace(built.llm, vocab_size=built.llm.vocab_size + 1)
    built = dataclasses.replace(built, model=dataclasses.replace(built.model, llm=llm))
    return fingerprint_difference(schedule_fingerprint(config), schedule_fingerprint(built))


@dataclass(frozen=True)
class ScriptRun:
    """One pretrain_vlm.py run: its median iteration after warm-up and last ``lm loss``, or why
    there is none, and the flag's start-up line where it had the flag."""

    measured: Measured | str
    said: str | None


def run_script(
    flags: tuple[str, ...],
    with_flag: bool,
    nproc: int,
    steps: int,
    profile: str | None,
    folder: Path,
    warmup: int = WARMUP_STEPS,
) -> ScriptRun:
    """pretrain_vlm.py of ``MEGATRON_LM_DIR`` on ``nproc`` gloo ranks, one thread each, for
    ``steps`` iterations: unmodified, or (``with_flag``) with the one-line opt-in and
    ``--optimus-schedule auto`` (and ``--optimus-profile profile``)."""
    checkout = compare.megatron_lm_dir()
    assert checkout is not None
    args = [*flags, "--train-iters", str(steps)]
    script = checkout / "pretrain_vlm.py"
    if with_flag:
        script = compare.with_one_line(checkout, folder)
        args += [*compare.AUTO, *(["--optimus-profile", profile] if profile else [])]
    # start-up (a minute on a busy machine) and a generous minute an iteration
    timeout_s = 300 + 60 * steps
    try:
        run = compare.run_megatron_script(
            script, nproc, args, timeout_s, variables={"OMP_NUM_THREADS": "1"}
        )
    except subprocess.TimeoutExpired:
        return ScriptRun(f"{PRETRAIN_VLM} ran past {timeout_s} s", None)
    found = FLAG_LINE.search(run.output)
    said = found[0] if found else None
    if run.returncode != 0:
        return ScriptRun(error_line(PRETRAIN_VLM, run.output), said)
    return ScriptRun(parse_script(run.output, warmup) or _NO_ITERATION, said)


PRETRAIN_VLM = "pretrain_vlm.py"
_NO_ITERATION = "pretrain_vlm.py printed no iteration past warm-up"


def parse_script(output: str, warmup: int = WARMUP_STEPS) -> Measured | None:
    """The median of Megatron's ``elapsed time per iteration`` after ``warmup`` iterations and
    the last iteration's ``lm loss``; None without an iteration past warm-up."""
    elapsed = compare.elapsed_ms(output)
    times = [ms / 1000 for number, ms in sorted(elapsed.items()) if number > warmup]
    iterations = compare.parse_iterations(output)
    if not times or not iterations:
        return None
    return Measured(statistics.median(times), iterations[-1].lm_loss, len(elapsed))


def flag_predicted_s(said: str | None) -> float | None:
    """What the flag's start-up line predicts for the iteration it runs: its Optimus schedule's,
    or where it trains as Megatron-LM does, Megatron-LM's placement's (None: no number)."""
    found = FLAG_PREDICTED.search(said or "")
    return float(found[1]) if found else None


def script_rows(
    name: str,
    flags: tuple[str, ...],
    nproc: int,
    steps: int,
    profile: str | None,
    folder: Path,
    warmup: int = WARMUP_STEPS,
) -> list[Row]:
    """pretrain_vlm.py's two rows for a config: without the flag, predicted as the flag prices
    Megatron-LM's placement (``runnable_megatron_lm_baseline``, what ``--optimus-schedule auto``
    weighs Optimus against), and with it, predicted as the flag says."""
    config = flags_config(flags, nproc, profile)
    cost = CostModel.from_config(config)
    megatron = runnable_megatron_lm_baseline(config, plan(config).llm_plan, cost)
    megatron_s = None if megatron is None else megatron.iteration_us / 1e6
    rows = []
    for mode, with_flag in ((SCRIPT, False), (SCRIPT_WITH_FLAG, True)):
        run = run_script(flags, with_flag, nproc, steps, profile, folder, warmup)
        print(f"{name} {mode}: {_measured_text(run.measured)}", flush=True)
        predicted = flag_predicted_s(run.said) if with_flag else megatron_s
        row = Row(name, mode, predicted, None, False, profile or NO_PROFILE, said=run.said)
        if isinstance(run.measured, Measured):
            got = run.measured
            row = replace(row, measured_s=got.step_s, loss=got.loss, steps=got.steps)
        else:
            row = replace(row, problem=run.measured)
        rows.append(row)
    return rows


def build_rows(
    config: str,
    predictions: list[PlacementPrediction],
    measured: dict[str, Measured | str],
    predicted_from: str,
) -> list[Row]:
    """One row per placement: ``measured`` holds each trained mode's measurement or failure."""
    rows = []
    for p in predictions:
        row = Row(config, p.mode, p.iteration_s, None, p.planned, predicted_from)
        got = measured.get(p.mode, p.problem or "not trained")
        if isinstance(got, Measured):
            row = replace(row, measured_s=got.step_s, loss=got.loss, steps=got.steps)
        else:
            row = replace(row, problem=got)
        rows.append(row)
    return rows


def combine_rounds(rounds: list[list[Row]]) -> list[Row]:
    """One row per (config, mode) of the first round, its times the median over the rounds that
    have one, the range of its measurements, and as planned the placement each config's rounds
    planned most often (a tie goes to the earliest round's)."""
    if len(rounds) == 1:
        return rounds[0]
    by_key: dict[tuple[str, str], list[Row]] = {}
    for rows in rounds:
        for r in rows:
            by_key.setdefault((r.config, r.mode), []).append(r)
    planned: dict[str, str] = {}
    for config in dict.fromkeys(r.config for r in rounds[0]):
        picks = [r.mode for rows in rounds for r in rows if r.config == config and r.planned]
        if picks:
            planned[config] = max(dict.fromkeys(picks), key=picks.count)
    combined = []
    for (config, mode), rows in by_key.items():
        predicted = [r.predicted_s for r in rows if r.predicted_s is not None]
        measured = [r.measured_s for r in rows if r.measured_s is not None]
        last = rows[-1]
        combined.append(
            replace(
                last,
                predicted_s=statistics.median(predicted) if predicted else None,
                measured_s=statistics.median(measured) if measured else None,
                measured_range_s=(min(measured), max(measured)) if measured else None,
                planned=planned.get(config) == mode,
                predicted_from=rows[0].predicted_from
                if len({r.predicted_from for r in rows}) == 1
                else f"{len(rows)} profiles, one a round",
                problem=next((r.problem for r in rows if r.problem), None),
                said=next((r.said for r in reversed(rows) if r.said), None),
            )
        )
    return combined


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def format_table(rows: list[Row]) -> str:
    """Predicted against measured per placement; ``*`` marks the planned one."""
    header = (
        f"{'config':<20} {'mode':<26} {'predicted s':>12} {'measured s':>11} "
        f"{'range s':>15} {'meas/pred':>10} {'loss':>8}  planned"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        ratio = (
            f"{r.measured_s / r.predicted_s:.2f}"
            if r.measured_s is not None and r.predicted_s
            else "-"
        )
        loss = "-" if r.loss is None else f"{r.loss:.4f}"
        spread = (
            "-"
            if r.measured_range_s is None
            else f"{r.measured_range_s[0]:.3f}-{r.measured_range_s[1]:.3f}"
        )
        line = (
            f"{r.config:<20} {r.mode:<26} {_seconds(r.predicted_s):>12} "
            f"{_seconds(r.measured_s):>11} {spread:>15} {ratio:>10} {loss:>8}  "
            f"{'*' if r.planned else ''}"
        )
        lines.append(line.rstrip())
    lines += [f"  {r.config} {r.mode}: not measured: {r.problem}" for r in rows if r.problem]
    return "\n".join(lines) + "\n"


def _speedup(baseline_s: float | None, optimus_s: float | None) -> str:
    """How many times faster Optimus is than the baseline."""
    if baseline_s is None or optimus_s is None:
        return "-"
    return f"{baseline_s / optimus_s:.3f}x"


def format_speedups(rows: list[Row]) -> str:
    """Per config: Optimus against each baseline, measured and predicted, and the planned
    placement."""
    lines = []
    for config in dict.fromkeys(r.config for r in rows):
        own = {r.mode: r for r in rows if r.config == config}
        optimus = own["optimus"]
        against = [
            f"against {mode}: measured {_speedup(own[mode].measured_s, optimus.measured_s)}, "
            f"predicted {_speedup(own[mode].predicted_s, optimus.predicted_s)}"
            for mode in ("megatron-lm", "balanced")
        ]
        planned = next((r.mode for r in own.values() if r.planned), "none")
        lines.append(
            f"{config}: Optimus's speed-up (baseline step / Optimus step) "
            f"{'; '.join(against)}; the planner runs {planned}; predicted from "
            f"{optimus.predicted_from}"
        )
        if SCRIPT in own and SCRIPT_WITH_FLAG in own:
            lines.append(_flag_speedup(config, own[SCRIPT], own[SCRIPT_WITH_FLAG]))
    return "\n".join(lines) + "\n"


def _flag_speedup(config: str, plain: Row, flagged: Row) -> str:
    """What the one flag gives a pretrain_vlm.py job, measured and predicted, and what it ran."""
    ran = "no line from the flag"
    if flagged.said is not None:
        ran = (
            "Megatron-LM's placement"
            if "training as Megatron-LM does" in flagged.said
            else ("an Optimus schedule")
        )
    return (
        f"{config}: pretrain_vlm.py's speed-up from --optimus-schedule auto (iteration without / "
        f"with): measured {_speedup(plain.measured_s, flagged.measured_s)}, predicted "
        f"{_speedup(plain.predicted_s, flagged.predicted_s)}; the flag ran {ran}"
    )


def write_json(rows: list[Row], out: str) -> None:
    atomic_write_text(out, json.dumps([asdict(r) for r in rows], indent=2) + "\n")


def bench_config(path: str, args: argparse.Namespace, folder: Path) -> list[Row]:
    """Profile (unless given one), predict and train every placement of one config."""
    name = Path(path).stem
    profile = args.profile
    if profile is None:
        out = folder / f"{name}.profile.json"
        failed = profile_job(path, args.nproc, out)
        if failed is None:
            profile = str(out)
        else:
            print(f"{name}: profiling failed ({failed}); predicting without a profile")
    schedule = folder / f"{name}.schedule.json"
    data = sample_data(path, folder)
    predictions, scheduled = predict(path, profile, schedule, data)
    measured: dict[str, Measured | str] = {}
    for p in predictions:
        if p.iteration_s is not None:
            own = schedule if p.mode == "optimus" and scheduled else None
            measured[p.mode] = train(path, p.mode, args.nproc, args.steps, profile, own, data)
            print(f"{name} {p.mode}: {_measured_text(measured[p.mode])}", flush=True)
    rows = build_rows(name, predictions, measured, profile or NO_PROFILE)
    if compare.megatron_lm_dir() is None:
        return rows
    flags = script_flags(load_config(path))
    if isinstance(flags, str):
        print(f"{name}: no pretrain_vlm.py rows: {flags}", flush=True)
        return rows
    return rows + script_rows(name, flags, args.nproc, args.steps, profile, folder)


def _measured_text(got: Measured | str) -> str:
    if isinstance(got, str):
        return f"failed: {got}"
    return f"median step {got.step_s:.3f} s of {got.steps} steps, last loss {got.loss:.4f}"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    problem = usage_problem(args, available_cores())
    if problem is None:
        problem = next(filter(None, (config_problem(c, args.nproc) for c in args.config)), None)
    if problem is not None:
        parser.error(problem)
    rounds: list[list[Row]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            folder = Path(tmp) / f"round{r + 1}"
            folder.mkdir()
            rounds.append([])
            for path in args.config:
                if args.rounds > 1:
                    print(f"round {r + 1}/{args.rounds}: {path}", flush=True)
                try:
                    rounds[-1] += bench_config(path, args, folder)
                except OptimusError as exc:  # e.g. a profile the cost model refuses
                    print(f"{PROG}: error: {path}: {exc}", file=sys.stderr)
                    return 2
        rows = combine_rounds(rounds)
    over = f"; median of {args.rounds} rounds" if args.rounds > 1 else ""
    print(
        f"\n{args.nproc} ranks, one thread each; median step of steps {WARMUP_STEPS + 1}-"
        f"{args.steps}{over}"
    )
    sys.stdout.write(format_table(rows))
    sys.stdout.write(format_speedups(rows))
    if args.json:
        write_json(rows, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
