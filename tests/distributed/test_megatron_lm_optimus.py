"""Megatron-LM's own ``pretrain_vlm.py`` (tag ``core_v0.16.1``) with the one-line opt-in and
``--optimus-schedule auto``: its ``LLaVAModel`` (CLIP with the class token, the projector that
follows the LLM's MLP) trains, evaluates, saves and resumes with the numbers of the run without
the flag. Needs a checkout named by ``MEGATRON_LM_DIR``; skipped without.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from optimus_mllm.cli.plan import main as optimus_plan

from support.paths import load_script

_compare = load_script("megatron_lm_compare")
CHECKOUT = _compare.megatron_lm_dir()

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(
        CHECKOUT is None, reason="MEGATRON_LM_DIR (a Megatron-LM checkout at core_v0.16.1) is unset"
    ),
]

AUTO = ("--optimus-schedule", "auto")
_VALIDATION = re.compile(r"validation loss at iteration (\d+) \| lm loss value: ([0-9.E+-]+)")


def _train(
    script: Path, args: tuple[str, ...], iterations: tuple[int, ...] = (1, 2, 3), nodes: int = 1
):
    run = _compare.run_megatron_script(
        script, 4 // nodes, [*_compare.TINY_VLM_ARGS, *args], nodes=nodes
    )
    assert run.returncode == 0, run.output[-4000:]
    assert tuple(i.number for i in run.iterations) == iterations, run.output[-4000:]
    return run


def _ran_optimus(run) -> None:
    """The flagged run really ran the Optimus schedule, not Megatron-LM's placement."""
    assert re.search(
        r"optimus: (--optimus-schedule auto|the schedule \S+): encoder plan", run.output
    ), run.output[-3000:]
    # pretrain_vlm.py's flags state no bound on the images of a microbatch (issue 34)
    assert "optimus: planned for at most 2 images a microbatch (one image a sample" in run.output
    assert re.search(r"optimus: first step: \d+ of the [1-9]\d* encoder ops", run.output), (
        run.output
    )


def _optimus(tmp_path: Path, args: tuple[str, ...]) -> tuple[str, str]:
    """The flag that runs Optimus's fastest schedule for ``args`` (a plan file): at dp2-pp2 these
    tiny shapes predict Megatron-LM's placement faster, where ``auto`` rightly trains as it."""
    return _compare.optimus_schedule_file(
        _planned([*_compare.TINY_VLM_ARGS, *args]), tmp_path / "optimus-plan.json"
    )


def _planned(args: list[str]) -> list[str]:
    """``args`` as optimus-plan takes them: it refuses the overlap pair (it may change the
    gradients' reduction), which the flag's job does not read into the plan either, so the plan
    made without it is the job's."""
    return [a for a in args if a not in ("--overlap-grad-reduce", "--overlap-param-gather")]


def _plain_and_flagged(tmp_path: Path, args: tuple[str, ...]) -> tuple:
    """The one-line script trained under ``args`` without and with the flag (Optimus's fastest
    schedule, ``_optimus``); the flagged run checked to have run the Optimus schedule."""
    assert CHECKOUT is not None
    script = _compare.with_one_line(CHECKOUT, tmp_path)
    plain = _train(script, args)
    optimus = _train(script, (*args, *_optimus(tmp_path, args)))
    _ran_optimus(optimus)
    return plain, optimus


def _same(plain, optimus) -> None:
    for a, b in zip(plain.iterations, optimus.iterations, strict=True):
        assert math.isfinite(a.lm_loss)
        assert b.lm_loss == pytest.approx(a.lm_loss, rel=1e-5), (a.line, b.line)
        assert b.grad_norm == a.grad_norm, (a.line, b.line)  # as printed: 3 decimals


@pytest.mark.parametrize("mlp", [(), ("--swiglu",)], ids=["gelu", "swiglu"])
@pytest.mark.parametrize("layout", sorted(_compare.LAYOUTS))
def test_pretrain_vlm_trains_with_the_flag_as_without(
    layout: str, mlp: tuple[str, ...], tmp_path: Path
) -> None:
    plain, optimus = _plain_and_flagged(tmp_path, (*_compare.LAYOUTS[layout], *mlp))
    # pretrain_vlm.py builds the vision model the flags describe
    assert "optimus: the encoder is read from" not in optimus.output, optimus.output[-3000:]
    _same(plain, optimus)
    assert len({i.lm_loss for i in plain.iterations}) == 3  # it trains


