"""A start-up check that the user's model computes its vision path as the Optimus encoder does.

The flag replaces the first stage's ``vision_model`` / ``vision_projection`` with image tokens from
an encoder rebuilt from the user's weights and layer spec. What the user's forward does with its
vision modules -- an activation of its own, an operation between ``vision_model`` and
``vision_projection`` -- is not visible in their configs (one after the projector runs on the
encoder's tokens as on the projector's). So before the
first step, one microbatch runs the first stage's forward twice, in eval mode (no dropout), from the
same weights and batch: as the user built it, and with the image tokens of a one-stage copy of the
Optimus encoder (the schedule's kernels, at the LLM's TP, built and filled like the real one)
in the vision modules' place; then backward from a fixed projection of the two outputs to the
vision weights (``torch.autograd.grad``, so no gradient reaches a ``.grad`` or Megatron's grad
buffers). Where the two differ beyond float tolerance, the job is refused on every rank in one line
naming where the paths part: in the encoder's own decomposition (the vision model and projector as
LLaVA applies them, ``vision_projection(vision_model(images))``, differ from the encoder's output),
in the user's forward around them, or in the backward (a hook or autograd function of the user's
that changes a gradient, named by the weight it reaches first). First, the user's own forward shows
what it feeds ``vision_projection`` of ``vision_model``'s tokens: whether it drops the class token,
the one part of the vision path the flags (``--disable-vision-class-token``) say rather than the
modules; where the job says otherwise, the refusal names the flag.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.spec_utils import ModuleSpec
from torch import nn

from optimus_mllm.config import OptimusConfig
from optimus_mllm.errors import OptimusError
from optimus_mllm.runtime.data import patchify
from optimus_mllm.runtime.dtypes import DTYPES
from optimus_mllm.runtime.sharded_state import copy_sharded_state, encoder_sharded_state_dict
from optimus_mllm.runtime.user_model import vision_sharded_state_dict
from optimus_mllm.runtime.vit import EncoderStage

# the largest difference, relative to the largest magnitude, two paths of one model may show
TOLERANCE = {"fp32": 1e-4, "bf16": 2e-2, "fp16": 1e-2}


def probe_vision_path(
    config: OptimusConfig,
    first_chunk: nn.Module | None,
    in_place: Callable[[], Any],
    forward: Callable[[nn.Module | None, Iterator[Any]], torch.Tensor] | None,
    batch: Any,
    images: torch.Tensor | None,
    layer_spec: ModuleSpec,
    device: torch.device,
) -> str:
    """Run the probe (every rank takes part in its weight copy) and return the line that says how
    the two paths compared; ``OptimusError`` on every rank where they part.

    Args:
        config: the job's config (its first encoder is the user's vision model).
        first_chunk: the first stage's first chunk, holding the stand-in; None elsewhere.
        in_place: a context manager putting the user's vision modules, as they are, back in
            ``first_chunk`` (no rank waits for another in it).
        forward: the first stage's forward of one microbatch given ``(vision modules or None,
            data iterator)``: the user's ``forward_step`` output on that chunk. None off the first
            stage.
        batch: the microbatch, as the user's data iterator yields it (first stage only).
        images: its images, ``[micro batch, channels, height, width]`` (first stage only).
        layer_spec: the user's vision layer spec, as the encoder was built from it.
        device: where the probe runs.
    """
    started = time.perf_counter()
    encoder = config.encoders[0]
    probe = None
    if first_chunk is not None:
        probe = EncoderStage(
            config,
            0,
            1,
            parallel_state.get_tensor_model_parallel_group(),
            layer_specs={encoder.name: layer_spec},
        ).to(device, DTYPES[config.training.precision])
    dp_group = parallel_state.get_data_parallel_group()
    with in_place():
        copy_sharded_state(
            {} if first_chunk is None else vision_sharded_state_dict(first_chunk),
            {} if probe is None else encoder_sharded_state_dict(config, probe, dp_group),
            "the model's vision model -> the start-up probe's encoder",
        )
    report, grads = None, None
    if first_chunk is not None and forward is not None and probe is not None:
        report, grads = _compare(config, first_chunk, in_place, forward, batch, images, probe)
    gradients = _gradient_difference(config, first_chunk, in_place, probe, grads, dp_group)
    if report is not None and report[0] is None and gradients is not None:
        report = _gradient_report(config, gradients, report[1])
    seen: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(seen, report)
    problems = [r for r in seen if r is not None and r[0] is not None]
    if problems:
        raise OptimusError(problems[0][0])
    worst = max((r[1] for r in seen if r is not None), default=0.0)
    took = (time.perf_counter() - started) * 1e3
    return (
        "optimus: start-up probe: the model's vision path and the Optimus encoder's agree on one "
        f"microbatch, forward and backward (largest relative difference {worst:.1e}), {took:.0f} ms"
    )


# (the user's vision parameters and their gradients, the probe's and theirs)
_Grads = tuple[list[nn.Parameter], list[torch.Tensor], list[nn.Parameter], list[torch.Tensor]]


def _compare(
    config: OptimusConfig,
    first_chunk: nn.Module,
    in_place: Callable[[], Any],
    forward: Callable[[nn.Module | None, Iterator[Any]], torch.Tensor],
    batch: Any,
    images: torch.Tensor,
    probe: EncoderStage,
) -> tuple[tuple[str | None, float], _Grads | None]:
    """((the problem or None, the largest relative difference seen), the two paths' vision
    gradients where their forwards agree) on this first-stage rank."""
    encoder = config.encoders[0]
    tolerance = TOLERANCE[config.training.precision]
    was_training = first_chunk.training
    first_chunk.eval()
    probe.eval()
    try:
        with torch.random.fork_rng(devices=[]):
            tokens = probe({encoder.name: patchify(images, encoder.patch_size)}, 0)[encoder.name]
            with in_place():
                vision, projection = first_chunk.vision_model, first_chunk.vision_projection
                theirs_params = _trained(vision, projection)
                with torch.no_grad():
                    # in the model's precision, as Megatron's Float16Module casts the first stage's
                    # inputs (--bf16/--fp16)
                    features = vision(images.to(next(vision.parameters()).dtype))
                    features = features[:, _dropped_tokens(config) :]
                    as_llava = projection(features.permute(1, 0, 2).contiguous())
                with _tokens_seen(vision, projection) as seen:
                    theirs = forward(first_chunk, iter([batch]))
                problem = _drop_problem(config, seen)
                if problem is not None:
                    return (problem, float("inf")), None
                theirs_grads = _gradients(theirs, theirs_params)
            first_chunk.vision_model.embeddings = tokens
            ours = forward(first_chunk, iter([batch]))
            ours_params = _trained(probe)
            ours_grads = _gradients(ours, ours_params)
    finally:
        first_chunk.train(was_training)
    parts = _relative_difference(as_llava, tokens)
    whole = _relative_difference(theirs, ours)
    if parts > tolerance:
        return (
            "the start-up probe: the Optimus encoder's image tokens differ from the model's "
            f"vision_projection(vision_model(images)) by {parts:.1e} (relative), beyond "
            f"{tolerance:g}: the vision model or its projector computes something the encoder's "
            "kernels do not (a layer, norm or activation of its own); run the job without "
            "--optimus-schedule",
            parts,
        ), None
    if whole > tolerance:
        return (
            "the start-up probe: the first stage's output differs by "
            f"{whole:.1e} (relative, beyond {tolerance:g}) when the Optimus encoder's image tokens "
            "stand in for vision_projection(vision_model(images)): the model's forward does "
            "something between vision_model and vision_projection that the encoder does not; run "
            "the job without --optimus-schedule",
            whole,
        ), None
    return (None, max(parts, whole)), (theirs_params, theirs_grads, ours_params, ours_grads)


def _dropped_tokens(config: OptimusConfig) -> int:
    """The class tokens the encoder drops before its projector (the flags' reading)."""
    encoder = config.encoders[0]
    return encoder.class_tokens if encoder.drop_class_token else 0


@contextlib.contextmanager
def _tokens_seen(vision: nn.Module, projection: nn.Module) -> Iterator[dict[str, int]]:
    """The tokens per image the user's forward got from ``vision_model`` (``[batch, tokens,
    hidden]``) and fed ``vision_projection`` (``[tokens, batch, hidden]``), on their first calls:
    what the forward drops between them."""
    seen: dict[str, int] = {}

    def vision_output(_: nn.Module, __: Any, output: torch.Tensor) -> None:
        seen.setdefault("vision", output.shape[1])

    def projector_input(_: nn.Module, inputs: tuple[Any, ...]) -> None:
        seen.setdefault("projector", inputs[0].shape[0])

    handles = [
        vision.register_forward_hook(vision_output),
        projection.register_forward_pre_hook(projector_input),
    ]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def _drop_problem(config: OptimusConfig, seen: dict[str, int]) -> str | None:
    """Why the user's forward feeds its projector other tokens than the encoder does (one line
    naming the flag that says so), or None. The flags' ``--disable-vision-class-token``
    (``drop_class_token``) is the one reading of the vision path no module holds."""
    if "vision" not in seen or "projector" not in seen:
        return None
    encoder = config.encoders[0]
    dropped = seen["vision"] - seen["projector"]
    if dropped == _dropped_tokens(config):
        return None
    where = (
        "(Megatron-LM's --disable-vision-class-token, model.encoders[0].drop_class_token: "
        f"{'true' if encoder.drop_class_token else 'false'})"
    )
    if encoder.class_tokens and dropped == encoder.class_tokens:
        return (
            "the start-up probe: the model's forward drops the vision model's class token before "
            f"vision_projection, but the job keeps it {where}; give --disable-vision-class-token "
            "(drop_class_token: true)"
        )
    if encoder.class_tokens and dropped == 0:
        return (
            "the start-up probe: the model's forward keeps the vision model's class token before "
            f"vision_projection, but the job drops it {where}; leave out "
            "--disable-vision-class-token (drop_class_token: false)"
        )
    return (
        f"the start-up probe: the model's forward feeds vision_projection {seen['projector']} of "
        f"the {seen['vision']} tokens vision_model gives per image; the Optimus encoder feeds it "
        "all of them, or all but the class token; run the job without --optimus-schedule"
    )


def _trained(*modules: nn.Module) -> list[nn.Parameter]:
    return [p for module in modules for p in module.parameters() if p.requires_grad]


def _gradients(output: torch.Tensor, params: list[nn.Parameter]) -> list[torch.Tensor]:
    """d(output . R)/d(params) for a fixed R, the same on every rank and for both paths, so the two
    outputs are differentiated alike (the probe runs at the LLM's TP, on its group).
    ``autograd.grad`` runs no AccumulateGrad node, so neither a ``.grad`` nor Megatron's DDP grad
    buffers see the probe."""
    generator = torch.Generator().manual_seed(0)
    weights = torch.randn(output.shape, generator=generator).to(output.device, output.dtype)
    grads = torch.autograd.grad((output * weights).sum(), params, allow_unused=True)
    grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]
    # under sequence parallelism a replicated weight's gradient is each rank's part of the sum
    # (megatron-core's finalize_model_grads reduces it): the whole one is compared
    tp_group = parallel_state.get_tensor_model_parallel_group()
    for p, g in zip(params, grads):
        if getattr(p, "sequence_parallel", False) and tp_group.size() > 1:
            dist.all_reduce(g, group=tp_group)
    # summed over the replicas, each with its own batch: the copy that lays the user's gradients
    # out as the probe's reads replica 0's
    for g in grads:
        dist.all_reduce(g, group=parallel_state.get_data_parallel_group())
    return grads


