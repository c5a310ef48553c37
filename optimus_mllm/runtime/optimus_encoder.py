"""The Optimus side of a training job, for any loop that runs megatron-core's pipeline schedule.

``OptimusEncoder`` is this rank's part of the encoder under the schedule artifact's encoder plan:
its stage (``vit.EncoderStage``), process groups, kernel-level ops, hook plan and messenger, built
once per job. ``OptimusStep`` is one training step's context: the mailbox, the executor that runs
the encoder ops at the hook points, the image-token leaves whose gradients go back to the encoder,
and the ``HookDriver`` that turns megatron-core's timer and reduction callbacks into hook events.
The project's ``Trainer`` and the Megatron-LM seams (``optimus_mllm.megatron.seams``) drive the
same two objects, so the encoder runs alike under either loop.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec
from torch import nn

from megatron_patches.p2p import ChannelP2PCommunicator, build_pipeline_channels
from optimus_mllm.config import OptimusConfig
from optimus_mllm.config.validation import validate
from optimus_mllm.errors import OptimusError
from optimus_mllm.planner.plans import ParallelPlan, encoder_pipelines_per_llm_pipeline
from optimus_mllm.runtime.data import ImageSource
from optimus_mllm.runtime.dtypes import DTYPES
from optimus_mllm.runtime.encoder_ops import StageOps, build_stage_ops
from optimus_mllm.runtime.executor import (
    EncoderExecutor,
    HookDriver,
    ImagesPerMicrobatch,
    Mailbox,
    embeddings_shape,
    incoming_messages,
)
from optimus_mllm.runtime.hook_plan import (
    Event,
    EventKind,
    HookPlan,
    StageHookPlan,
    build_hook_plan,
)
from optimus_mllm.runtime.layer_ops import vision_transformer_config
from optimus_mllm.runtime.llm import llm_pipelines
from optimus_mllm.runtime.messages import Messenger
from optimus_mllm.runtime.microbatches import MicrobatchNumbering
from optimus_mllm.runtime.process_groups import (
    EncoderLLMLink,
    EncoderProcessGroups,
    build_encoder_process_groups,
    build_encoder_rank_layout,
)
from optimus_mllm.runtime.sharded_state import copy_sharded_state, encoder_sharded_state_dict
from optimus_mllm.runtime.streams import EncoderStream
from optimus_mllm.runtime.tp_modes.groups import build_grids
from optimus_mllm.runtime.user_model import (
    ImageEmbeddingsInput,
    describe_projector,
    described_encoder,
    user_vision_layer_spec,
    user_vision_problem,
    vision_modules,
    vision_sharded_state_dict,
)
from optimus_mllm.runtime.verdicts import heard_by_every_rank
from optimus_mllm.runtime.vit import EncoderStage
from optimus_mllm.scheduler.artifact_format import EncoderMicrobatch, LLMOp, ScheduleArtifact
from optimus_mllm.scheduler.pipeline_order import pipeline_producer


@dataclass
class OptimusEncoder:
    """This rank's encoder stage under the artifact's encoder plan, and how it reaches the LLM."""

    config: OptimusConfig
    enc_plan: ParallelPlan
    m: int  # encoder pipelines per LLM pipeline
    groups: EncoderProcessGroups
    encoder: EncoderStage
    ops: StageOps
    stage_plan: StageHookPlan
    messenger: Messenger
    numbering: MicrobatchNumbering
    hook_plan: HookPlan
    gpu: int  # this rank's GPU within its LLM pipeline, which picks its stage's hook plan
    # per-iteration schedules' hook plans, by their artifact's id (a reused schedule's artifact is
    # the same object): built once each
    _hook_plans: dict[int, tuple[ScheduleArtifact, HookPlan]] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        config: OptimusConfig,
        llm_plan: ParallelPlan,
        artifact: ScheduleArtifact,
        numbering: MicrobatchNumbering,
        rank: int,
        device: torch.device,
        layer_specs: dict[str, ModuleSpec] | None = None,
    ) -> OptimusEncoder:
        """The stage, its groups (created here: every rank calls this, in the same order) and the
        messages it will receive, in their senders' order."""
        enc_plan = artifact.encoder_plan
        m = encoder_pipelines_per_llm_pipeline(llm_plan, enc_plan)
        layout = build_encoder_rank_layout(llm_plan, enc_plan)
        groups = build_encoder_process_groups(layout, rank)
        # every rank builds every encoder TP group's grid (collective), keeps its own
        grid = build_grids(layout.tp_groups) if enc_plan.tp_mode == "2d" else None
        encoder = EncoderStage(
            config,
            groups.coords.pp,
            enc_plan.pp,
            groups.tp_group,
            layer_specs=layer_specs,
            tp_mode=enc_plan.tp_mode,
            grid=grid,
        )
        ops = build_stage_ops(encoder.blocks(), config.training.recompute)
        hook_plan = build_hook_plan(artifact)
        gpu = layout.coords[rank].gpu
        incoming = incoming_messages(
            config, hook_plan, groups, ops.output_grad_encoders, numbering, m, enc_plan.pp
        )
        messenger = Messenger(
            rank, groups.channels, incoming, DTYPES[config.training.precision], device
        )
        return cls(
            config,
            enc_plan,
            m,
            groups,
            encoder,
            ops,
            hook_plan.for_gpu(gpu),
            messenger,
            numbering,
            hook_plan,
            gpu,
        )

    def run_artifact(self, artifact: ScheduleArtifact, numbering: MicrobatchNumbering) -> None:
        """Run the next step under ``artifact`` (a per-iteration schedule of the same encoder
        plan): its hook plan and its encoder microbatch assignment."""
        if id(artifact) not in self._hook_plans:
            self._hook_plans[id(artifact)] = (artifact, build_hook_plan(artifact))
        self.hook_plan = self._hook_plans[id(artifact)][1]
        self.stage_plan = self.hook_plan.for_gpu(self.gpu)
        self.numbering = numbering

    def expect_images(self, images: ImagesPerMicrobatch) -> None:
        """Size this step's incoming messages for ``images`` per LLM microbatch."""
        self.messenger.expect(
            incoming_messages(
                self.config,
                self.hook_plan,
                self.groups,
                self.ops.output_grad_encoders,
                self.numbering,
                self.m,
                self.enc_plan.pp,
                images,
            )
        )

    def link(self, source: EncoderMicrobatch) -> EncoderLLMLink:
        """The link encoder microbatch ``source``'s image tokens arrive over on this rank."""
        encoder_dp = self.numbering.llm_dp * self.m + source.encoder_pipeline
        return next(link for link in self.groups.embedding_recvs if link.encoder_dp == encoder_dp)