@pytest.mark.parametrize(
    "overlap",
    [(), ("--overlap-grad-reduce", "--overlap-param-gather")],
    ids=["plain", "overlapped"],
)
def test_the_distributed_optimizer_trains_with_the_flag_as_without(
    overlap: tuple[str, ...], tmp_path: Path
) -> None:
    # the production trio too: the encoder stage's DDP takes the chunks' DDP config, overlap
    # included
    args = (*_compare.LAYOUTS["dp2-pp2"], "--use-distributed-optimizer", *overlap)
    _same(*_plain_and_flagged(tmp_path, args))


def test_the_weights_the_flag_saves_with_the_distributed_optimizer_resume_either_way(
    tmp_path: Path,
) -> None:
    # --no-save-optim / --no-load-optim: the weights alone (LLaVAModel's keys), resumed with and
    # without the flag to the same numbers; under --bf16 the encoder's main parameters must start
    # from the loaded weights, which iteration 4 (after the resumed run's first update) shows
    assert CHECKOUT is not None
    script = _compare.with_one_line(CHECKOUT, tmp_path)
    args = (*_compare.LAYOUTS["dp2-pp2"], "--use-distributed-optimizer", "--bf16")
    args += ("--train-iters", "4")
    ckpt = str(tmp_path / "ckpt")
    save = ("--save", ckpt, "--save-interval", "2", "--exit-interval", "2", "--no-save-optim")
    flag = _optimus(tmp_path, args)
    _ran_optimus(_train(script, (*args, *save, *flag), iterations=(1, 2)))
    load = ("--load", ckpt, "--no-load-optim")
    plain = _train(script, (*args, *load), iterations=(3, 4))
    optimus = _train(script, (*args, *load, *flag), iterations=(3, 4))
    _ran_optimus(optimus)
    for a, b in zip(plain.iterations, optimus.iterations, strict=True):
        # bf16: the encoder's kernels round otherwise than the vision model's
        assert b.lm_loss == pytest.approx(a.lm_loss, rel=1e-3), (a.line, b.line)
        assert b.grad_norm == pytest.approx(a.grad_norm, rel=1e-2), (a.line, b.line)


def test_bf16_trains_with_the_flag_as_without(tmp_path: Path) -> None:
    # the vision modules the flag holds aside are cast as get_model's Float16Module casts the chunks
    plain, optimus = _plain_and_flagged(tmp_path, (*_compare.LAYOUTS["dp2-pp2"], "--bf16"))
    for a, b in zip(plain.iterations, optimus.iterations, strict=True):
        # bf16: the encoder's kernels round otherwise than the vision model's
        assert b.lm_loss == pytest.approx(a.lm_loss, rel=1e-3), (a.line, b.line)
        assert b.grad_norm == pytest.approx(a.grad_norm, rel=1e-2), (a.line, b.line)


def test_an_artifact_optimus_plan_wrote_from_the_jobs_command_line_trains_as_without_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # the job's whole command line after optimus-plan's --, then --optimus-schedule PLAN_JSON
    assert CHECKOUT is not None
    script = _compare.with_one_line(CHECKOUT, tmp_path)
    layout = _compare.LAYOUTS["tp2-pp2"]
    artifact = tmp_path / "plan.json"
    argv = ["--world-size", "4", "--gpus-per-node", "4", "--artifact", str(artifact), "--"]
    assert optimus_plan([*argv, *_compare.TINY_VLM_ARGS, *layout]) == 0
    said = capsys.readouterr().out.splitlines()
    assert said[0].startswith(
        "Megatron-LM flags not read (they do not shape the plan): --mock-data"
    )
    chosen = next(line for line in said if line.startswith("chosen: "))
    plain = _train(script, layout)
    optimus = _train(script, (*layout, "--optimus-schedule", str(artifact)))
    ran = f"optimus: the schedule {artifact}: encoder plan "
    assert ran in optimus.output, optimus.output[-3000:]
    # the encoder plan optimus-plan chose is the one the job ran
    encoder_plan = chosen.split(" | encoder ")[1].split(" | ")[0]
    assert f"{ran}{encoder_plan}," in optimus.output, (chosen, optimus.output[-3000:])
    assert re.search(r"optimus: first step: \d+ of the [1-9]\d* encoder ops", optimus.output)
    _same(plain, optimus)


