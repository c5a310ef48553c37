"""The Optimus runtime inside megatron-core's pipeline schedule, on CPU with gloo.

Two training steps (the second from updated weights) with the schedule artifact give the same losses,
gradient norms, last-step gradients and weights as the Megatron-style baseline (encoders in the first
stage's pre-process), also when the artifact's hook points are wrong; and the encoder's ops run at the
hook points the artifact names.
"""

from __future__ import annotations

import copy
import math

import pytest

from tests.artifact_utils import artifact_for, shuffled_hooks
from tests.conftest import CONFIGS
from tests.distributed_utils import run_distributed

STEPS = 2  # the second step runs from the first one's update; more steps only cost CI time
TINY = str(CONFIGS / "tiny.yaml")
EIGHT_RANKS = ["cluster.num_gpus=8", "cluster.gpus_per_node=8", "parallel.llm={dp: 2, pp: 2, tp: 2, vp: 2}"]


def _train(config_path: str, overrides: list[str], mode: str, artifact: dict | None, steps: int = STEPS) -> dict:
    """One rank: train, then report losses, grad norms, (weight, gradient) pairs (encoder ones whole, by
    plan-independent name), log."""
    from megatron.core import parallel_state

    from optimus_mllm.config import load_config
    from optimus_mllm.planner import plan
    from optimus_mllm.runtime.trainer import Trainer
    from optimus_mllm.runtime.weights import global_parameter_names, llm_global_parameter_names, whole_parameters

    config = load_config(config_path, overrides)
    trainer = Trainer(config, plan(config).llm_plan, mode, artifact)
    results = [trainer.train_step(i) for i in range(steps)]
    trainer.gather_gradients()
    # NumPy copies: tensors would travel back as shared-memory handles that die with the process
    llm = {n: (w.float().numpy(), g.float().numpy()) for n, (w, g) in whole_parameters(
        llm_global_parameter_names(trainer.chunks), parallel_state.get_tensor_model_parallel_group()).items()}
    encoder = {}
    if trainer.encoder is not None:
        encoder = {n: (w.float().numpy(), None if g is None else g.float().numpy()) for n, (w, g) in whole_parameters(
            global_parameter_names(trainer.encoder), trainer.encoder.tp_group).items()}
    planned = []
    if mode == "optimus":
        planned = [(op.event, op.phase, op.local_microbatch, op.kernel_index) for op in trainer.stage_plan.ops]
    trainer.close()
    record = [(op.ran_at, op.scheduled_at, op.phase, op.local_microbatch, op.kernel_index)
              for op in results[-1].encoder_record]
    return {"losses": [r.loss for r in results], "norms": [r.grad_norm for r in results],
            "lrs": [r.lr for r in results], "llm": llm,
            "encoder": encoder,
            "record": record, "planned": planned, "unplanned": [r.unplanned_collectives for r in results]}


def _artifact(overrides: list[str], encoder_plan: dict | None = None, cost_overrides: tuple = ()) -> dict:
    extra = [f"parallel.encoder={{pp: {encoder_plan['pp']}, tp: {encoder_plan['tp']}}}"] if encoder_plan else []
    return artifact_for(TINY, overrides + extra + list(cost_overrides))


def _run(world: int, overrides: list[str], mode: str, artifact: dict | None) -> list[dict]:
    return run_distributed(_train, world, TINY, overrides, mode, artifact, timeout=240)


def _assert_same(optimus: list[dict], baseline: list[dict]) -> None:
    """Same LLM plan on both sides: rank by rank; the encoders (other plans) whole, by global name."""
    for rank, (o, b) in enumerate(zip(optimus, baseline)):
        if b["losses"][0] is not None:
            assert o["losses"] == pytest.approx(b["losses"], abs=1e-5), f"rank {rank}"
        assert o["norms"] == pytest.approx(b["norms"], abs=1e-5), f"rank {rank}: gradient norms"
        _assert_tensors_equal(o["llm"], b["llm"], f"rank {rank}")
    encoder_o = {n: t for r in optimus for n, t in r["encoder"].items()}
    encoder_b = {n: t for r in baseline for n, t in r["encoder"].items()}
    assert encoder_b
    _assert_tensors_equal(encoder_o, encoder_b, "encoder")
    assert any(l is not None for r in baseline for l in r["losses"])