class OptimusStep:
    """One training step's encoder side: the executor at the hook points, A_i into the LLM's first
    stage and G_i back once the LLM's first stage finished microbatch i's backward."""

    def __init__(
        self,
        optimus: OptimusEncoder,
        iteration: int,
        images: ImageSource,
        stream: EncoderStream,
        op_order: tuple[LLMOp, ...],
        llm_stage: int,
        collectives: dict[int, list[str]],
        wait_for_input: Callable[[LLMOp], None] | None,
        images_per_microbatch: ImagesPerMicrobatch | None = None,
    ):
        """``images_per_microbatch``: the images of each of this replica's LLM microbatches this
        step, where they vary (a webdataset); by default ``micro_batch_size``, one per sample."""
        self.optimus, self.op_order, self.llm_stage = optimus, op_order, llm_stage
        if images_per_microbatch is not None:
            optimus.expect_images(images_per_microbatch)
        self.mailbox = Mailbox(stream)
        self.executor = EncoderExecutor(
            optimus.config,
            optimus.stage_plan,
            optimus.ops,
            optimus.groups,
            optimus.numbering,
            optimus.enc_plan.pp,
            iteration,
            self.mailbox,
            images,
            optimus.messenger,
            images_per_microbatch,
        )
        self.leaves: dict[int, torch.Tensor] = {}
        # LLM microbatch -> the encoder microbatches whose outputs its A_i joined, in image order
        self.fed_by: dict[int, tuple[EncoderMicrobatch, ...]] = {}
        self.driver = HookDriver(op_order, self, wait_for_input, collectives)

    def image_embeddings(self, microbatch: int) -> torch.Tensor:
        """A_i, [image tokens, batch, hidden], as a leaf: its gradient after the backward is G_i.
        Fed by several encoder microbatches, it joins their outputs in image order."""
        messenger = self.optimus.messenger
        if not self.executor.has_images(microbatch):  # nothing to wait for, nothing to send back
            shape = embeddings_shape(self.optimus.config, 0)
            embeddings = torch.empty(shape, dtype=messenger.dtype, device=messenger.device)
        else:
            numbering, images = self.optimus.numbering, self.executor.images_of(microbatch)
            fed = numbering.images_fed(microbatch, images)
            if fed != images:  # artifact_checks and the per-iteration build rule this out
                raise RuntimeError(
                    f"LLM microbatch {microbatch} has {images} images, but the step's schedule "
                    f"feeds it {fed}"
                )
            feeders = numbering.feeders(microbatch)
            parts = []
            for part, source in enumerate(feeders):
                link, key = self.optimus.link(source), (microbatch, part)
                if link.encoder_rank == self.optimus.groups.rank:
                    parts.append(self.mailbox.take_embeddings(key))
                else:
                    parts.append(messenger.recv("embeddings", link.encoder_rank, key))
            embeddings = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
            self.fed_by[microbatch] = feeders
        leaf = embeddings.detach().requires_grad_(True)
        self.leaves[microbatch] = leaf
        return leaf

    def on_event(self, event: Event, ran_at: Event) -> None:
        """The LLM's own action at an event (send G_i), then the encoder ops placed there."""
        if event.kind is EventKind.OP_END:
            op = self.op_order[event.op]
            if op.phase == "bwd" and op.chunk == 0 and self.llm_stage == 0:
                leaf = self.leaves.pop(op.microbatch)
                if self.executor.has_images(op.microbatch):
                    self._send_gradient(op.microbatch, leaf.grad.detach())
        self.executor.on_event(event, ran_at)

    def _send_gradient(self, microbatch: int, grad: torch.Tensor) -> None:
        """G_i back to the encoder microbatches that made A_i, each its share of the images."""
        numbering, images = self.optimus.numbering, self.executor.images_of(microbatch)
        for part, source in enumerate(numbering.feeders(microbatch)):
            link = self.optimus.link(source)
            if not link.carries_gradient:
                continue
            j, k = source.encoder_pipeline, source.local_microbatch
            share = numbering.chain_images(j, k, images)
            piece = grad[:, share.start : share.stop]
            if link.encoder_rank == self.optimus.groups.rank:
                self.mailbox.gradients[(microbatch, part)] = piece
            else:
                messenger = self.optimus.messenger
                messenger.send("embeddings_grad", link.encoder_rank, piece, (microbatch, part))

    def finish(self) -> None:
        """After the schedule and the ``post`` event: every encoder op ran, every message left."""
        self.executor.finish()
        self.optimus.messenger.finish()


