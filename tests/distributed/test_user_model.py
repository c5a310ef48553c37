"""A Megatron-LM user's own model_provider and forward_step (``tests/support/user_vlm.py``:
megatron-core's CLIPViTModel, MultimodalProjector and GPTModel in LLaVA's layout) under both
runtimes: without the flag as built, with it the encoder on its own plan, its kernels in the LLM's
bubbles."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch.nn.functional as F

from support.distributed_utils import run_distributed
from support.paths import MEGATRON_TINY_FLAGS, REPO

pytestmark = pytest.mark.distributed

CONFIG = str(REPO / "configs" / "megatron_tiny.yaml")
STEPS = 2


def _scheduled(config: Any) -> Any:
    """The schedule of the job as the user's model describes it (what ``optimus-plan`` writes)."""
    from optimus_mllm.planner import plan
    from optimus_mllm.scheduler.artifact import schedule_job_artifact

    return schedule_job_artifact(config, plan(config))


def _user_model(
    config: Any,
    llm_plan: Any,
    without_vision: bool = False,
    scaled_vision: bool = False,
    hooked_vision: bool = False,
    **changes: Any,
) -> Any:
    from optimus_mllm.runtime.user_model import UserModel

    from support import user_vlm

    tokens = user_vlm.image_tokens(
        changes.get("class_token", False), changes.get("drop_class_token", False)
    )
    provider = partial(
        user_vlm.model_provider,
        tp=llm_plan.tp,
        pp=llm_plan.pp,
        vp=llm_plan.vp if llm_plan.vp > 1 else None,
        **changes,
    )
    if without_vision:  # a first stage whose model lacks LLaVA's vision_model
        provider = partial(_without_vision, provider)
    if scaled_vision:  # a vision model whose forward does one more thing than its layers show
        provider = partial(_scaled_vision, provider)
    if hooked_vision:  # one whose backward does: its output's gradient doubled by a hook
        provider = partial(_hooked_vision, provider)
    return UserModel(provider, user_vlm.forward_step, user_vlm.batches(llm_plan.dp, STEPS, tokens))


def _without_vision(provider: Any, *args: Any, **kwargs: Any) -> Any:
    model = provider(*args, **kwargs)
    if hasattr(model, "vision_model"):
        del model.vision_model
    return model


def _scaled_vision(provider: Any, *args: Any, **kwargs: Any) -> Any:
    model = provider(*args, **kwargs)
    vision = getattr(model, "vision_model", None)
    if vision is not None:
        forward = vision.forward
        vision.forward = lambda *a, **k: forward(*a, **k) * 1.5
    return model


def _hooked_vision(provider: Any, *args: Any, **kwargs: Any) -> Any:
    model = provider(*args, **kwargs)
    vision = getattr(model, "vision_model", None)
    if vision is not None:

        def doubled_in_backward(_: Any, __: Any, out: Any) -> None:
            if out.requires_grad:
                out.register_hook(lambda g: 2 * g)

        vision.register_forward_hook(doubled_in_backward)
    return model


def _vision_grads(trainer: Any) -> dict:
    """The vision model's and projector's whole gradients under LLaVA's keys, wherever they live:
    read as the modules' own sharded state with each parameter's data swapped for its gradient
    (megatron-core's SwiGLU factory chunks the parameter itself)."""
    from optimus_mllm.runtime.sharded_state import (
        encoder_sharded_state_dict,
        global_shapes,
        whole_tensors,
    )
    from optimus_mllm.runtime.user_model import vision_modules, vision_sharded_state_dict

    trainer.gather_gradients()
    if trainer.encoder is not None:
        modules = [trainer.encoder]
    else:
        modules = list(vision_modules(trainer.modules[0])) if trainer.stage == 0 else []
    params = [p for module in modules for p in module.parameters()]
    weights = [p.data for p in params]
    for p in params:
        p.data = p.main_grad.clone()
    try:
        if trainer.encoder is not None:
            state = encoder_sharded_state_dict(
                trainer.config, trainer.encoder, trainer.groups.dp_group
            )
        else:
            state = vision_sharded_state_dict(trainer.modules[0]) if trainer.stage == 0 else {}
        return whole_tensors(state, global_shapes(state), "test")
    finally:
        for p, weight in zip(params, weights):
            p.data = weight