def test_two_nodes_of_two_train_with_the_flag_like_one_node_of_four(tmp_path: Path) -> None:
    # two torchrun agents of 2 ranks each, meeting through the c10d rendezvous as the nodes of a
    # cluster do: TP inside a node, the pipeline across the two; the flag plans for nodes of 2
    # (LOCAL_WORLD_SIZE) and must train the one-node run's numbers whatever plan that gives
    assert CHECKOUT is not None
    script = _compare.with_one_line(CHECKOUT, tmp_path)
    layout = _compare.LAYOUTS["tp2-pp2"]
    one_node = _train(script, layout)
    two_nodes = _train(script, (*layout, *AUTO), nodes=2)
    _ran_optimus(two_nodes)
    _same(one_node, two_nodes)


def test_evaluation_and_save_resume_with_the_flag(tmp_path: Path) -> None:
    # Megatron's --eval-interval / --eval-iters, --save at 2 and --load to 3 (torch format, as
    # pretrain_vlm.py requires), all with the flag, against the uninterrupted run without it
    assert CHECKOUT is not None
    script = _compare.with_one_line(CHECKOUT, tmp_path)
    layout = _compare.LAYOUTS["tp2-pp2"]
    evaluation = ("--eval-interval", "2", "--eval-iters", "1")
    plain = _train(script, (*layout, *evaluation))
    save = ("--save", str(tmp_path / "ckpt"), "--save-interval", "2", "--exit-interval", "2")
    first = _train(script, (*layout, *evaluation, *save, *AUTO), iterations=(1, 2))
    _ran_optimus(first)
    assert _VALIDATION.findall(first.output) == _VALIDATION.findall(plain.output)[:1]
    assert len(_VALIDATION.findall(plain.output)) == 1
    resumed = _train(script, (*layout, "--load", str(tmp_path / "ckpt"), *AUTO), iterations=(3,))
    _same(plain, type(plain)(0, (*first.iterations, *resumed.iterations), ""))


@pytest.mark.parametrize("precision", [(), ("--bf16",)], ids=["fp32", "bf16"])
def test_a_checkpoint_resumes_across_the_flag_with_its_optimizer_state(
    precision: tuple[str, ...], tmp_path: Path
) -> None:
    # the flag saves and loads the optimizer state in Megatron's own layout (the vision model's
    # Adam state in the first stage's optimizer), so a checkpoint resumes with or without it
    assert CHECKOUT is not None
    script = _compare.with_one_line(CHECKOUT, tmp_path)
    args = (*_compare.TINY_VLM_ARGS, *_compare.LAYOUTS["tp2-pp2"], *precision)
    runs = _compare.resume_across_the_flag(script, args, tmp_path)
    for title, run in runs.items():
        assert run.returncode == 0, (title, run.output[-4000:])
    reference, saved_with, plain_to_flag, flag_to_plain = runs.values()
    assert [i.number for i in reference.iterations] == [1, 2, 3, 4], reference.output[-3000:]
    assert [i.number for i in saved_with.iterations] == [1, 2], saved_with.output[-3000:]
    _ran_optimus(saved_with)
    _ran_optimus(plain_to_flag)
    third, fourth = reference.iterations[2:]
    # Megatron-LM logs a run's first iteration without resetting its loss sum: a run resumed at 2
    # prints at 4 the mean of 3 and 4 (the flag or not; the grad norm is 4's own)
    losses = (third.lm_loss, (third.lm_loss + fourth.lm_loss) / 2)
    for resumed in (plain_to_flag, flag_to_plain):
        assert [i.number for i in resumed.iterations] == [3, 4], resumed.output[-3000:]
        for a, loss, b in zip((third, fourth), losses, resumed.iterations, strict=True):
            if precision:  # bf16: the encoder's kernels round otherwise than the vision model's
                assert b.lm_loss == pytest.approx(loss, rel=1e-3), (a.line, b.line)
                assert b.grad_norm == pytest.approx(a.grad_norm, rel=1e-2), (a.line, b.line)
            else:
                assert b.lm_loss == pytest.approx(loss, rel=1e-5), (a.line, b.line)
                assert b.grad_norm == a.grad_norm, (a.line, b.line)  # as printed: 3 decimals