def optimus_communicator(
    tconfig: TransformerConfig, llm_plan: ParallelPlan, rank: int
) -> ChannelP2PCommunicator | None:
    """The LLM's P2P for the Optimus schedule: ops wait for their inputs only when they need them
    (megatron_patches.p2p), so every warm-up the timeline accepts runs; with the interleaved
    schedule's ``overlap_p2p_comm`` the sends leave right after their op, as the timeline
    assumes. Collective (it creates the channels' groups)."""
    if llm_plan.pp == 1:
        return None
    tconfig.overlap_p2p_comm = llm_plan.vp > 1
    channels = build_pipeline_channels([list(ranks) for ranks in llm_pipelines()], rank)
    return ChannelP2PCommunicator(
        parallel_state.get_pipeline_model_parallel_group(), tconfig, channels
    )


def schedule_groups(communicator: ChannelP2PCommunicator | None) -> dict[str, Any]:
    """The communicator and megatron-core's own groups for its schedule (it takes both or
    neither)."""
    if communicator is None:
        return {}
    groups = ProcessGroupCollection.use_mpu_process_groups(
        ["tp", "cp", "embd", "pos_embd", "pp", "dp_cp"]
    )
    return {"p2p_communicator": communicator, "pg_collection": groups}


def input_waiter(
    communicator: ChannelP2PCommunicator | None, stage: int, llm_plan: ParallelPlan
) -> Callable[[LLMOp], None]:
    """Called right before an LLM op: its pipeline input, if it has one, must have arrived."""

    def wait_for_input(op: LLMOp) -> None:
        if (
            communicator is not None
            and pipeline_producer(stage, op.chunk, op.phase, llm_plan.pp, llm_plan.vp) is not None
        ):
            communicator.wait_for_input("prev" if op.phase == "fwd" else "next")

    return wait_for_input


@dataclass(frozen=True)
class UserVision:
    """The user's vision model and projector as their provider built them (first pipeline stage
    only), and the stand-in that took their place in the model."""

    vision_model: nn.Module
    vision_projection: nn.Module
    stand_in: ImageEmbeddingsInput


def with_user_vision(config: OptimusConfig, first_chunk: nn.Module | None) -> OptimusConfig:
    """``config`` with its encoder shaped as the user's provider built the vision model
    (``described_encoder``), whatever the config said, and the LLM's sequence holding the image
    tokens that vision model gives: read on the first pipeline stage and heard by every rank, which
    all refuse together a vision model the encoder cannot run, or a config it makes invalid."""
    encoder = config.encoders[0]
    report = None
    if first_chunk is not None:
        try:
            vision, _ = vision_modules(first_chunk)
            report = (described_encoder(encoder, vision), None)
        except OptimusError as exc:
            report = (None, str(exc))
    built = heard_by_every_rank(report)[0]
    llm = replace(
        config.llm, seq_length=config.llm.seq_length + built.image_tokens - encoder.image_tokens
    )
    model = replace(config.model, encoders=(built, *config.encoders[1:]), llm=llm)
    config = replace(config, model=model)
    validate(config)
    return config