def _both_runtimes(overrides: list[str], user: dict[str, Any]) -> dict:
    """Each runtime from the user's provider: step losses and grad norms, then the LLM's gradients
    and the vision weights after the steps; compared here, on the rank, and reported as
    differences."""
    from optimus_mllm.config import load_config
    from optimus_mllm.costing.cost_model import CostModel
    from optimus_mllm.planner import ParallelPlan, plan
    from optimus_mllm.runtime.trainer import Trainer
    from optimus_mllm.scheduler.encoder_costs import build_encoder_work

    config = load_config(CONFIG, [f"training.train_iters={STEPS}", *overrides])
    planned = plan(config)
    runs = {}
    for mode in ("baseline", "optimus"):
        trainer = Trainer(
            config,
            planned.llm_plan,
            mode,
            _scheduled if mode == "optimus" else None,
            user_model=_user_model(config, planned.llm_plan, **user),
        )
        steps = [trainer.train_step(0)]
        vision = _vision_grads(trainer)  # the first step's, from the same weights
        steps += [trainer.train_step(i) for i in range(1, STEPS)]
        trainer.gather_gradients()
        grads = {
            f"{i}.{name}": p.main_grad.clone()
            for i, model in enumerate(trainer.models)
            for name, p in model.module.language_model.named_parameters()
        }
        runs[mode] = {
            "steps": [(s.loss, s.grad_norm) for s in steps],
            "grads": grads,
            "vision": vision,
            "trainer": trainer,
        }
    optimus = runs["optimus"]["trainer"]
    llm = planned.llm_plan
    work = build_encoder_work(
        optimus.config,
        ParallelPlan(llm.dp, llm.pp, llm.tp),
        optimus.optimus.enc_plan,
        CostModel.from_config(config),
    )
    stage = optimus.groups.coords.pp
    chains = {
        phase: (
            [
                (k.encoder, k.layer, k.name, k.splittable)
                for k in getattr(work, phase)[stage].kernels
            ],
            optimus.optimus.ops.chain(phase),
        )
        for phase in ("fwd", "bwd")
    }
    report = {
        "steps": {mode: run["steps"] for mode, run in runs.items()},
        "grad_diff": max(
            (runs["baseline"]["grads"][k] - g).abs().max().item()
            for k, g in runs["optimus"]["grads"].items()
        ),
        "same_grad_names": runs["baseline"]["grads"].keys() == runs["optimus"]["grads"].keys(),
        "vision_keys": sorted(runs["baseline"]["vision"]),
        "same_vision_keys": runs["baseline"]["vision"].keys() == runs["optimus"]["vision"].keys(),
        "vision_diff": max(
            ((runs["baseline"]["vision"][k] - g).abs().max() / g.abs().max()).item()
            for k, g in runs["optimus"]["vision"].items()
        ),
        "chains_equal": all(expected == got for expected, got in chains.values()),
        "encoder_plan": str(optimus.optimus.enc_plan),
        "warmup": optimus.warmup,
        "ops_run": len(steps[-1].encoder_record),
        "ops_inside_llm": steps[-1].ops_inside_llm,
    }
    for run in runs.values():
        run["trainer"].close()
    return report