def _gradient_difference(
    config: OptimusConfig,
    first_chunk: nn.Module | None,
    in_place: Callable[[], Any],
    probe: EncoderStage | None,
    grads: _Grads | None,
    dp_group: Any,
) -> tuple[str, float] | None:
    """(the LLaVA key of the probe's weight whose gradient differs most, relative to the largest
    gradient of that weight, and that difference) on a first-stage rank whose forwards agreed: the
    user's gradients laid out as the probe's weights by the same copy that filled them (every rank
    takes part)."""
    theirs_params, theirs_grads, ours_params, ours_grads = grads or ([], [], [], [])
    scratch = [torch.zeros_like(g) for g in ours_grads]
    weights = [p.data for p in (*theirs_params, *ours_params)]
    for p, data in zip((*theirs_params, *ours_params), (*theirs_grads, *scratch)):
        p.data = data
    try:
        with in_place():
            copy_sharded_state(
                {}
                if grads is None or first_chunk is None
                else vision_sharded_state_dict(first_chunk),
                {}
                if grads is None or probe is None
                else encoder_sharded_state_dict(config, probe, dp_group),
                "the model's vision gradients -> the start-up probe's encoder",
            )
    finally:
        for p, data in zip((*theirs_params, *ours_params), weights):
            p.data = data
    if grads is None or probe is None:
        return None
    names = {id(p): name for name, p in probe.named_parameters()}
    differences = [
        (names[id(p)], _relative_difference(expected, got))
        for p, expected, got in zip(ours_params, scratch, ours_grads)
    ]
    return max(differences, key=lambda d: d[1], default=("", 0.0))


def _gradient_report(
    config: OptimusConfig, gradients: tuple[str, float], forward: float
) -> tuple[str | None, float]:
    name, difference = gradients
    tolerance = TOLERANCE[config.training.precision]
    if difference > tolerance:
        return (
            f"the start-up probe: the vision weights' gradients differ by {difference:.1e} "
            f"(relative, beyond {tolerance:g}; most at the encoder's {name}) between the model's "
            "backward and the Optimus encoder's, though their forwards agree: the model's backward "
            "does something the encoder's does not (a gradient hook or autograd function of its "
            "own); run the job without --optimus-schedule",
            difference,
        )
    return None, max(forward, difference)


def _relative_difference(expected: torch.Tensor, got: torch.Tensor) -> float:
    if expected.shape != got.shape:
        return float("inf")
    scale = expected.detach().float().abs().max().clamp_min(1e-12)
    return float((expected.detach().float() - got.detach().float()).abs().max() / scale)
