"""The Optimus runtime inside megatron-core's pipeline schedule, on CPU with gloo.

Two training steps (the second from updated weights) with the schedule artifact give the same
losses, gradient norms, last-step gradients and weights as the Megatron-style baseline (encoders in
the first stage's pre-process), also when the artifact's hook points are wrong; and the encoder's
ops run at the hook points the artifact names.
"""

from __future__ import annotations

import math

import pytest

from optimus_mllm.runtime.hook_plan import EventKind
from optimus_mllm.scheduler.artifact_format import ScheduleArtifact

from support.artifact_utils import artifact_for, shuffled_hooks, split_kernels, with_warmup
from support.distributed_utils import run_distributed
from support.paths import CONFIGS

pytestmark = pytest.mark.distributed

STEPS = 2  # the second step runs from the first one's update; more steps only cost CI time
TINY = str(CONFIGS / "tiny.yaml")
METP_TINY = str(CONFIGS / "metp_tiny.yaml")
SUMMA_TINY = str(CONFIGS / "summa_tiny.yaml")
LLM_DP2 = ["parallel.llm={dp: 2, pp: 2, tp: 1, vp: 2}"]


def _train(
    config_path: str,
    overrides: list[str],
    mode: str,
    artifact: ScheduleArtifact | None,
    steps: int = STEPS,
) -> dict:
    """One rank: train, then report losses, grad norms, (weight, gradient) pairs (encoder ones
    whole, by
    plan-independent name), log."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from optimus_mllm.config import load_config
    from optimus_mllm.planner import plan
    from optimus_mllm.runtime.trainer import Trainer
    from optimus_mllm.runtime.weights import (
        global_parameter_names,
        llm_global_parameter_names,
        whole_parameters,
    )

    config = load_config(config_path, overrides)
    trainer = Trainer(config, plan(config).llm_plan, mode, artifact)
    results = [trainer.train_step(i) for i in range(steps)]
    trainer.gather_gradients()
    # NumPy copies: tensors would travel back as shared-memory handles that die with the process
    llm = {
        n: (w.float().numpy(), g.float().numpy())
        for n, (w, g) in whole_parameters(
            llm_global_parameter_names(trainer.chunks),
            parallel_state.get_tensor_model_parallel_group(),
        ).items()
    }
    encoder = {}
    for stage in trainer.encoder_stages:
        named = global_parameter_names(stage)
        if any(vision.grid is not None for vision in stage.encoders.values()):
            # 2D blocks (vectors on grid row 0 only): each rank's own, named by rank; both runs
            # hold the grid on the same ranks
            rank = dist.get_rank()
            pairs = {
                f"rank {rank}: {n}": (p.detach(), getattr(p, "main_grad", p.grad))
                for n, p in named.items()
            }
        else:
            pairs = whole_parameters(named, stage.tp_group)
        encoder.update(
            {
                n: (w.float().numpy(), None if g is None else g.float().numpy())
                for n, (w, g) in pairs.items()
            }
        )
    planned = []
    if mode == "optimus":
        planned = [
            (op.event, op.phase, op.local_microbatch, op.kernel_index, op.piece)
            for op in trainer.optimus.stage_plan.ops
        ]
    trainer.close()
    record = [
        (op.ran_at, op.scheduled_at, op.phase, op.local_microbatch, op.kernel_index, op.piece)
        for op in results[-1].encoder_record
    ]
    return {
        "losses": [r.loss for r in results],
        "norms": [r.grad_norm for r in results],
        "lrs": [r.lr for r in results],
        "llm": llm,
        "encoder": encoder,
        "record": record,
        "planned": planned,
        "unplanned": [r.unplanned_collectives for r in results],
        "attention": sorted(  # the encoder layers' attention and QKV linear classes
            {
                f"{type(layer.self_attention).__name__} "
                f"{type(layer.self_attention.linear_qkv).__name__}"
                for stage in trainer.encoder_stages
                for vision in stage.encoders.values()
                for layer in vision.layers
            }
        ),
    }


def _artifact(
    overrides: list[str], encoder_plan: dict | None = None, cost_overrides: tuple = ()
) -> ScheduleArtifact:
    extra = (
        [f"parallel.encoder={{pp: {encoder_plan['pp']}, tp: {encoder_plan['tp']}}}"]
        if encoder_plan
        else []
    )
    return artifact_for(TINY, overrides + extra + list(cost_overrides))


def _train_runs(
    config_path: str, runs: list[tuple[list[str], str, ScheduleArtifact | None, int]]
) -> list[dict]:
    """One rank: each (overrides, mode, artifact, steps) run in turn, a trainer each, closed before
    the next
    (one launch of the ranks for several runs: starting them is most of a small test's time)."""
    return [
        _train(config_path, overrides, mode, artifact, steps)
        for overrides, mode, artifact, steps in runs
    ]


def _both(
    world: int,
    overrides: list[str],
    artifact: ScheduleArtifact,
    steps: int = STEPS,
    config: str = TINY,
    timeout: int = 300,
) -> tuple[list[dict], list[dict]]:
    """(Optimus, baseline) results by rank: the artifact's schedule, then the Megatron-style
    baseline."""
    runs = [(overrides, "optimus", artifact, steps), (overrides, "baseline", None, steps)]
    per_rank = run_distributed(_train_runs, world, config, runs, timeout=timeout)
    return [r[0] for r in per_rank], [r[1] for r in per_rank]


def _assert_same(ours: list[dict], baseline: list[dict], llm_by_rank: bool = True) -> None:
    """Losses (None off the last stage) and gradient norms rank by rank; the encoders (other plans)
    whole, by
    global name; the LLM rank by rank where both sides place its layers alike (``llm_by_rank``),
    else whole by global name too."""
    for rank, (o, b) in enumerate(zip(ours, baseline)):
        assert o["losses"] == pytest.approx(b["losses"], abs=1e-5), f"rank {rank}"
        assert o["norms"] == pytest.approx(b["norms"], abs=1e-5), f"rank {rank}: gradient norms"
        if llm_by_rank:
            _assert_tensors_equal(o["llm"], b["llm"], f"rank {rank}")
    for part in ("encoder",) if llm_by_rank else ("llm", "encoder"):
        expected = {n: t for r in baseline for n, t in r[part].items()}
        assert expected
        _assert_tensors_equal({n: t for r in ours for n, t in r[part].items()}, expected, part)
    assert any(loss is not None for r in baseline for loss in r["losses"])


def _assert_tensors_equal(got: dict, expected: dict, where: str) -> None:
    assert got.keys() == expected.keys(), where
    for name, (weight, grad) in expected.items():
        assert abs(got[name][0] - weight).max() <= 1e-5, f"{where}: weight {name}"
        assert (got[name][1] is None) == (grad is None), (
            f"{where}: gradient of {name} on one side only"
        )
        if grad is not None:
            assert abs(got[name][1] - grad).max() <= 1e-5, f"{where}: gradient {name}"


@pytest.fixture(scope="module")
def tiny4() -> dict:
    """configs/tiny.yaml on 4 ranks (LLM PP2 TP2 V2), one launch: the baseline, then the Optimus
    runtime
    with the scheduler's encoder plan (DP4 PP1 TP1), with encoder DP2 PP2 TP1, with that artifact's
    hook points from shuffled predictions, and with its layers' kernels run as pieces of their
    tokens."""
    pp2 = _artifact([], {"pp": 2, "tp": 1})
    artifacts = {
        "scheduler-choice": _artifact([]),
        "enc-DP2-PP2-TP1": pp2,
        "shuffled": shuffled_hooks(pp2, seed=1),
        "pieces": split_kernels(pp2, TINY, [0.3, 0.55]),
    }
    runs = [([], "baseline", None, STEPS)] + [([], "optimus", a, STEPS) for a in artifacts.values()]
    per_rank = run_distributed(_train_runs, 4, TINY, runs, timeout=400)
    results = {name: [r[i + 1] for r in per_rank] for i, name in enumerate(artifacts)}
    return {
        "baseline": [r[0] for r in per_rank],
        **results,
        "artifacts": artifacts,
    }


@pytest.mark.parametrize("encoder_plan", ["scheduler-choice", "enc-DP2-PP2-TP1"])
def test_optimus_equals_megatron_baseline_on_4_ranks(tiny4, encoder_plan):
    """LLM PP2 TP2 V2; encoder (DP4, PP1, TP1) as the scheduler chooses it, or (DP2, PP2, TP1),
    whose encoder ops also run at the artifact's hook points."""
    _assert_same(tiny4[encoder_plan], tiny4["baseline"])
    if encoder_plan == "enc-DP2-PP2-TP1":
        artifact = tiny4["artifacts"][encoder_plan]
        assert (artifact.encoder_plan.pp, artifact.encoder_plan.tp) == (2, 1)
        _assert_ran_at_the_hook_points(tiny4[encoder_plan], artifact)


def test_kernels_run_as_pieces_of_their_tokens_train_like_the_baseline(tiny4):
    """Every layer kernel of the DP2 PP2 TP1 artifact in three pieces, at its hook points: same
    numbers."""
    artifact = tiny4["artifacts"]["pieces"]
    _assert_same(tiny4["pieces"], tiny4["baseline"])
    _assert_ran_at_the_hook_points(tiny4["pieces"], artifact)
    assert any(piece != (0.0, 1.0) for r in tiny4["pieces"] for *_, piece in r["record"])


def test_wrong_predictions_change_nothing_but_timing(tiny4):
    """Hook points from shuffled predictions: same numbers."""
    _assert_same(tiny4["shuffled"], tiny4["baseline"])


def _assert_ran_at_the_hook_points(results: list[dict], artifact: ScheduleArtifact) -> None:
    inside = 0
    for rank, r in enumerate(results):
        ran = [
            (ran_at, phase, k, index, piece) for ran_at, _, phase, k, index, piece in r["record"]
        ]
        assert ran == r["planned"], f"rank {rank}: execution differs from the plan"
        assert all(ran_at == scheduled for ran_at, scheduled, *_ in r["record"]), (
            f"rank {rank}: ops moved"
        )
        assert r["unplanned"] == [0] * STEPS, (
            f"rank {rank}: megatron-core ran TP collectives the plan lacks"
        )
        inside += sum(1 for event, *_ in ran if event.kind not in (EventKind.PRE, EventKind.POST))
    assert inside > 0, "some encoder ops run inside the LLM's ops, not only before or after it"
    from optimus_mllm.runtime.hook_plan import build_hook_plan

    plan = build_hook_plan(artifact)
    assert plan.moved_microbatches == ()  # so the plan is the artifact's placement
    assert all(op.event == op.assigned for st in plan.stages for op in st.ops)


SP_TIED = [
    "training.sequence_parallel=true",
    "model.llm.untie_embeddings_and_output_weights=false",
    "training.recompute=full",
]


MERGE = SP_TIED + ["model.encoders.0.projector.spatial_merge=2"]


def test_sequence_parallel_and_tied_embeddings_train_like_the_baseline():
    """LLM PP2 TP2 V2 with sequence parallelism (image tokens spliced, then scattered), the output
    layer
    tied to the input embedding across the pipeline (megatron-core's embedding-group gradient sum)
    and full recompute of every LLM layer; then the same with a 2x2 spatial merge before the
    projector (16 patches, 4 image tokens), the encoder on one GPU per image under Optimus (the
    merge of whole images) and sequence-parallel over the LLM's TP2 in the baseline (each rank
    merging its own 8 patches)."""
    runs = [
        (SP_TIED, "optimus", _artifact(SP_TIED), STEPS),
        (SP_TIED, "baseline", None, STEPS),
        (MERGE, "optimus", _artifact(MERGE, {"pp": 1, "tp": 1}), STEPS),
        (MERGE, "baseline", None, STEPS),
    ]
    per_rank = run_distributed(_train_runs, 4, TINY, runs, timeout=400)
    _assert_same([r[0] for r in per_rank], [r[1] for r in per_rank])
    merged, baseline = [r[2] for r in per_rank], [r[3] for r in per_rank]
    _assert_same(merged, baseline)
    projector = {
        n: w.shape
        for r in baseline
        for n, (w, _) in r["encoder"].items()
        if n.endswith("projection.encoder.linear_fc1.weight")
    }
    # LLM hidden x 2*2 merged ViT widths
    assert list(projector.values()) == [(64, 4 * 32)], projector


# Megatron-LM pretrain_vlm.py's vision path on tiny.yaml's sizes: CLIP's class token before 9
# patches (10 tokens: sequence-parallel over TP2), the projector a SwiGLU MLP 96 wide without biases
CLASS_TOKEN = [
    "training.sequence_parallel=true",
    "model.encoders.0.seq_length=9",
    "model.encoders.0.model_subtype=clip",
    "model.encoders.0.class_token=true",
    "model.encoders.0.projector={ffn_hidden_size: 96, activation: silu, gated_linear_unit: true, "
    "add_bias_linear: false}",
]
CLASS_TOKEN_DROPPED = [*CLASS_TOKEN, "model.encoders.0.drop_class_token=true"]


def test_a_class_token_and_a_swiglu_projector_train_like_the_baseline():
    """The class token kept (10 image tokens) with the encoder sequence-parallel over TP2, the
    class token on the first rank's share; then dropped (9 image tokens) with the encoder on two
    pipeline stages, its hidden states (class token included) sent between them."""
    runs = [
        (CLASS_TOKEN, "optimus", _artifact(CLASS_TOKEN, {"pp": 1, "tp": 2}), STEPS),
        (CLASS_TOKEN, "baseline", None, STEPS),
        (CLASS_TOKEN_DROPPED, "optimus", _artifact(CLASS_TOKEN_DROPPED, {"pp": 2, "tp": 1}), STEPS),
        (CLASS_TOKEN_DROPPED, "baseline", None, STEPS),
    ]
    per_rank = run_distributed(_train_runs, 4, TINY, runs, timeout=400)
    for kept in (0, 2):
        ours, baseline = [r[kept] for r in per_rank], [r[kept + 1] for r in per_rank]
        _assert_same(ours, baseline)
        names = {n for r in baseline for n in r["encoder"]}
        assert any(n.endswith("class_token") for n in names), sorted(names)


def test_the_paper_figure_5_twin_trains_like_the_baseline():
    """configs/paper/small/fig5_8gpu.yaml: the paper's Figure 5 plan (PP4 TP2, two chunks per rank)
    with
    sequence parallelism, selective recompute, tied embeddings and the distributed optimizer."""
    config = str(CONFIGS / "paper" / "small" / "fig5_8gpu.yaml")
    _assert_same(*_both(8, [], artifact_for(config), config=config, timeout=500))


def test_optimus_equals_megatron_baseline_with_two_llm_replicas():
    """LLM DP2 PP2 TP1 V2 with the scheduler's encoder plan: each LLM replica's microbatches, and
    the gradients averaged over both."""
    _assert_same(*_both(4, LLM_DP2, _artifact(LLM_DP2)))


PP4_V2 = ["model.llm.num_layers=8", "parallel.llm={dp: 1, pp: 4, tp: 1, vp: 2}"]


@pytest.mark.parametrize(
    "overrides, warmup",
    [([], [3, 2]), (PP4_V2, None)],
    ids=["PP2-forced-3-2", "PP4-V2-scheduler-adjusted"],
)
def test_adjusted_warmups_train_like_the_baseline(overrides, warmup):
    """Fewer warm-up forwards than megatron-core's (paper Fig. 12): no hang, the baseline's numbers.

    megatron-core's own communicator hangs on PP4's [8, 7, 6, 4] and, at PP2, lets a forward
    activation match a gradient's receive; the runtime's channel communicator runs both.
    """
    artifact = _artifact(overrides)
    if warmup is None:
        assert artifact.warmup != artifact.default_warmup, "the scheduler adjusted nothing here"
    else:
        artifact = with_warmup(artifact, warmup)
    _assert_same(*_both(4, overrides, artifact))


DROPOUT = [
    f"model.{part}.{name}=0.1"
    for part in ("llm", "encoders.0")
    for name in ("hidden_dropout", "attention_dropout")
]


def test_dropout_draws_the_baselines_masks_under_an_adjusted_warmup():
    """Hidden and attention dropout in the LLM and the encoder, with sequence parallelism and full
    recompute;
    the PP2 warm-up forced to [3, 2]. Optimus runs the encoder under another plan than the
    baseline's TP2, its ops at hook points inside the LLM's: the same masks, so the same numbers."""
    overrides = DROPOUT + SP_TIED
    artifact = with_warmup(_artifact(overrides), [3, 2])
    assert artifact.encoder_plan.tp != 2, (
        "the encoder plan is the baseline's (TP2 in the first stage)"
    )
    _assert_same(*_both(4, overrides, artifact))


def test_five_steps_of_adamw_with_warmup_and_cosine_decay():
    """AdamW, clipping at 1.0 and the distributed optimizer (the config's defaults), a one-step
    warm-up then
    cosine decay; encoder DP2 PP2, so its gradients are averaged over the LLM's one replica, not its
    two."""
    overrides = [
        "training.lr=1e-3",
        "training.min_lr=1e-4",
        "training.lr_warmup_iters=1",
        "training.lr_decay_style=cosine",
        "training.train_iters=5",
    ]
    optimus, baseline = _both(4, overrides, _artifact(overrides, {"pp": 2, "tp": 1}), steps=5)
    _assert_same(optimus, baseline)
    # megatron-core's schedule: 0 in the warm-up step, then min + (max - min) * (1 + cos(pi * done))
    # / 2
    expected = [0.0] + [
        1e-4 + 0.9e-3 * (1 + math.cos(math.pi * (k - 1) / 4)) / 2 for k in range(1, 5)
    ]
    assert optimus[0]["lrs"] == pytest.approx(expected)
    assert any(norm > 1.0 for norm in optimus[0]["norms"]), "clipping at 1.0 had nothing to clip"


@pytest.fixture(scope="module")
def low_precision() -> dict:
    """bf16 and fp16, each under both runtimes, in one launch of 4 ranks."""
    runs, names = [], []
    for precision in ("bf16", "fp16"):
        overrides = [f"training.precision={precision}", "training.initial_loss_scale=1024"]
        runs += [
            (overrides, "optimus", _artifact(overrides), STEPS),
            (overrides, "baseline", None, STEPS),
        ]
        names += [(precision, "optimus"), (precision, "baseline")]
    per_rank = run_distributed(_train_runs, 4, TINY, runs, timeout=400)
    return {name: [r[i] for r in per_rank] for i, name in enumerate(names)}


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_trains_like_the_baseline(low_precision, precision):
    """bf16 / fp16 weights with megatron-core's fp32 main weights (and, for fp16, dynamic loss
    scaling from a
    scale low enough that no step is skipped): both runtimes agree to the precision's resolution.
    The second step's gradient norm gets 3 %: the first update moves weights by about one bf16 unit,
    so the two runtimes' rounding of them differs in places (1.3 % apart on an AVX512-BF16 CPU;
    within 1 % on earlier CI hosts)."""
    optimus, baseline = low_precision[precision, "optimus"], low_precision[precision, "baseline"]
    for o, b in zip(optimus, baseline):
        assert None not in o["norms"] and None not in b["norms"], "a step was skipped"
        assert o["norms"][0] == pytest.approx(b["norms"][0], rel=1e-2)
        assert o["norms"][1:] == pytest.approx(b["norms"][1:], rel=3e-2)
        if b["losses"][0] is not None:
            assert o["losses"] == pytest.approx(b["losses"], abs=5e-3)


TWO_RANKS = [
    "cluster.num_gpus=2",
    "cluster.gpus_per_node=2",
    "parallel.llm={dp: 1, pp: 2, tp: 1, vp: 2}",
]


def _inside_a_megatron_job() -> dict:
    """A trainer on its own; then inside a job whose parallel state initialize_megatron set up for
    another
    plan (refused), and for this job's plan (joined)."""
    from megatron.core import parallel_state

    import megatron_patches
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
    return {
        "alone": loss_alone,
        "joined": loss,
        "error": error,
        "kept": parallel_state.model_parallel_is_initialized() and megatron_patches.is_applied(),
    }


def test_a_trainer_joins_the_parallel_state_of_a_megatron_job_for_its_plan():
    results = run_distributed(_inside_a_megatron_job, 2, timeout=120)
    assert all(
        r["error"]
        == (
            "megatron-core's parallel state is already initialised for LLM DP1 PP1 TP2, but this "
            "job's LLM plan is DP1 PP2 TP1 V2; give Megatron the plan's "
            "--tensor-model-parallel-size, "
            "--pipeline-model-parallel-size and virtual stages, or re-run optimus-plan"
        )
        for r in results
    )
    assert all(r["kept"] for r in results), "the job's parallel state and patches are left in place"
    assert results[1]["joined"] is not None and [r["joined"] for r in results] == [
        r["alone"] for r in results
    ]


# The balanced baseline's splits of tiny.yaml (2 encoder + 4 LLM layers; 3 encoder layers under
# DP2 and PP4, where the cost model keeps 2 in one stage): at V2 the encoder's layers on virtual
# stages 0 and 1 (encoder hidden states, then image embeddings cross a boundary), at V1 one stage
# with both encoder layers and the first LLM layer, the other with three LLM layers. Tied word
# embeddings: at V2 on pipeline rank 0's second chunk, at PP4 on rank 2 (the output layer on
# rank 3).
TIED = "model.llm.untie_embeddings_and_output_weights=false"
THREE = "model.encoders.0.num_layers=3"
BALANCED = {
    "tp2-vp2": [],
    "tp2-vp2-sp": ["training.sequence_parallel=true"],
    "tp2-vp1": ["parallel.llm={dp: 1, pp: 2, tp: 2, vp: 1}"],
    "dp2-vp2": [THREE, *LLM_DP2],
    "tp2-vp2-tied": [TIED],
    "dp2-vp2-tied": [TIED, THREE, *LLM_DP2],
    "pp4-tied": [TIED, THREE, "parallel.llm={dp: 1, pp: 4, tp: 1, vp: 1}"],
}


@pytest.fixture(scope="module")
def balanced() -> dict:
    """The balanced baseline and the Megatron-style baseline under each of ``BALANCED``'s plans, one
    launch."""
    runs = [
        (overrides, mode, None, STEPS)
        for overrides in BALANCED.values()
        for mode in ("baseline", "balanced")
    ]
    per_rank = run_distributed(_train_runs, 4, TINY, runs, timeout=400)
    return {
        name: ([r[2 * i] for r in per_rank], [r[2 * i + 1] for r in per_rank])
        for i, name in enumerate(BALANCED)
    }


def test_balanced_splits_cover_every_kind_of_boundary():
    from optimus_mllm.config import load_config
    from optimus_mllm.planner import plan
    from optimus_mllm.runtime.balanced import llm_layout, split_ranges
    from optimus_mllm.scheduler.baselines import balanced_layer_ranges

    def parts(overrides):
        config = load_config(TINY, overrides)
        return split_ranges(
            balanced_layer_ranges(config, plan(config).llm_plan), config.encoders[0].num_layers
        )

    assert parts(BALANCED["tp2-vp2"]) == [
        ((0, 1), None),
        ((1, 2), None),
        (None, (0, 2)),
        (None, (2, 4)),
    ]
    assert parts(BALANCED["tp2-vp1"]) == [((0, 2), (0, 1)), (None, (1, 4))]
    assert llm_layout(parts(BALANCED["tp2-vp1"]), 4) == [
        ["embedding", "decoder"],
        ["decoder", "decoder", "decoder", "loss"],
    ]
    assert (
        parts(BALANCED["dp2-vp2"])
        == parts(BALANCED["pp4-tied"])
        == [
            ((0, 2), None),
            ((2, 3), None),
            (None, (0, 2)),
            (None, (2, 4)),
        ]
    )


@pytest.mark.parametrize("name", BALANCED)
def test_balanced_baseline_trains_like_the_megatron_baseline(balanced, name):
    """Layers moved between pipeline ranks, the LLM's unevenly: the same losses, gradient norms, and
    every weight and gradient by global name."""
    baseline, ours = balanced[name]
    _assert_same(ours, baseline, llm_by_rank=False)


# per TP mode: its config, and the encoder layers' attention and QKV linear classes
OTHER_MODES = {
    "metp": (METP_TINY, "MetpSelfAttention _Linear"),
    "2d": (SUMMA_TINY, "SelfAttention Linear2D"),
}


def _train_configs(runs: dict[str, list[tuple]]) -> dict[str, list[dict]]:
    """One rank: ``_train_runs`` of each config in turn (one launch for all)."""
    return {config: _train_runs(config, config_runs) for config, config_runs in runs.items()}


def test_encoder_plans_in_other_tp_modes_train_like_the_baseline():
    """configs/metp_tiny.yaml (LLM PP2 TP2) and configs/summa_tiny.yaml (LLM PP1 TP4) on 4 ranks,
    3 steps each: optimus-plan's METP or 2D encoder plan (no 1D plan fits its memory) under the
    Optimus runtime, its ops hooked at random LLM kernels (so its ring, broadcasts and reduces run
    between the LLM's ops and collectives), against the Megatron-style baseline running the same
    encoder in the same mode over the LLM's TP group in the first stage: the same losses, gradient
    norms, weights and gradients."""
    runs = {}
    for mode, (config, _) in OTHER_MODES.items():
        planned = artifact_for(config)
        assert planned.encoder_plan.tp_mode == mode
        runs[config] = [([], "baseline", None, 3), ([], "optimus", shuffled_hooks(planned, 1), 3)]
    per_rank = run_distributed(_train_configs, 4, runs, timeout=600)
    for mode, (config, attention) in OTHER_MODES.items():
        baseline, ours = zip(*(rank[config] for rank in per_rank))
        _assert_same(list(ours), list(baseline))
        for results in (ours, baseline):
            assert {name for r in results for name in r["attention"]} == {attention}, mode
        outside = (EventKind.PRE, EventKind.POST)
        assert any(op[0].kind not in outside for r in ours for op in r["record"]), mode