def _assert_tensors_equal(got: dict, expected: dict, where: str) -> None:
    assert got.keys() == expected.keys(), where
    for name, (weight, grad) in expected.items():
        assert abs(got[name][0] - weight).max() <= 1e-5, f"{where}: weight {name}"
        assert (got[name][1] is None) == (grad is None), f"{where}: gradient of {name} on one side only"
        if grad is not None:
            assert abs(got[name][1] - grad).max() <= 1e-5, f"{where}: gradient {name}"


@pytest.fixture(scope="module")
def baseline4() -> list[dict]:
    return _run(4, [], "baseline", None)


@pytest.mark.parametrize("encoder_plan", [None, {"pp": 2, "tp": 1}], ids=["scheduler-choice", "enc-DP2-PP2-TP1"])
def test_optimus_equals_megatron_baseline_on_4_ranks(baseline4, encoder_plan):
    """LLM PP2 TP2 V2; encoder (DP4, PP1, TP1) as the scheduler chooses it, or (DP2, PP2, TP1), whose
    encoder ops also run at the artifact's hook points."""
    artifact = _artifact([], encoder_plan)
    results = _run(4, [], "optimus", artifact)
    _assert_same(results, baseline4)
    if encoder_plan:
        assert (artifact["encoder_plan"]["pp"], artifact["encoder_plan"]["tp"]) == (2, 1)
        _assert_ran_at_the_hook_points(results, artifact)


def test_wrong_predictions_change_nothing_but_timing(baseline4):
    """Hook points from shuffled predictions: same numbers."""
    shuffled = shuffled_hooks(_artifact([], {"pp": 2, "tp": 1}), seed=1)
    _assert_same(_run(4, [], "optimus", shuffled), baseline4)


def _assert_ran_at_the_hook_points(results: list[dict], artifact: dict) -> None:
    inside = 0
    for rank, r in enumerate(results):
        ran = [(ran_at, phase, k, index) for ran_at, _, phase, k, index in r["record"]]
        assert ran == r["planned"], f"rank {rank}: execution differs from the plan"
        assert all(ran_at == scheduled for ran_at, scheduled, *_ in r["record"]), f"rank {rank}: ops moved"
        assert r["unplanned"] == [0] * STEPS, f"rank {rank}: megatron-core ran TP collectives the plan lacks"
        inside += sum(1 for event, *_ in ran if event[0] not in ("pre", "post"))
    assert inside > 0, "some encoder ops run inside the LLM's ops, not only before or after it"
    from optimus_mllm.runtime.hook_plan import build_hook_plan

    plan = build_hook_plan(artifact)
    assert plan.moved_microbatches == ()  # so the plan is the artifact's placement
    assert all(op.event == op.assigned for st in plan.stages for op in st.ops)


SP_TIED = ["training.sequence_parallel=true", "model.llm.untie_embeddings_and_output_weights=false",
           "training.recompute=full"]


def test_sequence_parallel_and_tied_embeddings_train_like_the_baseline():
    """LLM PP2 TP2 V2 with sequence parallelism (image tokens spliced, then scattered), the output layer
    tied to the input embedding across the pipeline (megatron-core's embedding-group gradient sum) and
    full recompute of every LLM layer."""
    artifact = _artifact(SP_TIED)
    _assert_same(_run(4, SP_TIED, "optimus", artifact), _run(4, SP_TIED, "baseline", None))


def test_the_paper_figure_5_twin_trains_like_the_baseline():
    """configs/paper/small/fig5_8gpu.yaml: the paper's Figure 5 plan (PP4 TP2, two chunks per rank) with
    sequence parallelism, selective recompute, tied embeddings and the distributed optimizer."""
    config = str(CONFIGS / "paper" / "small" / "fig5_8gpu.yaml")
    artifact = artifact_for(config)
    optimus = run_distributed(_train, 8, config, [], "optimus", artifact, 2, timeout=400)
    _assert_same(optimus, run_distributed(_train, 8, config, [], "baseline", None, 2, timeout=400))