@pytest.mark.parametrize(
    "flags",
    [("--overlap-grad-reduce", "--overlap-param-gather"), ("--bf16",)],
    ids=["fp32-overlapped", "bf16"],
)
def test_the_distributed_optimizer_s_checkpoint_is_the_plain_one_and_resumes_either_way(
    flags: tuple[str, ...], tmp_path: Path
) -> None:
    # each rank's distrib_optim.pt in Megatron-LM's per-bucket layout, the vision model's state
    # where the plain run's buffers hold it: the checkpoint the flag saves at 4 is the plain run's,
    # and each resumes to 6 with and without the flag with the numbers of the plain resume (which
    # prints at 6 the mean of 5 and 6: Megatron-LM does not reset a resumed run's loss sum). The
    # fp32 case with the overlap pair (the stand-in's CI test covers fp32 without): the encoder's
    # weights gathered before the save as Megatron-LM gathers the chunks', whose forward pre-hooks
    # it removes module by module
    assert CHECKOUT is not None
    script = _compare.with_one_line(CHECKOUT, tmp_path)
    args = (*_compare.TINY_VLM_ARGS, *_compare.LAYOUTS["dp2-pp2"], *flags)
    bf16 = "--bf16" in flags
    flag = _compare.optimus_schedule_file(
        _planned([*args, "--use-distributed-optimizer", "--train-iters", "6"]),
        tmp_path / "optimus-plan.json",
    )
    runs = _compare.distributed_optimizer_checkpoints(script, args, tmp_path, flag)
    for title, run in runs.items():
        assert run.returncode == 0, (title, run.output[-4000:])
    saved_without, saved_with, reference, *resumed = runs.values()
    assert [i.number for i in saved_without.iterations] == [1, 2, 3, 4]
    _ran_optimus(saved_with)
    _ran_optimus(resumed[0])  # saved without, resumed with the flag
    iteration = "iter_0000004"
    # the two runs' fp32 sums round apart, which Adam's steps scale up to the learning rate where a
    # gradient is near 0 (the attention's key bias: 0 but for rounding): without the overlap pair
    # the key bias differs by 6e-4 of its largest value, every other tensor by under 1e-4; with
    # it, up to 1.3e-2 (the projector's second weight). A value out of place differs by its own
    # size. bf16: the two runs train apart (the encoder's kernels round otherwise than the vision
    # model's): the same files, keys, dtypes and shapes, the values shown by the resumed numbers
    rel = float("inf") if bf16 else 5e-2
    assert (
        _compare.checkpoint_differences(
            tmp_path / "saved-without" / iteration, tmp_path / "saved-with" / iteration, rel
        )
        == []
    )
    assert [i.number for i in reference.iterations] == [5, 6], reference.output[-3000:]
    for run in resumed:
        for a, b in zip(reference.iterations, run.iterations, strict=True):
            if bf16:
                assert b.lm_loss == pytest.approx(a.lm_loss, rel=1e-3), (a.line, b.line)
                assert b.grad_norm == pytest.approx(a.grad_norm, rel=1e-2), (a.line, b.line)
            else:
                assert b.lm_loss == pytest.approx(a.lm_loss, rel=1e-5), (a.line, b.line)
                assert b.grad_norm == a.grad_norm, (a.line, b.line)  # as printed: 3 decimals
    if bf16:
        return
    # a damaged distrib_optim.pt: one line on every rank, naming the file and the fix
    damaged = tmp_path / "saved-with" / iteration / "mp_rank_00_000" / "distrib_optim.pt"
    damaged.write_bytes(damaged.read_bytes()[:1000])
    run = _compare.run_megatron_script(
        script,
        4,
        [
            *args,
            "--use-distributed-optimizer",
            "--train-iters",
            "6",
            "--load",
            str(tmp_path / "saved-with"),
            *flag,
        ],
    )
    assert run.returncode != 0 and not run.iterations, run.output[-3000:]
    errors = [line for line in run.output.splitlines() if line.startswith("pretrain_vlm.py: error")]
    assert len(errors) == 1, run.output[-3000:]
    assert f"{damaged} cannot be read" in errors[0] and "--no-load-optim" in errors[0], errors[0]