# Megatron-LM's pretrain_vlm.py with --swiglu: CLIP with its class token (kept: one more image
# token), the vision model and projector copies of the language model's SwiGLU config
_SWIGLU = {"gated_linear_unit": True, "activation_func": F.silu}
PRETRAIN_VLM_SWIGLU = (
    [
        "model.encoders.0.class_token=true",
        "model.llm.seq_length=65",
        *(
            f"{part}.{field}"
            for part in ("model.llm", "model.encoders.0", "model.encoders.0.projector")
            for field in ("gated_linear_unit=true", "activation=silu")
        ),
        "model.encoders.0.projector.ffn_hidden_size=256",
    ],
    {
        "class_token": True,
        "projection_from_language": True,
        "language_changes": _SWIGLU,
        "vision_changes": _SWIGLU,
    },
)
CLASS_TOKEN_RUNS = ("pretrain-vlm-swiglu-class-token",)
PLANS = {
    # the planner's encoder plan; its schedule puts kernels inside the LLM's steps
    "planned": ([], {}),
    "llm-dp2-encoder-pp2": (
        ["parallel.llm={dp: 2, pp: 2, tp: 1, vp: 2}", "parallel.encoder={pp: 2, tp: 1}"],
        {},
    ),
    "pretrain-vlm-swiglu-class-token": PRETRAIN_VLM_SWIGLU,
}


def _rank_runs(folder: str) -> dict:
    """One rank of every run here, in one launch: each plan under both runtimes, checkpoints across
    the runtimes (written under ``folder``), then the refusals."""
    return {
        **{name: _both_runtimes(overrides, user) for name, (overrides, user) in PLANS.items()},
        "resumed": _resumed_across_runtimes(folder),
        "refusals": _refusals(),
    }


@pytest.fixture(scope="module")
def user_runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_distributed(_rank_runs, 4, str(tmp_path_factory.mktemp("checkpoints")), timeout=600)


def _resumed_across_runtimes(folder: str) -> dict:
    """The baseline trains 3 steps, saving after the first; the Optimus runtime loads that and
    trains step 2,
    saving after it; the baseline loads Optimus's and trains step 3: (loss, grad norm) of each."""
    from optimus_mllm.config import load_config
    from optimus_mllm.planner import plan
    from optimus_mllm.runtime import checkpoint, checkpoint_meta
    from optimus_mllm.runtime.trainer import Trainer

    config = load_config(CONFIG, ["training.train_iters=3"])
    planned = plan(config)

    def trainer(mode: str) -> Any:
        return Trainer(
            config,
            planned.llm_plan,
            mode,
            _scheduled if mode == "optimus" else None,
            user_model=_user_model(config, planned.llm_plan),
        )

    def numbers(step: Any) -> tuple:
        return step.loss, step.grad_norm

    first = trainer("baseline")
    first.train_step(0)
    checkpoint.save_checkpoint(first, folder, 1)
    uninterrupted = [numbers(first.train_step(i)) for i in (1, 2)]
    first.close()
    second = trainer("optimus")
    checkpoint.load_checkpoint(second, checkpoint_meta.latest_checkpoint(folder))
    resumed = [numbers(second.train_step(1))]
    checkpoint.save_checkpoint(second, folder, 2)
    second.close()
    third = trainer("baseline")
    checkpoint.load_checkpoint(third, checkpoint_meta.latest_checkpoint(folder))
    resumed.append(numbers(third.train_step(2)))
    third.close()
    return {"uninterrupted": uninterrupted, "resumed": resumed}


def test_a_users_model_resumes_across_the_runtimes(user_runs: list[dict]) -> None:
    """Checkpoints of the user's model hold its vision model under LLaVA's keys, whichever runtime
    wrote
    them: Optimus resumes the baseline's, the baseline Optimus's, with the uninterrupted numbers."""
    for rank, runs in enumerate(user_runs):
        uninterrupted, resumed = runs["resumed"]["uninterrupted"], runs["resumed"]["resumed"]
        for (u_loss, u_norm), (r_loss, r_norm) in zip(uninterrupted, resumed):
            assert (u_loss is None) == (r_loss is None), rank
            assert u_loss is None or r_loss == pytest.approx(u_loss, rel=1e-5), (
                rank,
                uninterrupted,
                resumed,
            )
            assert r_norm == pytest.approx(u_norm, rel=1e-5), (rank, uninterrupted, resumed)
    assert any(runs["resumed"]["resumed"][0][0] is not None for runs in user_runs)