def test_optimus_equals_megatron_baseline_on_8_ranks():
    """LLM DP2 PP2 TP2 V2 on 8 ranks with the scheduler's encoder plan."""
    artifact = _artifact(EIGHT_RANKS)
    _assert_same(_run(8, EIGHT_RANKS, "optimus", artifact), _run(8, EIGHT_RANKS, "baseline", None))


PP4_V2 = ["model.llm.num_layers=8", "parallel.llm={dp: 1, pp: 4, tp: 1, vp: 2}"]


def _with_warmup(artifact: dict, warmup: list[int]) -> dict:
    artifact = copy.deepcopy(artifact)
    artifact["warmup"] = warmup
    return artifact


@pytest.mark.parametrize("overrides, warmup", [([], [3, 2]), (PP4_V2, None)],
                         ids=["PP2-forced-3-2", "PP4-V2-scheduler-adjusted"])
def test_adjusted_warmups_train_like_the_baseline(overrides, warmup):
    """Fewer warm-up forwards than megatron-core's (paper Fig. 12): no hang, the baseline's numbers.

    megatron-core's own communicator hangs on PP4's [8, 7, 6, 4] and, at PP2, lets a forward activation
    match a gradient's receive; the runtime's channel communicator runs both.
    """
    artifact = _artifact(overrides)
    if warmup is None:
        assert artifact["warmup"] != artifact["default_warmup"], "the scheduler adjusted nothing here"
    else:
        artifact = _with_warmup(artifact, warmup)
    _assert_same(_run(4, overrides, "optimus", artifact), _run(4, overrides, "baseline", None))


DROPOUT = [f"model.{part}.{name}=0.1" for part in ("llm", "encoders.0")
           for name in ("hidden_dropout", "attention_dropout")]


def test_dropout_draws_the_baselines_masks_under_an_adjusted_warmup():
    """Hidden and attention dropout in the LLM and the encoder, with sequence parallelism and full recompute;
    the PP2 warm-up forced to [3, 2]. Optimus runs the encoder under another plan than the baseline's TP2,
    its ops at hook points inside the LLM's: the same masks, so the same numbers."""
    overrides = DROPOUT + SP_TIED
    artifact = _with_warmup(_artifact(overrides), [3, 2])
    assert artifact["encoder_plan"]["tp"] != 2, "the encoder plan is the baseline's (TP2 in the first stage)"
    _assert_same(_run(4, overrides, "optimus", artifact), _run(4, overrides, "baseline", None))


def test_a_displaced_op_is_counted_as_moved():
    """An op hooked before its chain's predecessor cannot run there: the record says where it ran."""
    artifact = copy.deepcopy(_artifact([], {"pp": 2, "tp": 1}))
    stage = next(s for s in artifact["encoder_stages"]
                 if any(op["hook"]["at"] == "llm_kernel" and op["kernel_index"] > 0 for op in s["ops"]))
    op = next(op for op in stage["ops"] if op["hook"]["at"] == "llm_kernel" and op["kernel_index"] > 0)
    op["hook"] = {"at": "before_first_compute"}
    results = _run(4, [], "optimus", artifact)
    moved = [(rank, r) for rank, r in enumerate(results) for r in r["record"] if r[0] != r[1]]
    displaced = [(r[2], r[3], r[4]) for _, r in moved]
    assert displaced and set(displaced) == {(op["phase"], op["local_microbatch"], op["kernel_index"])}, moved
    assert all(r[1] == ("pre",) and r[0] != ("pre",) for _, r in moved)