# pretrain_vlm.py's provider wrapped by a user whose vision model does one more thing (scales its
# output) that the encoder's layers do not show
_WRAPPED_PROVIDER = """
_pretrain_vlm_provider = model_provider


def model_provider(*args, **kwargs):
    model = _pretrain_vlm_provider(*args, **kwargs)
    vision = getattr(model, "vision_model", None)
    if vision is not None:
        forward = vision.forward
        vision.forward = lambda *a, **k: forward(*a, **k) * 1.5
    return model


"""


def _with_provider(tmp_path: Path, provider: str) -> Path:
    """pretrain_vlm.py with the one-line opt-in and ``provider`` defined before its main block."""
    script = _compare.with_one_line(CHECKOUT, tmp_path)
    main = 'if __name__ == "__main__":'
    source = script.read_text()
    assert source.count(main) == 1
    script.write_text(source.replace(main, provider + main))
    return script


def test_a_provider_that_wraps_the_vision_models_forward_is_refused_by_the_probe(
    tmp_path: Path,
) -> None:
    assert CHECKOUT is not None
    script = _with_provider(tmp_path, _WRAPPED_PROVIDER)
    plain = _train(script, _compare.LAYOUTS["tp2-pp2"])  # the user's model trains as built
    assert all(math.isfinite(i.lm_loss) for i in plain.iterations)
    run = _compare.run_megatron_script(
        script, 4, [*_compare.TINY_VLM_ARGS, *_compare.LAYOUTS["tp2-pp2"], *AUTO]
    )
    assert run.returncode != 0, run.output[-3000:]
    # a rank exits 2 (torchrun exits 1, stops the others and names each rank's exit code)
    assert "exitcode  : 2" in run.output, run.output[-3000:]
    errors = [line for line in run.output.splitlines() if line.startswith("pretrain_vlm.py: error")]
    assert len(errors) == 1, run.output[-3000:]
    assert "the start-up probe: the Optimus encoder's image tokens differ" in errors[0]
    assert "OptimusError" not in run.output, run.output[-3000:]  # no traceback of a rank's


# pretrain_vlm.py's provider building a vision model of one more layer than the flags say, as a
# script that builds its vision model from other flags does (examples/multimodal: CLIP ViT-L from
# --vision-model-type); the flags are as given when --optimus-schedule reads them
_DEEPER_VISION_PROVIDER = """
_pretrain_vlm_provider = model_provider


def model_provider(*args, **kwargs):
    flags = get_args()
    given = flags.encoder_num_layers
    flags.encoder_num_layers = given + 1
    try:
        return _pretrain_vlm_provider(*args, **kwargs)
    finally:
        flags.encoder_num_layers = given


"""


def test_a_vision_model_deeper_than_the_flags_trains_with_the_flag_as_without(
    tmp_path: Path,
) -> None:
    # the flag plans and builds the encoder from the vision model the provider built
    assert CHECKOUT is not None
    script = _with_provider(tmp_path, _DEEPER_VISION_PROVIDER)
    layout = _compare.LAYOUTS["tp2-pp2"]
    plain = _train(script, layout)
    optimus = _train(script, (*layout, *AUTO))
    _ran_optimus(optimus)
    said = (
        "optimus: the encoder is read from the vision model the provider built, not from the "
        "Megatron-LM flags (read as pretrain_vlm.py builds it): num_layers 3 (flags: 2)\n"
    )
    assert said in optimus.output, optimus.output[-3000:]
    _same(plain, optimus)
