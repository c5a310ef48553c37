"""``--optimus-schedule`` through the seams of Megatron-LM's loop (``optimus_mllm.megatron.seams``),
driven by a stand-in of the Megatron-LM calls they wrap (``support.megatron_standin``), so that CI
covers the injection without a Megatron-LM checkout: the same losses, gradient norms and
validation loss with and without the flag.
"""

from __future__ import annotations

from collections.abc import Callable
from copy import deepcopy
from pathlib import Path
from typing import Any

import pytest

from support.distributed_utils import run_distributed
from support.paths import MEGATRON_TINY_FLAGS

pytestmark = pytest.mark.distributed

# configs/megatron_tiny.yaml (TP2 PP2, two model chunks per stage) without dropout
ARGS = (*MEGATRON_TINY_FLAGS, "--hidden-dropout", "0", "--attention-dropout", "0")


def _write_artifact(
    argv: list[str],
    path: Path,
    projector: dict[str, Any] | None = None,
    images: int | None = None,
) -> str:
    """``optimus-plan --artifact`` for the job of ``argv``, whose projector has ``projector``'s
    fields in place of those pretrain_vlm.py's flags give it (a model of the user's own), planned
    for ``images`` a microbatch (``data.max_images_per_microbatch``) where given."""
    from dataclasses import replace

    from optimus_mllm.megatron.arguments import add_optimus_args, parse_args, validate_args
    from optimus_mllm.megatron.flags import config_from_megatron_args
    from optimus_mllm.planner import plan
    from optimus_mllm.scheduler.artifact import artifact_text, schedule_job_artifact

    args = validate_args(parse_args(add_optimus_args, argv), 4)
    config = config_from_megatron_args(args, 4, 4)
    encoder = config.encoders[0]
    encoder = replace(encoder, projector=replace(encoder.projector, **(projector or {})))
    config = replace(config, model=replace(config.model, encoders=(encoder,)))
    if images is not None:
        config = replace(config, data=replace(config.data, max_images_per_microbatch=images))
    path.write_text(artifact_text(schedule_job_artifact(config, plan(config))))
    return str(path)


def _both(argv: list[str], schedule: str, projector: tuple | None = None) -> tuple:
    from support.megatron_standin import standin_pretrain

    edit = None if projector is None else _projector_of_their_own(*projector)
    return standin_pretrain(argv, None, edit=edit), standin_pretrain(argv, schedule, edit=edit)


def _projector_of_their_own(kind: str, activation: str, bias: bool) -> Callable[[Any], None]:
    """A user's provider that builds megatron-core's MultimodalProjector of type ``kind`` with
    ``activation`` (a torch.nn.functional or torch name) and ``bias`` in place of
    pretrain_vlm.py's."""
    import torch
    import torch.nn.functional as F
    from megatron.core.models.vision.multimodal_projector import MultimodalProjector
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules

    def edit(model: Any) -> None:
        if not hasattr(model, "vision_projection"):  # built on the first stage only
            return
        config = deepcopy(model.vision_projection.config)
        config.activation_func = getattr(F, activation, None) or getattr(torch, activation)
        config.add_bias_linear = bias
        model.vision_projection = MultimodalProjector(
            config,
            MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
            kind,
            model.vision_model.config.hidden_size,
        )

    return edit