@pytest.mark.parametrize(
    "plans, in_bubbles",
    [("planned", True), ("llm-dp2-encoder-pp2", False), ("pretrain-vlm-swiglu-class-token", True)],
)
def test_a_users_model_trains_the_same_with_and_without_the_flag(
    user_runs: list[dict], plans: str, in_bubbles: bool
) -> None:
    reports = [runs[plans] for runs in user_runs]
    for rank, report in enumerate(reports):
        baseline, optimus = report["steps"]["baseline"], report["steps"]["optimus"]
        for (b_loss, b_norm), (o_loss, o_norm) in zip(baseline, optimus):
            assert (b_loss is None) == (o_loss is None), rank
            assert b_loss is None or abs(b_loss - o_loss) <= 1e-6 * abs(b_loss), (
                rank,
                baseline,
                optimus,
            )
            assert abs(b_norm - o_norm) <= 1e-6 * b_norm, (rank, baseline, optimus)
        assert report["same_grad_names"] and report["grad_diff"] < 1e-6, (rank, report["grad_diff"])
        assert report["same_vision_keys"] and report["vision_diff"] < 1e-5, (
            rank,
            report["vision_diff"],
        )
        assert report["chains_equal"], rank
    first = reports[0]
    assert any(key.startswith("vision_model.decoder.layers.") for key in first["vision_keys"])
    assert any(
        key.startswith("vision_projection.encoder.linear_fc1") for key in first["vision_keys"]
    )
    # pretrain_vlm.py's CLIP: its class token trained in both runtimes, compared above
    assert ("vision_model.class_token" in first["vision_keys"]) == (plans in CLASS_TOKEN_RUNS)
    assert any(loss is not None for loss, _ in (r["steps"]["optimus"][0] for r in reports))
    # every rank ran encoder kernels under the encoder plan
    assert all(r["ops_run"] > 0 for r in reports)
    assert any(r["ops_inside_llm"] > 0 for r in reports) == in_bubbles, [
        r["ops_inside_llm"] for r in reports
    ]


def _refusals() -> list[str]:
    """Every rank's error for user models the Optimus encoder cannot run as built, or without
    LLaVA's layout, or whose LLM the config does not describe; where the model is built, the
    start-up probe's line or error."""
    from megatron.core import parallel_state

    from optimus_mllm.config import load_config
    from optimus_mllm.errors import OptimusError
    from optimus_mllm.planner import plan
    from optimus_mllm.runtime.trainer import Trainer

    config = load_config(CONFIG, [])
    planned = plan(config)
    errors = []
    for changes in (
        {"vision_changes": {"layernorm_epsilon": 1e-6}},
        {"language_changes": {"num_attention_heads": 8}},
        {"without_vision": True},
        # the config keeps the class token its forward drops
        {"class_token": True, "drop_class_token": True},
        {},
        {"scaled_vision": True},
        {"hooked_vision": True},
    ):
        try:
            trainer = Trainer(
                config,
                planned.llm_plan,
                "optimus",
                _scheduled,
                user_model=_user_model(config, planned.llm_plan, **changes),
            )
            errors.append(trainer.probe_user_vision(0))
        except OptimusError as exc:
            errors.append(str(exc))
        parallel_state.destroy_model_parallel()
    return errors


