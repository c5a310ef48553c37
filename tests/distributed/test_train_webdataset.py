"""Issue 34's data on 4 gloo ranks: a webdataset from make_sample_dataset.py (0-4 images per sample
at 16 and 32 pixels, 20 % text-only), tokenized by a tokenizer trained here, trains under the
Optimus runtime as under the Megatron-style baseline, microbatch image counts varying from
iteration to iteration (text-only microbatches included, which run no encoder op)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from support.artifact_utils import artifact_for
from support.distributed_utils import run_distributed
from support.paths import CONFIGS, REPO
from support.tokenizer import train_tokenizer
from support.train_utils import (
    approx_per_rank,
    assert_one_error_everywhere,
    ranks,
    step_numbers,
    torchrun,
)

pytestmark = pytest.mark.distributed

TINY = str(CONFIGS / "tiny.yaml")
STEPS = 5
# one sample per microbatch: some microbatches are text-only
ONE_SAMPLE = ["training.micro_batch_size=1", "training.global_batch_size=8"]
ENCODER_PP2 = "parallel.encoder={pp: 2, tp: 1}"


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> list[str]:
    """The issue's dataset and a tokenizer trained on its text, as config overrides."""
    from megatron.energon.epathlib import EPath
    from megatron.energon.flavors.webdataset.itar_reader import ShardInfosITarReader
    from megatron.energon.flavors.webdataset.metadata import WebdatasetMeta

    root = tmp_path_factory.mktemp("webdataset")
    out = root / "data"
    command = [sys.executable, str(REPO / "scripts" / "make_sample_dataset.py"), "--out", str(out)]
    command += ["--images-per-sample", "0-4", "--sizes", "16,32", "--text-only", "0.2"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    shards = WebdatasetMeta.from_config(EPath(out), split_part="train").shards
    reader = ShardInfosITarReader(EPath(out), shards)
    texts = [json.loads(reader[i]["json"])["text"] for i in range(len(reader))]
    tokenizer = train_tokenizer(texts, root / "tokenizer")
    return [f"data.path={out}", f"data.tokenizer={tokenizer}"]


def _train(overrides: list[str], mode: str, artifact) -> dict:
    """One rank: 5 steps; losses, gradient norms, and per step the microbatches (global index,
    images) whose encoder ops ran here and those planned here."""
    from optimus_mllm.config import load_config
    from optimus_mllm.planner import plan
    from optimus_mllm.runtime.trainer import Trainer

    config = load_config(TINY, overrides)
    trainer = Trainer(config, plan(config).llm_plan, mode, artifact)
    results, ran, planned, schedules = [], [], [], []
    for iteration in range(STEPS):
        result = trainer.train_step(iteration)
        results.append(result)
        if result.schedule is not None:
            counts = [
                trainer.image_count(iteration, trainer.numbering.global_index(i))
                for i in range(trainer.num_microbatches)
            ]
            # each encoder op of the step's schedule: its hook point and predicted start and end
            hooks = [
                (op.phase, op.microbatch, op.kernel_index, op.hook, op.start_us, op.end_us)
                for stage in result.schedule.artifact.encoder_stages
                for op in stage.ops
            ]
            artifact = result.schedule.artifact
            schedules.append(
                {
                    "source": result.schedule.source,
                    "text": result.schedule.text,
                    "counts": counts,  # images per LLM microbatch, in the LLM's order
                    "predicted_us": artifact.predicted.iteration_us,
                    "llm_order": artifact.llm_order,
                    "feeds": artifact.feeds,
                    "images_per_chain": artifact.images_per_chain,
                    # the execution record: the sample each LLM microbatch ran here, and on the
                    # first LLM stage the encoder microbatches each one's image tokens joined
                    "llm_ran": result.llm_microbatches,
                    "fed_by": {
                        i: [(f.encoder_pipeline, f.local_microbatch) for f in feeders]
                        for i, feeders in result.fed_by.items()
                    },
                    # each encoder op that ran here: the LLM microbatch, part and sample it fed
                    "encoder_ran": sorted(
                        {
                            (op.microbatch, op.part, op.global_microbatch)
                            for op in result.encoder_record
                        }
                    ),
                    "first_llm_stage": trainer.stage == 0,
                    "ops": hooks,
                    # every op ran at its hook point in this step's schedule
                    "at_hook": all(op.ran_at == op.scheduled_at for op in result.encoder_record),
                    "runs_its_schedule": _ran_as_scheduled(trainer, iteration, result),
                }
            )
        if trainer.optimus is not None:
            pipeline = trainer.optimus.groups.coords.pipeline

            def microbatch(k: int, it: int = iteration, j: int = pipeline) -> tuple[int, int]:
                g = trainer.numbering.global_index(trainer.numbering.llm(j, k))
                return g, trainer.image_count(it, g)

            ran.append(sorted({microbatch(op.local_microbatch) for op in result.encoder_record}))
            ops = trainer.optimus.stage_plan.ops
            planned.append(sorted({microbatch(op.local_microbatch) for op in ops}))
    trainer.close()
    return {
        "losses": [r.loss for r in results],
        "norms": [r.grad_norm for r in results],
        "ran": ran,
        "planned": planned,
        "schedules": schedules,
        "pipeline": trainer.llm_dp,
    }


def _ran_as_scheduled(trainer, iteration: int, result) -> bool:
    """The execution record is this rank's ops of the step's schedule whose microbatch has images,
    each where that schedule placed it (hook point and predicted start)."""
    from optimus_mllm.runtime.hook_plan import build_hook_plan

    def images(op) -> int:
        return trainer.image_count(iteration, trainer.numbering.global_index(op.microbatch))

    stage = build_hook_plan(result.schedule.artifact).for_gpu(trainer.optimus.gpu)
    planned = [
        (op.phase, op.local_microbatch, op.kernel_index, op.piece, op.event, op.start_us)
        for op in stage.ops
        if images(op)
    ]
    ran = [
        (op.phase, op.local_microbatch, op.kernel_index, op.piece, op.planned_at, op.scheduled_us)
        for op in result.encoder_record
    ]
    return sorted(ran) == sorted(planned)


def _both(overrides: list[str]) -> tuple[list[dict], list[dict]]:
    artifact = artifact_for(TINY, overrides)
    runs = [(overrides, "optimus", artifact), (overrides, "baseline", None)]
    per_rank = run_distributed(_runs, 4, runs, timeout=400)
    return [r[0] for r in per_rank], [r[1] for r in per_rank]


def _runs(runs: list) -> list[dict]:
    return [_train(*run) for run in runs]


LLM_DP2 = "parallel.llm={dp: 2, pp: 2, tp: 1, vp: 2}"


@pytest.mark.parametrize(
    "plan", [[], [ENCODER_PP2], [LLM_DP2]], ids=["job plan", "encoder pp 2", "llm dp 2"]
)
def test_optimus_trains_like_the_baseline_on_varying_images(data, plan):
    optimus, baseline = _both([*data, *ONE_SAMPLE, *plan])
    for rank, (o, b) in enumerate(zip(optimus, baseline)):
        assert o["losses"] == approx_per_rank(b["losses"], rel=1e-5), f"rank {rank}"
        assert o["norms"] == approx_per_rank(b["norms"], rel=1e-5), f"rank {rank}"
    assert sum(loss is not None for r in baseline for loss in r["losses"]) >= STEPS
    counts = [tuple(n for _, n in step) for step in optimus[0]["planned"]]  # rank 0's encoder
    assert len(set(counts)) > 1, "iterations with the same images"
    assert any(0 in step for step in counts), "no text-only microbatch"
    for r in optimus:
        for ran, planned in zip(r["ran"], r["planned"]):
            # exactly the microbatches with images ran encoder ops
            assert ran == [(g, n) for g, n in planned if n > 0]


# four microbatches an iteration, so that the heaviest one varies between iterations
PER_ITERATION = ["training.schedule_per_iteration=true", "data.max_images_per_microbatch=4"]
PER_ITERATION += ["training.global_batch_size=4"]


@pytest.mark.parametrize("plan", [[], [LLM_DP2]], ids=["job plan", "llm dp 2"])
def test_each_iteration_runs_its_own_schedule_with_the_baselines_numbers(data, plan):
    """Issue 34's acceptance 1 with a schedule per iteration: every rank runs the schedule built
    for its iteration's images (or, where it is late, the fallback for 4 images per microbatch),
    with the baseline's losses and gradient norms. Under LLM DP 2 each replica schedules its own
    microbatches. An iteration's own schedule runs its imageless microbatches first and may split
    a microbatch's images over several encoder microbatches; the execution record shows the sample
    each LLM microbatch ran and the encoder microbatches whose image tokens it joined."""
    optimus, baseline = _both([*data, *ONE_SAMPLE, *PER_ITERATION, *plan])
    for rank, (o, b) in enumerate(zip(optimus, baseline)):
        assert o["losses"] == approx_per_rank(b["losses"], rel=1e-5), f"rank {rank}"
        assert o["norms"] == approx_per_rank(b["norms"], rel=1e-5), f"rank {rank}"
    steps = optimus[0]["schedules"]
    assert len(steps) == STEPS
    # every rank of one LLM pipeline ran the same schedule each step
    for r in optimus:
        first = next(f for f in optimus if f["pipeline"] == r["pipeline"])["schedules"]
        assert [s["text"] for s in r["schedules"]] == [s["text"] for s in first]
        assert [s["predicted_us"] for s in r["schedules"]] == [s["predicted_us"] for s in first]
        assert all(s["at_hook"] for s in r["schedules"])
        assert all(s["runs_its_schedule"] for s in r["schedules"])
        for s in r["schedules"]:
            _check_record(s, r["pipeline"])
    own = [s for s in steps if s["source"] == "per-iteration"]
    assert len(own) >= 2, [s["text"] for s in steps]
    if not plan:  # with 4 microbatches a pipeline, this data has an iteration that needs both
        assert any(
            s["llm_order"] != tuple(sorted(s["llm_order"]))
            and len(set(s["feeds"])) < len(s["feeds"])
            for s in own
        ), "no step whose schedule reorders and splits"
    assert len({tuple(s["counts"]) for s in steps}) > 1, "iterations with the same images"
    # a workload scheduled differently (other encoder microbatches, or each priced at other
    # images), a different schedule; iterations whose chains are alike share one
    assert len({_priced(s) for s in own}) > 1
    for a in own:
        for b in own:
            if _priced(a) != _priced(b):
                assert (a["feeds"], a["ops"]) != (b["feeds"], b["ops"])
            else:
                assert a["ops"] == b["ops"]


def _priced(step: dict) -> tuple:
    """What a per-iteration schedule is priced for: the LLM microbatch each encoder microbatch
    feeds, and the images of the largest one (every encoder microbatch is priced at it)."""
    most = max(step["counts"])
    return step["feeds"], min(most, step["images_per_chain"] or most)


def _check_record(step: dict, pipeline: int) -> None:
    """What one rank's step ran is what its schedule says: LLM microbatch i ran data microbatch
    ``llm_order[i]``, its image tokens (first LLM stage) joined from the encoder microbatches that
    feed it, as many as its images need, and every encoder op ran images of the sample it fed."""
    order, feeds, per_chain = step["llm_order"], step["feeds"], step["images_per_chain"]
    n = len(order)
    sample = [pipeline * n + d for d in order]  # LLM microbatch -> the job's microbatch
    assert step["llm_ran"] == dict(enumerate(sample))
    if step["first_llm_stage"]:
        with_images = [i for i, count in enumerate(step["counts"]) if count]
        assert sorted(step["fed_by"]) == with_images
        for i in with_images:
            parts = -(-step["counts"][i] // per_chain) if per_chain else 1
            assert len(step["fed_by"][i]) == parts == feeds.count(i)
    for microbatch, part, global_microbatch in step["encoder_ran"]:
        assert global_microbatch == sample[microbatch]
        assert part < feeds.count(microbatch)


HELD_S = 300.0  # how long rank 0's schedule builds are held back at most


def _held_back_scheduler(overrides: list[str], artifact) -> dict:
    """Rank 0's schedule builds held back until training is done (at most ``HELD_S``): the
    steps' schedules, and how long the 5 steps took."""
    import threading
    import time

    import torch.distributed as dist

    from optimus_mllm.runtime import iteration_schedules

    release = threading.Event()
    real = iteration_schedules.schedule_iteration

    def held_back(*args, **kwargs):
        release.wait(timeout=HELD_S)
        return real(*args, **kwargs)

    if dist.get_rank() == 0:
        iteration_schedules.schedule_iteration = held_back
    started = time.monotonic()
    try:
        result = _train(overrides, "optimus", artifact)
    finally:
        release.set()
        iteration_schedules.schedule_iteration = real
    return {**result, "seconds": time.monotonic() - started}


def _slowed_and_baseline(overrides: list[str], artifact) -> tuple[dict, dict]:
    return _held_back_scheduler(overrides, artifact), _train(overrides, "baseline", None)


def test_a_slowed_scheduler_makes_iterations_fall_back_without_stalling(data):
    """Issue 34's acceptance 3: rank 0's builds never finish in time, so every rank runs the
    fallback every step (they agree) and no step waits for a build."""
    overrides = [*data, *ONE_SAMPLE, *PER_ITERATION]
    artifact = artifact_for(TINY, overrides)
    per_rank = run_distributed(_slowed_and_baseline, 4, overrides, artifact, timeout=400)
    for rank, (slowed, baseline) in enumerate(per_rank):
        assert [s["text"] for s in slowed["schedules"]] == [
            "fallback (late: not built on every rank by the step)"
        ] * STEPS, f"rank {rank}"
        assert slowed["seconds"] < HELD_S / 2, "a step waited for a held-back build"
        assert slowed["losses"] == approx_per_rank(baseline["losses"], rel=1e-5), f"rank {rank}"
        assert slowed["norms"] == approx_per_rank(baseline["norms"], rel=1e-5), f"rank {rank}"


def test_optimus_train_prints_the_baselines_numbers(data):
    """The issue's command line: optimus-train (packed samples, 2 per sequence of 128 tokens)."""
    flags = ["--override", *data, "model.llm.seq_length=128", "data.samples_per_sequence=2"]
    flags += ["training.train_iters=5"]
    optimus = step_numbers(torchrun(*flags))
    assert len(optimus) == STEPS
    assert optimus == step_numbers(torchrun(*flags, "--baseline"))


def test_balanced_baseline_refuses_varying_images(data):
    from optimus_mllm.errors import OptimusError
    from optimus_mllm.train import build_parser, prepare

    args = build_parser().parse_args(
        ["--config", TINY, "--baseline", "balanced", "--override", *data]
    )
    with pytest.raises(OptimusError, match=r"^--baseline balanced: its pipeline buffers carry"):
        prepare(args, 4)


def test_schedule_per_iteration_needs_a_webdataset():
    from optimus_mllm.errors import OptimusError
    from optimus_mllm.train import build_parser, prepare

    flags = ["--config", TINY, "--override", *PER_ITERATION]
    with pytest.raises(OptimusError, match=r"^training.schedule_per_iteration: needs a webdataset"):
        prepare(build_parser().parse_args(flags), 4)


def test_a_sample_above_the_maximum_is_one_line_on_every_rank(tmp_path):
    """Found when the step's images are counted, on every rank, before the step runs."""
    out = tmp_path / "many"
    command = [sys.executable, str(REPO / "scripts" / "make_sample_dataset.py"), "--out", str(out)]
    command += ["--images-per-sample", "5-6", "--text-only", "0", "--num-samples", "4"]
    subprocess.run(command, capture_output=True, timeout=120, check=True)
    results = ranks(4, "--override", f"data.path={out}", "model.llm.seq_length=256")
    assert_one_error_everywhere(
        results, "data.max_images_per_sample: sample shard-000000.tar/000000 has "
    )