# flags after ARGS win: its layout is TP2 PP2 with two model chunks per stage
LAYOUTS = {
    "tp2-pp2-vp2": (),
    "dp2-pp2": (
        "--tensor-model-parallel-size",
        "1",
        "--num-layers-per-virtual-pipeline-stage",
        "2",
    ),
    "pp4-vp2": (
        *("--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "4"),
        *("--decoder-num-layers", "8"),
    ),
}


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_the_flag_trains_with_the_plain_numbers_through_megatron_s_seams(
    layout: tuple[str, ...], tmp_path: Path
) -> None:
    argv = [*ARGS, *layout]
    schedule = _write_artifact(argv, tmp_path / "plan.json")
    runs = run_distributed(_both, 4, argv, schedule, timeout=600)
    last = runs[-1]  # the last pipeline stage reports the loss
    plain, optimus = last
    assert all(loss is not None for loss in plain.losses), plain
    assert len(set(plain.losses)) == 3  # it trains
    assert optimus.losses == pytest.approx(plain.losses, rel=1e-5)
    assert optimus.grad_norms == pytest.approx(plain.grad_norms, rel=1e-5)
    assert optimus.validation_loss == pytest.approx(plain.validation_loss, rel=1e-5)


# a user's own projector (type, activation, bias), and the projector fields it has in place of
# pretrain_vlm.py's
PROJECTORS = {
    "relu-tp2-pp2-vp2": (("mlp", "relu", True), {"activation": "relu"}, "tp2-pp2-vp2"),
    "affine-nobias-tp2-pp2-vp2": (
        ("affine", "gelu", False),
        {"type": "affine", "ffn_hidden_size": None, "add_bias_linear": False},
        "tp2-pp2-vp2",
    ),
    "affine-dp2-pp2": (
        ("affine", "gelu", True),
        {"type": "affine", "ffn_hidden_size": None},
        "dp2-pp2",
    ),
}


@pytest.mark.parametrize("case", PROJECTORS)
def test_a_projector_of_the_users_own_trains_with_the_plain_numbers(
    case: str, tmp_path: Path
) -> None:
    """The flag reads the projector off the user's built module (not pretrain_vlm.py's from the
    flags): a ReLU MLP and megatron-core's affine projector, with and without its bias, train with
    the plain run's numbers; the probe passes them."""
    built, fields, layout = PROJECTORS[case]
    argv = [*ARGS, *LAYOUTS[layout]]
    schedule = _write_artifact(argv, tmp_path / "plan.json", fields)
    plain, optimus = run_distributed(_both, 4, argv, schedule, built, timeout=600)[-1]
    assert all(loss is not None for loss in plain.losses), plain
    assert len(set(plain.losses)) == 3  # it trains
    assert optimus.losses == pytest.approx(plain.losses, rel=1e-5)
    assert optimus.grad_norms == pytest.approx(plain.grad_norms, rel=1e-5)
    assert optimus.validation_loss == pytest.approx(plain.validation_loss, rel=1e-5)


def _refused(argv: list[str], schedule: str, projector: tuple) -> str:
    from optimus_mllm.errors import OptimusError

    from support.megatron_standin import standin_pretrain

    try:
        standin_pretrain(argv, schedule, edit=_projector_of_their_own(*projector))
    except OptimusError as error:
        return str(error)
    return "trained"


def test_a_projector_activation_the_encoder_does_not_run_is_one_line_on_every_rank(
    tmp_path: Path,
) -> None:
    argv = [*ARGS, *LAYOUTS["dp2-pp2"]]
    schedule = _write_artifact(argv, tmp_path / "plan.json")
    said = run_distributed(_refused, 4, argv, schedule, ("mlp", "tanh", True), timeout=600)
    assert len(set(said)) == 1, said  # every rank alike
    assert said[0] == (
        "model_provider: the projector's TransformerConfig.activation_func is tanh, which the "
        "Optimus encoder does not run (it runs gelu, silu, relu, squared_relu, quick_gelu); "
        "build the projector with one of them"
    )


def test_an_artifact_planned_for_the_flags_projector_is_refused_for_another(
    tmp_path: Path,
) -> None:
    """optimus-plan plans the projector pretrain_vlm.py's flags describe; a job whose provider
    builds another is refused naming the projector's field, before any step."""
    argv = [*ARGS, *LAYOUTS["dp2-pp2"]]
    schedule = _write_artifact(argv, tmp_path / "plan.json")
    said = run_distributed(_refused, 4, argv, schedule, ("mlp", "relu", True), timeout=600)
    assert len(set(said)) == 1, said
    assert said[0].startswith(f"schedule artifact {schedule} was made with "), said[0]
    assert "model.encoders.0.projector.activation" in said[0], said[0]


def _norm_between_vision_and_projector(argv: list[str], schedule: str) -> str:
    import torch.nn.functional as F
    from torch import nn

    from optimus_mllm.errors import OptimusError

    from support.megatron_standin import script, standin_pretrain

    class NormThen(nn.Module):
        def __init__(self, projection: nn.Module):
            super().__init__()
            self.projection = projection

        def forward(self, x):
            return self.projection(F.layer_norm(x, x.shape[-1:]))

    class NormBetween(script.VisionLanguageModel):
        """A user's model whose forward normalises the vision model's output before projecting."""

        def forward(self, images, *args, **kwargs):
            projection = self.vision_projection
            self.vision_projection = NormThen(projection)
            try:
                return super().forward(images, *args, **kwargs)
            finally:
                self.vision_projection = projection

    try:
        standin_pretrain(argv, schedule, NormBetween)
    except OptimusError as error:
        return str(error)
    return "trained"


def test_an_operation_between_vision_model_and_projector_is_refused_at_start_up(
    tmp_path: Path,
) -> None:
    argv = [*ARGS, *LAYOUTS["dp2-pp2"]]
    schedule = _write_artifact(argv, tmp_path / "plan.json")
    said = run_distributed(_norm_between_vision_and_projector, 4, argv, schedule, timeout=600)
    assert len(set(said)) == 1, said  # every rank alike
    assert "between vision_model and vision_projection" in said[0], said[0]


def _images_under(
    argv: list[str], schedule: str, key: str, scale: float
) -> tuple[object, object] | str:
    """Plain and flagged runs of a user whose data gives the images under ``key`` and whose forward
    step reads them there (scaled by ``scale`` before the model sees them)."""
    from optimus_mllm.errors import OptimusError

    from support.megatron_standin import script, standin_pretrain

    def as_the_script_reads(batch: dict) -> dict:
        batch = {("image" if k == key else k): v for k, v in batch.items()}
        return {**batch, "image": batch["image"] * scale}

    def forward_step(data_iterator, model):
        return script.forward_step(map(as_the_script_reads, data_iterator), model)

    runs = []
    for plan in (None, schedule):
        try:
            runs.append(
                standin_pretrain(argv, plan, renamed={"image": key}, forward_step=forward_step)
            )
        except OptimusError as error:
            return str(error)
    return tuple(runs)


def test_images_under_another_key_are_found_from_the_forward_step(tmp_path: Path) -> None:
    argv = [*ARGS, *LAYOUTS["dp2-pp2"]]
    schedule = _write_artifact(argv, tmp_path / "plan.json")
    runs = run_distributed(_images_under, 4, argv, schedule, "pixels", 1.0, timeout=600)
    plain, optimus = runs[-1]
    assert len(set(plain.losses)) == 3
    assert optimus.losses == pytest.approx(plain.losses, rel=1e-5)
    assert optimus.grad_norms == pytest.approx(plain.grad_norms, rel=1e-5)


def test_images_the_forward_step_transforms_are_one_line_before_the_first_step(
    tmp_path: Path,
) -> None:
    argv = [*ARGS, *LAYOUTS["dp2-pp2"]]
    schedule = _write_artifact(argv, tmp_path / "plan.json")
    said = run_distributed(_images_under, 4, argv, schedule, "pixels", 2.0, timeout=600)
    assert len(set(said)) == 1, said  # every rank alike
    assert said[0].startswith(
        "the model's forward step gives vision_model a tensor that is none "
    ), said[0]
    assert "'pixels'" in said[0]


# images of each of a microbatch's two samples, by (iteration * 3 + global microbatch) % 8: the
# first data-parallel rank's first microbatch of the first step has none
IMAGES_PER_SAMPLE = ((0, 0), (1, 0), (1, 1), (2, 1), (0, 2), (2, 2), (1, 2), (0, 1))


def _varying_images(iteration: int, global_microbatch: int, batch: dict) -> dict:
    """A user's data whose samples hold 0, 1 or 2 images each (a text-only sample, a second image
    at another <image>): the microbatch's images side by side, in their samples' order, as
    LLaVA's data gives them."""
    import torch

    from support.megatron_standin import script

    images, tokens = [], batch["tokens"].clone()
    counts = IMAGES_PER_SAMPLE[(iteration * 3 + global_microbatch) % len(IMAGES_PER_SAMPLE)]
    for j, count in enumerate(counts):
        where = int((tokens[j] == script.IMAGE_TOKEN_INDEX).nonzero()[0])
        if count == 0:
            tokens[j, where] = 1
        if count == 2:
            tokens[j, where + 2] = script.IMAGE_TOKEN_INDEX
        images += [batch["image"][j].flip(-1 - k) for k in range(count)]
    shape = batch["image"].shape[1:]
    image = torch.stack(images) if images else batch["image"].new_zeros((0, *shape))
    return {**batch, "tokens": tokens, "image": image}


def _model_of_varying_images() -> type:
    """The script's model with LLaVA's splice of any number of images per sample: each <image> of
    the microbatch, in order, takes the next image's tokens; each sample's sequence is cut or
    zero-padded to the labels' length; without images vision_model is not called."""
    import torch

    from support.megatron_standin import script

    class VaryingImages(script.VisionLanguageModel):
        def forward(self, images, input_ids, position_ids, attention_mask, labels=None):
            decoder_input = None
            if self.pre_process:
                text_ids = input_ids.clone()
                text_ids[text_ids == script.IMAGE_TOKEN_INDEX] = 0
                text = self.language_model.embedding(input_ids=text_ids, position_ids=position_ids)
                tokens = None
                if images.shape[0]:
                    tokens = self.vision_model(images)[:, self.vision_model.class_token_len :]
                    tokens = self.vision_projection(tokens.permute(1, 0, 2).contiguous())
                length, used, samples = labels.shape[1], 0, []
                for i in range(input_ids.shape[0]):
                    parts, start = [], 0
                    for at in (input_ids[i] == script.IMAGE_TOKEN_INDEX).nonzero()[:, 0].tolist():
                        parts += [text[start:at, i], tokens[:, used]]
                        used, start = used + 1, at + 1
                    sample = torch.cat([*parts, text[start:, i]])[:length]
                    padding = sample.new_zeros(length - sample.shape[0], sample.shape[1])
                    samples.append(torch.cat([sample, padding]))
                decoder_input = torch.stack(samples, dim=1)
            return self.language_model(
                None, None, attention_mask, decoder_input=decoder_input, labels=labels
            )

    return VaryingImages


def _trained_with_varying_images(argv: list[str], schedule: str) -> tuple:
    """On each rank: the plain and the flagged run (the saved schedule planned for 4 images a
    microbatch) of a user whose microbatches hold 0 to 4 images, and what the flag says where the
    job's flags (examples/multimodal's, one tile an image) bound a microbatch to 2 of them."""
    from optimus_mllm.errors import OptimusError

    from support.megatron_standin import standin_pretrain

    varying = {"model_class": _model_of_varying_images(), "edit_batch": _varying_images}
    plain = standin_pretrain(argv, None, **varying)
    flagged = standin_pretrain(argv, schedule, **varying)
    tiles = {"max_num_tiles": 1, "use_tiling": False, "use_thumbnail": False, "num_frames": 1}
    try:
        standin_pretrain(argv, "auto", script_args=tiles, **varying)
        said = "trained"
    except OptimusError as error:
        said = str(error)
    return plain, flagged, said


def test_microbatches_of_0_to_4_images_train_as_without_the_flag_and_more_are_refused(
    tmp_path: Path,
) -> None:
    # before, a microbatch holding other than one image a sample was refused ("the flag does not
    # follow a varying image count yet"); now each runs its own images under the schedule planned
    # for the most, and a microbatch above that is one line on every rank before the step
    argv = [*ARGS, *LAYOUTS["dp2-pp2"]]
    schedule = _write_artifact(argv, tmp_path / "plan.json", images=4)
    runs = run_distributed(_trained_with_varying_images, 4, argv, schedule, timeout=600)
    plain, optimus, _ = runs[-1]  # the last pipeline stage reports the loss
    assert len(set(plain.losses)) == 3  # it trains
    assert optimus.losses == pytest.approx(plain.losses, rel=1e-5)
    assert optimus.grad_norms == pytest.approx(plain.grad_norms, rel=1e-5)
    assert optimus.validation_loss == pytest.approx(plain.validation_loss, rel=1e-5)
    said = {run[2] for run in runs}
    assert len(said) == 1, said  # every rank alike
    assert said.pop() == (
        "iteration 0, microbatch 3 of data-parallel rank 0: the batch holds 3 images under "
        "'image', above the 2 --optimus-schedule planned for (--micro-batch-size 2 x 1 a sample: "
        "one tile an image (no --use-tiling), --num-frames 1); plan for more (a schedule made by "
        "optimus-plan for a config with a larger data.max_images_per_microbatch) or train this "
        "data without the flag"
    )


def test_the_flag_trains_under_bf16_as_without(tmp_path: Path) -> None:
    # Megatron-LM's get_model casts the chunks (Float16Module) after the model provider: the vision
    # modules the flag holds aside were left in fp32, and the start-up forwards that put them back
    # failed on every --bf16 job
    argv = [*ARGS, *LAYOUTS["dp2-pp2"], "--bf16"]
    schedule = _write_artifact(argv, tmp_path / "plan.json")
    plain, optimus = run_distributed(_both, 4, argv, schedule, timeout=600)[-1]
    assert len(set(plain.losses)) == 3
    # bf16: the two runs round differently (the encoder's kernels are not the vision model's)
    assert optimus.losses == pytest.approx(plain.losses, rel=1e-3)
    assert optimus.grad_norms == pytest.approx(plain.grad_norms, rel=1e-2)


def _resumed_across_the_flag(argv: list[str], schedule: str) -> tuple:
    """On each rank: the plain run uninterrupted, saving after iteration 2; the flagged run resumed
    from that checkpoint; the flagged run saving after iteration 2; the plain run resumed from
    that one (Megatron-LM's torch format, the optimizer state included)."""
    from dataclasses import replace

    from support.megatron_standin import standin_pretrain

    plain = standin_pretrain(argv, None, save_at=2)
    flag_from_plain = standin_pretrain(argv, schedule, load=plain.saved)
    flagged = standin_pretrain(argv, schedule, save_at=2)
    plain_from_flag = standin_pretrain(argv, None, load=flagged.saved)
    runs = (plain, flag_from_plain, flagged, plain_from_flag)
    return tuple(replace(run, saved=None) for run in runs)


def test_a_checkpoint_resumes_across_the_flag_with_its_optimizer_state(tmp_path: Path) -> None:
    # the flag saves and loads the optimizer state in Megatron's own layout (the vision model's
    # Adam state in the first stage's optimizer); the validation loss after iteration 3 is the first
    # number that depends on that state (iteration 3's update); --lr 1e-2 so that it tells a
    # vision model's Adam state left zero from the saved one
    argv = [*(a for a in ARGS if a != "--use-distributed-optimizer"), "--lr", "1e-2"]
    schedule = _write_artifact(argv, tmp_path / "plan.json")
    runs = run_distributed(_resumed_across_the_flag, 4, argv, schedule, timeout=600)
    plain, flag_from_plain, flagged, plain_from_flag = runs[-1]  # the last stage reports
    assert len(set(plain.losses)) == 3  # it trains
    assert flagged.losses == pytest.approx(plain.losses, rel=1e-5)
    for resumed in (flag_from_plain, plain_from_flag):
        assert len(resumed.losses) == 1  # iteration 3
        assert resumed.losses == pytest.approx(plain.losses[2:], rel=1e-5)
        assert resumed.grad_norms == pytest.approx(plain.grad_norms[2:], rel=1e-5)
        assert resumed.validation_loss == pytest.approx(plain.validation_loss, rel=1e-5)


def _resumed_with_the_flag(argv: list[str], schedule: str) -> tuple:
    """On each rank: the flagged run uninterrupted; the same saving after iteration 2; and the
    flagged run resumed from that checkpoint."""
    from dataclasses import replace

    from support.megatron_standin import standin_pretrain

    uninterrupted = standin_pretrain(argv, schedule)
    saving = standin_pretrain(argv, schedule, save_at=2)
    resumed = standin_pretrain(argv, schedule, load=saving.saved)
    return uninterrupted, replace(saving, saved=None), resumed


def test_a_bf16_checkpoint_saved_and_resumed_with_the_flag_has_the_uninterrupted_numbers(
    tmp_path: Path,
) -> None:
    # under --bf16 the state goes through Megatron's layout and back: the fp32 main parameters
    # whole, and the weights' gradient hooks (megatron-core's DDP) kept, which a bf16 weight given
    # fp32 data for the copy lost (the encoder's gradients missed the step after a save or a load);
    # the same kernels run throughout, so the numbers are the uninterrupted run's to float precision
    argv = [*(a for a in ARGS if a != "--use-distributed-optimizer"), *LAYOUTS["dp2-pp2"]]
    argv += ["--bf16"]
    schedule = _write_artifact(argv, tmp_path / "plan.json")
    runs = run_distributed(_resumed_with_the_flag, 4, argv, schedule, timeout=600)
    uninterrupted, saving, resumed = runs[-1]
    assert len(set(uninterrupted.losses)) == 3  # it trains
    for run in (saving, resumed):
        n = len(run.losses)
        assert run.losses == pytest.approx(uninterrupted.losses[-n:], rel=1e-5)
        assert run.grad_norms == pytest.approx(uninterrupted.grad_norms[-n:], rel=1e-5)
        assert run.validation_loss == pytest.approx(uninterrupted.validation_loss, rel=1e-5)


def _distributed_optimizer_checkpoints(argv: list[str], schedule: str) -> tuple:
    """On each rank: the plain run and the flagged run, each saving after iteration 2 (the
    distributed optimizer's state included), and where their checkpoints differ; each checkpoint
    resumed the other way; and the flagged run resuming the flag's checkpoint with a damaged
    distrib_optim.pt (what it said)."""
    import io
    from dataclasses import replace

    import torch

    from optimus_mllm.errors import OptimusError

    from support.megatron_standin import DISTRIB_OPTIM, standin_pretrain
    from support.paths import load_script

    plain = standin_pretrain(argv, None, save_at=2)
    flagged = standin_pretrain(argv, schedule, save_at=2)
    saved = [_checkpoint_state(run.saved) for run in (plain, flagged)]
    # the same tensors where a layout error moves values by their own size; the two runs' fp32
    # sums round apart, which Adam's first steps at --lr 1e-2 make up to 1e-3 of a weight
    differences = load_script("megatron_lm_compare").state_differences(*saved, rel=1e-2)
    flag_from_plain = standin_pretrain(argv, schedule, load=plain.saved)
    plain_from_flag = standin_pretrain(argv, None, load=flagged.saved)
    damaged = torch.load(io.BytesIO(flagged.saved), weights_only=False)
    if damaged[DISTRIB_OPTIM] is not None:  # data-parallel rank 0's file: cut short
        damaged[DISTRIB_OPTIM] = damaged[DISTRIB_OPTIM][:1000]
    buffer = io.BytesIO()
    torch.save(damaged, buffer)
    try:
        standin_pretrain(argv, schedule, load=buffer.getvalue())
        said = "resumed"
    except OptimusError as error:
        said = str(error)
    runs = (plain, flag_from_plain, plain_from_flag)
    return (*(replace(run, saved=None) for run in runs), differences, said)


def _checkpoint_state(saved: bytes) -> dict[str, Any]:
    """A stand-in checkpoint of one rank, its distrib_optim.pt loaded too."""
    import io

    import torch

    from support.megatron_standin import DISTRIB_OPTIM

    state = torch.load(io.BytesIO(saved), weights_only=False)
    if state[DISTRIB_OPTIM] is not None:
        state[DISTRIB_OPTIM] = torch.load(io.BytesIO(state[DISTRIB_OPTIM]), weights_only=False)
    return state


def test_the_distributed_optimizer_s_checkpoint_is_the_plain_one_with_the_flag(
    tmp_path: Path,
) -> None:
    """With --use-distributed-optimizer the flag saves each rank's state in Megatron-LM's layout
    (distrib_optim.pt by the plain run's DDP buckets, the vision model's main parameters and Adam
    moments where the plain run's buffers hold them), so a checkpoint resumes across the flag
    either way to the uninterrupted numbers; a damaged one is one line on every rank."""
    argv = [*ARGS, *LAYOUTS["dp2-pp2"], "--lr", "1e-2"]
    assert "--use-distributed-optimizer" in argv
    schedule = _write_artifact(argv, tmp_path / "plan.json")
    runs = run_distributed(_distributed_optimizer_checkpoints, 4, argv, schedule, timeout=900)
    for *_, differences, _ in runs:
        assert differences == [], differences
    plain, flag_from_plain, plain_from_flag, _, _ = runs[-1]  # the last stage reports
    assert len(set(plain.losses)) == 3  # it trains
    for resumed in (flag_from_plain, plain_from_flag):
        assert resumed.losses == pytest.approx(plain.losses[2:], rel=1e-5)
        assert resumed.grad_norms == pytest.approx(plain.grad_norms[2:], rel=1e-5)
        assert resumed.validation_loss == pytest.approx(plain.validation_loss, rel=1e-5)
    said = {run[-1] for run in runs}
    assert len(said) == 1, said  # every rank alike
    line = said.pop()
    assert "\n" not in line and line.startswith(
        "--optimus-schedule: the distributed optimizer's state "
    ), line
    assert "distrib_optim.pt cannot be read" in line and "--no-load-optim" in line, line