def test_what_the_encoder_cannot_run_as_built_is_refused_on_every_rank(
    user_runs: list[dict],
) -> None:
    """What the config does not describe but the built model shows (its widths, class token,
    projector) is read off the model (``test_a_llava_1_5_model_the_flags_do_not_describe_trains``);
    what is refused names a change the user can make."""
    reports = [runs["refusals"] for runs in user_runs]
    # every rank alike, but for the probe's cost, which each rank measures
    assert all(report[:4] + report[5:] == reports[0][:4] + reports[0][5:] for report in reports)
    epsilon, heads, no_vision, dropped, matching, scaled, hooked = reports[0]
    assert epsilon == (
        "model_provider: the vision model's TransformerConfig.layernorm_epsilon is 1e-06; the "
        "Optimus encoder's layers run 1e-05: build the vision model with that"
    )
    assert heads.startswith(
        "model_provider: the language model's TransformerConfig.num_attention_heads is 8, "
        "but model.llm describes 4"
    )
    # seen by the first stage's ranks alone, refused by every rank
    assert no_vision.startswith(
        "model_provider: the first pipeline stage's VisionLanguageModel lacks vision_model"
    )
    assert dropped == (
        "the start-up probe: the model's forward drops the vision model's class token before "
        "vision_projection, but the job keeps it (Megatron-LM's --disable-vision-class-token, "
        "model.encoders[0].drop_class_token: false); give --disable-vision-class-token "
        "(drop_class_token: true)"
    )
    # built as described: the start-up probe runs the vision path both ways and says what it cost
    assert matching.startswith(
        "optimus: start-up probe: the model's vision path and the Optimus encoder's agree"
    ), matching
    assert matching.endswith(" ms")
    assert scaled.startswith(
        "the start-up probe: the Optimus encoder's image tokens differ from the model's "
        "vision_projection(vision_model(images))"
    ), scaled
    assert hooked.startswith("the start-up probe: the vision weights' gradients differ by "), hooked
    assert "though their forwards agree" in hooked


# Megatron-LM's flags of the tiny job at TP2 PP2 VPP2, without dropout: they describe
# pretrain_vlm.py's model, CLIP with its class token (dropped: --disable-vision-class-token) and the
# LLM's MLP (ffn 256) as projector
LLAVA_1_5_FLAGS = (*MEGATRON_TINY_FLAGS, "--hidden-dropout", "0", "--attention-dropout", "0")
# a LLaVA-1.5-shaped model of the user's own (tests/support/user_vlm.py): CLIP without a class
# token, or with one its forward drops; its projector Linear, GELU, Linear at the LLM's width (64)
LLAVA_1_5_MODELS = {
    "no class token": {},
    "class token dropped": {"class_token": True, "drop_class_token": True},
}


def _llava_1_5_runs() -> dict:
    """Each LLaVA-1.5-shaped model under the config the flags make, without the flag and with it:
    (loss, grad norm) per step, and with the flag the start-up probe's line and the encoder ops
    run."""
    from megatron.core import parallel_state

    from optimus_mllm.megatron.arguments import add_optimus_args, parse_args, validate_args
    from optimus_mllm.megatron.flags import config_from_megatron_args
    from optimus_mllm.planner import plan
    from optimus_mllm.runtime.trainer import Trainer

    args = validate_args(parse_args(add_optimus_args, list(LLAVA_1_5_FLAGS)), 4)
    config = config_from_megatron_args(args, 4, 4)
    llm_plan = plan(config).llm_plan
    runs: dict = {}
    for name, model in LLAVA_1_5_MODELS.items():
        for mode in ("baseline", "optimus"):
            trainer = Trainer(
                config,
                llm_plan,
                mode,
                _scheduled if mode == "optimus" else None,
                user_model=_user_model(config, llm_plan, **model),
            )
            probe = trainer.probe_user_vision(0) if mode == "optimus" else None
            steps = [trainer.train_step(i) for i in range(STEPS)]
            runs[name, mode] = {
                "steps": [(s.loss, s.grad_norm) for s in steps],
                "probe": probe,
                "ops_run": sum(len(s.encoder_record) for s in steps),
                "projector_ffn": trainer.config.encoders[0].projector.ffn_hidden_size,
            }
            trainer.close()
            parallel_state.destroy_model_parallel()
    return runs