def with_user_projector(config: OptimusConfig, first_chunk: nn.Module | None) -> OptimusConfig:
    """``config`` with its encoder's projector as the user's provider built it
    (``describe_projector``), whatever the config said: read on the first pipeline stage, the only
    one that holds it, and heard by every rank as a ``ProjectorConfig`` (names, not callables).
    Every rank refuses together a projector the encoder cannot run as built."""
    encoder = config.encoders[0]
    report = None
    if first_chunk is not None:
        try:
            _, projection = vision_modules(first_chunk)
            described = describe_projector(
                projection, encoder.projector_input_size, config.llm.hidden_size
            )
            report = (replace(described, spatial_merge=encoder.projector.spatial_merge), None)
        except OptimusError as exc:
            report = (None, str(exc))
    projector = heard_by_every_rank(report)[0]
    encoders = (replace(encoder, projector=projector), *config.encoders[1:])
    return replace(config, model=replace(config.model, encoders=encoders))


def with_user_model(config: OptimusConfig, first_chunk: nn.Module | None) -> OptimusConfig:
    """``config`` as the user's provider built the vision path: its encoder from the built
    ``vision_model`` (``with_user_vision``), its projector from the built ``vision_projection``
    (``with_user_projector``); the config's own fields only where the modules cannot tell (whether
    the forward drops the class token, which the start-up probe checks). The one reading of the
    user's model for both routes: Megatron-LM's seams and the project's trainer.
    """
    return with_user_projector(with_user_vision(config, first_chunk), first_chunk)


def user_vision_spec(
    config: OptimusConfig, first_chunk: nn.Module | None, check: bool
) -> ModuleSpec:
    """The layer spec of the user's vision layers, read on the first stage and heard by every rank,
    which all refuse together when ``check`` finds the model is not the one the config describes."""
    report = None
    encoder = config.encoders[0]
    if first_chunk is not None:
        try:
            vision, _ = vision_modules(first_chunk)
            # the encoder stage's layer config (its TP and init std are not among the fields
            # compared)
            expected = vision_transformer_config(
                encoder, 1, DTYPES[config.training.precision], 0.02
            )
            report = (
                user_vision_layer_spec(vision),
                user_vision_problem(encoder, expected, first_chunk, config.llm.hidden_size)
                if check
                else None,
            )
        except OptimusError as exc:
            report = (None, str(exc))
    return heard_by_every_rank(report)[0]


def take_user_vision(
    config: OptimusConfig,
    optimus: OptimusEncoder,
    first_chunk: nn.Module | None,
    device: torch.device,
) -> UserVision | None:
    """Start the encoder stage from the user's vision weights (every rank takes part) and put
    ``ImageEmbeddingsInput`` and an identity projector in their place in the first stage.

    The chunk goes to the training device and precision after this (Megatron-LM's ``get_model``:
    ``.cuda()`` and ``Float16Module`` under --bf16/--fp16; the trainer: ``.to``), so the modules
    held aside go there now, for the forwards that put them back (the start-up probe, evaluation).
    """
    source = {} if first_chunk is None else vision_sharded_state_dict(first_chunk)
    copy_sharded_state(
        source,
        encoder_sharded_state_dict(config, optimus.encoder, optimus.groups.dp_group),
        "model_provider's vision model -> the Optimus encoder",
    )
    if first_chunk is None:
        return None
    taken = UserVision(
        first_chunk.vision_model, first_chunk.vision_projection, ImageEmbeddingsInput()
    )
    for module in (taken.vision_model, taken.vision_projection):
        module.to(device, DTYPES[config.training.precision])
    first_chunk.vision_model = taken.stand_in
    first_chunk.vision_projection = nn.Identity()
    return taken


@contextlib.contextmanager
def user_vision_in_place(first_chunk: nn.Module | None, taken: UserVision | None) -> Iterator[None]:
    """The user's vision modules in the first stage's chunk instead of the stand-in, as they are
    (evaluation, checkpoints, the start-up probe); nothing off the first stage."""
    if first_chunk is None or taken is None:
        yield
        return
    for module in (taken.vision_model, taken.vision_projection):
        module.train(first_chunk.training)
    # put back the very modules: under --overlap-param-gather megatron-core's DDP holds a forward
    # pre-hook on each module of the chunk, which Megatron-LM removes by module before a save
    stand_ins = first_chunk.vision_model, first_chunk.vision_projection
    first_chunk.vision_model = taken.vision_model
    first_chunk.vision_projection = taken.vision_projection
    try:
        yield
    finally:
        first_chunk.vision_model, first_chunk.vision_projection = stand_ins