def test_five_steps_of_adamw_with_warmup_and_cosine_decay():
    """AdamW, clipping at 1.0 and the distributed optimizer (the config's defaults), a one-step warm-up then
    cosine decay; encoder DP2 PP2, so its gradients are averaged over the LLM's one replica, not its two."""
    overrides = ["training.lr=1e-3", "training.min_lr=1e-4", "training.lr_warmup_iters=1",
                 "training.lr_decay_style=cosine", "training.train_iters=5"]
    artifact = _artifact(overrides, {"pp": 2, "tp": 1})
    optimus = run_distributed(_train, 4, TINY, overrides, "optimus", artifact, 5, timeout=300)
    _assert_same(optimus, run_distributed(_train, 4, TINY, overrides, "baseline", None, 5, timeout=300))
    # megatron-core's schedule: 0 in the warm-up step, then min + (max - min) * (1 + cos(pi * done)) / 2
    expected = [0.0] + [1e-4 + 0.9e-3 * (1 + math.cos(math.pi * (k - 1) / 4)) / 2 for k in range(1, 5)]
    assert optimus[0]["lrs"] == pytest.approx(expected)
    assert any(norm > 1.0 for norm in optimus[0]["norms"]), "clipping at 1.0 had nothing to clip"


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_trains_like_the_baseline(precision):
    """bf16 / fp16 weights with megatron-core's fp32 main weights (and, for fp16, dynamic loss scaling from a
    scale low enough that no step is skipped): both runtimes agree to the precision's resolution."""
    overrides = [f"training.precision={precision}", "training.initial_loss_scale=1024"]
    artifact = _artifact(overrides)
    optimus, baseline = (run_distributed(_train, 4, TINY, overrides, mode, a, 2, timeout=240)
                         for mode, a in (("optimus", artifact), ("baseline", None)))
    for o, b in zip(optimus, baseline):
        assert None not in o["norms"] and None not in b["norms"], "a step was skipped"
        assert o["norms"] == pytest.approx(b["norms"], rel=1e-2)
        if b["losses"][0] is not None:
            assert o["losses"] == pytest.approx(b["losses"], abs=5e-3)


TWO_RANKS = ["cluster.num_gpus=2", "cluster.gpus_per_node=2", "parallel.llm={dp: 1, pp: 2, tp: 1, vp: 2}"]


def _inside_a_megatron_job() -> dict:
    """A trainer on its own; then inside a job whose parallel state initialize_megatron set up for another
    plan (refused), and for this job's plan (joined)."""
    import megatron_patches
    from megatron.core import parallel_state

    from optimus_mllm.config import load_config
    from optimus_mllm.errors import OptimusError
    from optimus_mllm.planner import plan
    from optimus_mllm.runtime.trainer import Trainer

    config = load_config(TINY, TWO_RANKS)
    alone = Trainer(config, plan(config).llm_plan, "baseline")
    loss_alone = alone.train_step(0).loss
    alone.close()
    assert not parallel_state.model_parallel_is_initialized() and not megatron_patches.is_applied()
    megatron_patches.apply()  # the job's own setup
    parallel_state.initialize_model_parallel(2, 1)
    try:
        Trainer(config, plan(config).llm_plan, "baseline")
        error = None
    except OptimusError as exc:
        error = str(exc)
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, 2, virtual_pipeline_model_parallel_size=2)
    joined = Trainer(config, plan(config).llm_plan, "baseline")
    loss = joined.train_step(0).loss
    joined.close()
    return {"alone": loss_alone, "joined": loss, "error": error,
            "kept": parallel_state.model_parallel_is_initialized() and megatron_patches.is_applied()}


def test_a_trainer_joins_the_parallel_state_of_a_megatron_job_for_its_plan():
    results = run_distributed(_inside_a_megatron_job, 2, timeout=120)
    assert all(r["error"] == ("megatron-core's parallel state is already initialised for LLM DP1 PP1 TP2, but this "
                              "job's LLM plan is DP1 PP2 TP1 V2; give Megatron the plan's --tensor-model-parallel-size, "
                              "--pipeline-model-parallel-size and virtual stages, or re-run optimus-plan")
               for r in results)
    assert all(r["kept"] for r in results), "the job's parallel state and patches are left in place"
    assert results[1]["joined"] is not None and [r["joined"] for r in results] == [r["alone"] for r in results]