def test_a_llava_1_5_model_the_flags_do_not_describe_trains_with_the_plain_numbers() -> None:
    """The flag reads the vision path off the built model (``with_user_model``, as through
    Megatron-LM's seams): CLIP without the class token the flags describe, or with one its forward
    drops, and a projector of another ffn width than the flags' train at TP2 PP2 VPP2 with the
    plain run's losses and gradient norms."""
    reports = run_distributed(_llava_1_5_runs, 4, timeout=600)
    for rank, runs in enumerate(reports):
        for name in LLAVA_1_5_MODELS:
            plain, flagged = runs[name, "baseline"], runs[name, "optimus"]
            for (p_loss, p_norm), (f_loss, f_norm) in zip(plain["steps"], flagged["steps"]):
                assert (p_loss is None) == (f_loss is None), (rank, name)
                assert p_loss is None or f_loss == pytest.approx(p_loss, rel=1e-5), (
                    rank,
                    name,
                    plain["steps"],
                    flagged["steps"],
                )
                assert f_norm == pytest.approx(p_norm, rel=1e-5), (rank, name)
            assert flagged["probe"].startswith("optimus: start-up probe: "), flagged["probe"]
            assert "agree" in flagged["probe"], flagged["probe"]
            assert flagged["ops_run"] > 0 and flagged["projector_ffn"] == 64, (rank, name)
    assert any(
        loss is not None
        for runs in reports
        for loss, _ in runs["no class token", "optimus"]["steps"]
    )


def test_batches_follow_megatrons_pretraining_sampler() -> None:
    """Each iteration reads the next global batch; microbatch step k of DP rank r holds samples
    k * micro * dp + r * micro onwards (Megatron-LM's MegatronPretrainingSampler)."""
    from optimus_mllm.runtime.user_model import pretraining_sampler_batches

    batch = pretraining_sampler_batches(list(range(100)), 2, 2, 8)  # 2 microbatches per DP rank
    # global microbatches are counted DP rank by DP rank: (rank 0: step 0, step 1), (rank 1: step 0,
    # step 1)
    assert [batch(0, g).tolist() for g in range(4)] == [[0, 1], [4, 5], [2, 3], [6, 7]]
    assert batch(1, 0).tolist() == [8, 9]


def test_the_step_loss_reads_either_form_of_megatrons_lm_loss() -> None:
    import torch

    from optimus_mllm.runtime.trainer import mean_lm_loss

    assert mean_lm_loss([{"lm loss": torch.tensor(1.0)}, {"lm loss": torch.tensor(3.0)}]) == 2.0
    # the per-token form: [loss sum, tokens] per microbatch, averaged over all tokens
    # (6 + 2) / (2 + 4) tokens, not the mean of 6 / 2 and 2 / 4
    assert mean_lm_loss(
        [{"lm loss": torch.tensor([6.0, 2.0])}, {"lm loss": torch.tensor([2.0, 4.0])}]
    ) == pytest.approx(8 / 6)


def test_a_spatial_merge_is_refused_for_a_users_llava_model() -> None:
    """LLaVA's layout feeds every vision token to its projector; a config that merges them does not
    describe it, so it is refused before the model is looked at."""
    import dataclasses

    from optimus_mllm.config import ProjectorConfig, load_config
    from optimus_mllm.runtime.user_model import user_vision_problem

    encoder = load_config(REPO / "configs" / "megatron_tiny.yaml").encoders[0]
    merged = dataclasses.replace(encoder, projector=ProjectorConfig(spatial_merge=2))
    assert user_vision_problem(merged, None, None, 64) == (
        "model.encoders[0].projector.spatial_merge is 2, but a user's model (LLaVA's layout) "
        "merges no tokens "
        "before its projector; set it to 1"
    )
