"""One training step of the ViT + projector + GPT model, Optimus-style or Megatron-style.

``optimus``: every rank holds an LLM stage (megatron-core ``GPTModel`` chunks under
``parallel_state``) and an encoder stage under the encoder plan (its own process groups); the
encoder's kernel-level ops run at the hook points that the schedule artifact names, and the image
tokens reach the LLM by P2P. ``baseline``: the encoders run whole in the first pipeline stage's
pre-process, tensor-parallel with the LLM, as Megatron-LM does for multimodal models; the same
weights, data and LLM plan. ``balanced``: the paper's Megatron-LM balanced baseline
(``runtime/balanced.py``): encoder and LLM layers split together into the LLM plan's virtual stages,
tensor-parallel with the LLM. All three train with megatron-core's own stack
(``runtime/optimizer.py``: DDP, the distributed optimizer, AdamW, clipping by one norm over LLM and
encoder, the LR schedule), so their losses, gradient norms and weights can be compared number for
number. What differs between the three is a ``runtime/placements.py`` ``Placement`` (the one place a
mode's name is read); the step itself is ``runtime/hooked_step.py``'s ``HookedStep``, which the
Megatron-LM seams (``megatron/seams.py``) run too.

Under ``optimus`` with ``training.schedule_per_iteration`` (a webdataset), each step runs its own
schedule artifact, built while the step before trained, or the fallback (``iteration_schedules``).

Device: the CPU (gloo), or this process's GPU when CUDA is visible, with the models in the config's
precision there; the encoder ops then run on a CUDA side stream (``streams``) unless
``side_stream=False``. The CPU path is unchanged by any of this.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.utils import get_model_config

import megatron_patches
from megatron_patches.ddp import gather_main_grads
from optimus_mllm.config import OptimusConfig
from optimus_mllm.costing.workload import (
    EncoderWorkload,
    IterationWorkload,
    check_within,
    max_images_per_microbatch,
)
from optimus_mllm.errors import AgreedError, ConfigError, OptimusError
from optimus_mllm.planner.plans import ParallelPlan
from optimus_mllm.runtime.communicators import (
    FirstUse,
    create_communicators,
    encoder_uses,
    llm_uses,
    pipeline_channel_uses,
)
from optimus_mllm.runtime.data import ImageCount, Microbatch
from optimus_mllm.runtime.data_sources import image_count, microbatch_source
from optimus_mllm.runtime.dropout import llm_chunk_index, microbatch_seed, seed_llm_dropout
from optimus_mllm.runtime.dtypes import DTYPES
from optimus_mllm.runtime.executor import (
    ExecutedOp,
    HookDriver,
    ImagesPerMicrobatch,
    embeddings_shape,
)
from optimus_mllm.runtime.hook_plan import POST, PRE, planned_collectives
from optimus_mllm.runtime.hooked_step import EncoderSide, HookedStep, LLMOrder
from optimus_mllm.runtime.iteration_schedules import IterationSchedules, StepSchedule
from optimus_mllm.runtime.llm import (
    llm_pipelines,
    pre_post_process,
    transformer_config,
)
from optimus_mllm.runtime.microbatches import MicrobatchNumbering
from optimus_mllm.runtime.mode import Mode
from optimus_mllm.runtime.optimizer import (
    build_opt_param_scheduler,
    build_optimizer,
    encoder_process_groups,
    wrap_ddp,
)
from optimus_mllm.runtime.optimus_encoder import (
    OptimusEncoder,
    OptimusStep,
    UserVision,
    input_waiter,
    optimus_communicator,
    take_user_vision,
    user_vision_in_place,
    user_vision_spec,
    with_user_model,
)
from optimus_mllm.runtime.placements import ChunkInput, placement
from optimus_mllm.runtime.streams import make_encoder_stream, to_device, training_device
from optimus_mllm.runtime.tp_modes.trained import refuse_untrained_tp_modes
from optimus_mllm.runtime.user_model import (
    UserModel,
    build_user_chunks,
    config_problem,
    language_model,
    user_images,
)
from optimus_mllm.runtime.vision_probe import probe_vision_path
from optimus_mllm.runtime.vit import EncoderStage
from optimus_mllm.runtime.weights import init_plan_independent_
from optimus_mllm.scheduler.artifact_format import EncoderMicrobatch, LLMOp, ScheduleArtifact
from optimus_mllm.scheduler.pipeline_order import default_warmup, rank_op_order

# a model_provider's job scheduled once its model is read: the config as the built model describes
# it (``with_user_model``) -> the artifact to run, or None to run the model as built
ScheduleFor = Callable[[OptimusConfig], ScheduleArtifact | None]


@dataclass
class StepResult:
    # mean LM loss over the step's microbatches; None off the last pipeline stage
    loss: float | None
    # over LLM and encoder, before clipping; None where fp16 skipped the update
    grad_norm: float | None
    lr: float  # the learning rate this step's update used
    # fp16: the dynamic loss scale after this step (what Megatron logs); else None
    loss_scale: float | None
    # every encoder op run here: where it ran, where it was scheduled
    encoder_record: list[ExecutedOp]
    # TP collectives megatron-core ran that the schedule's LLM kernels lack
    unplanned_collectives: int
    # under training.schedule_per_iteration: the schedule this step ran; None: the artifact's
    schedule: StepSchedule | None = None
    # LLM microbatch -> the job's microbatch (the sample) its forwards ran here, in the LLM's order
    llm_microbatches: dict[int, int] = field(default_factory=dict)
    # on the LLM's first stage: LLM microbatch -> the encoder microbatches its image tokens came
    # from, joined in image order (none for a microbatch without images)
    fed_by: dict[int, tuple[EncoderMicrobatch, ...]] = field(default_factory=dict)

    @property
    def moved_ops(self) -> int:
        return sum(op.moved for op in self.encoder_record)

    @property
    def moved_by_repair(self) -> int:
        """Ops run before or after the LLM because their hooks would have waited in a cycle."""
        return sum(op.moved_by_repair for op in self.encoder_record)

    @property
    def moved_to_op_end(self) -> int:
        """Ops run at their LLM op's end because a TP collective planned there never ran."""
        return sum(op.moved_to_op_end for op in self.encoder_record)

    @property
    def ops_inside_llm(self) -> int:
        return sum(op.ran_at not in (PRE, POST) for op in self.encoder_record)


class Trainer:
    def __init__(
        self,
        config: OptimusConfig,
        llm_plan: ParallelPlan,
        mode: Mode,
        artifact: ScheduleArtifact | ScheduleFor | None = None,
        *,
        side_stream: bool = True,
        timers: Any = None,
        encoder_layer_specs: Mapping[str, ModuleSpec] | None = None,
        user_model: UserModel | None = None,
    ):
        """``timers``: the job's Megatron ``Timers`` (``megatron.core.timers``), which keep timing
        megatron-core's schedule (``forward-compute``, ``backward-compute``, the P2P calls) under
        the hooks the runtime sets in ``config.timers``. ``encoder_layer_specs``: the job's
        megatron-core layer spec per encoder name (e.g. ``get_vit_layer_with_local_spec()``), which
        both runtimes build the encoder's layers from; by default ``layer_ops.vision_layer_spec()``.
        ``user_model``: the job's own ``model_provider``, ``forward_step`` and batches
        (``user_model``), run in place of this project's model and data; its single encoder is
        ``config.encoders[0]``, under Optimus as the provider built it (``with_user_model``), so
        its ``artifact`` is a ``ScheduleFor``, made once the model is read."""
        self.placement = placement(mode)
        self.placement.refuse(artifact, user_model is not None)
        if not callable(artifact):
            _refuse_unrunnable(
                config,
                llm_plan,
                mode,
                artifact,
                user_model is not None or encoder_layer_specs is not None,
            )
        if user_model is not None and len(config.encoders) != 1:
            raise OptimusError(
                "model.encoders: a model_provider's model has one vision_model; give one encoder"
            )
        self.config, self.plan, self.artifact = config, llm_plan, artifact
        self.encoder_layer_specs = encoder_layer_specs
        self.user_model = user_model
        self.timers = timers
        self.rank = dist.get_rank()
        self.image_count: ImageCount | None = None
        if user_model is None:
            self.data = microbatch_source(config)
            self.images = lambda iteration, microbatch: self.data(iteration, microbatch).images
            self.image_count = image_count(self.data)
            self.placement.refuse_data(self.image_count is not None)
        self.device = training_device()  # before megatron-core places parameters on the current GPU
        self.stream = make_encoder_stream(self.device, side_stream)
        self._owns_patches = not megatron_patches.is_applied()
        megatron_patches.apply()
        self._owns_parallel_state = join_model_parallel(llm_plan)
        torch.manual_seed(config.training.seed)
        tensor_parallel.model_parallel_cuda_manual_seed(config.training.seed)
        # the balanced baseline's, for a word embedding tied across pipeline ranks
        self.embedding_group = None
        if user_model is None:
            parts = self.placement.build_llm(config, llm_plan, encoder_layer_specs)
            self.tconfig, self.modules, self.chunks = parts.tconfig, parts.modules, parts.chunks
            self.embedding_group = parts.embedding_group
        else:  # the user's modules and initialisation, as Megatron-LM's get_model builds them
            self.modules = build_user_chunks(user_model.model_provider, pre_post_process(llm_plan))
            self.chunks = [language_model(chunk) for chunk in self.modules]
            problem = config_problem(
                "language model",
                "model.llm",
                transformer_config(config, llm_plan),
                self.chunks[0].config,
            )
            if problem:  # every rank builds the same model, so every rank refuses
                raise OptimusError(problem)
            # the config megatron-core's schedule reads
            self.tconfig = get_model_config(self.modules[0])
            if self.placement.encoder_plan:
                config, artifact = self._read_user_model(artifact)
                self.placement = placement("optimus" if artifact is not None else "baseline")
                self.config, self.artifact = config, artifact
            self.images = user_images(config, user_model)
        self.stage = parallel_state.get_pipeline_model_parallel_rank()
        self.llm_dp = parallel_state.get_data_parallel_rank()
        self.num_microbatches = config.num_microbatches_total // llm_plan.dp
        self.numbering = (
            MicrobatchNumbering(self.num_microbatches, self.llm_dp)
            if artifact is None
            else MicrobatchNumbering.of_artifact(artifact, self.num_microbatches, self.llm_dp)
        )
        # the artifact's warm-up and op order (artifact_checks made them megatron-core's under that
        # warm-up); without one, megatron-core's own
        if artifact is not None:
            self.warmup = list(artifact.warmup)
            self.op_order = artifact.llm_op_order[self.stage]
        else:
            self.warmup = [
                default_warmup(llm_plan.pp, llm_plan.vp, self.num_microbatches, s)
                for s in range(llm_plan.pp)
            ]
            self.op_order = tuple(
                LLMOp(*op)
                for op in rank_op_order(
                    self.num_microbatches, llm_plan.vp, self.warmup[self.stage], llm_plan.pp
                )
            )
        self.collectives = {} if artifact is None else planned_collectives(artifact, self.stage)
        self.encoder: EncoderStage | None = None
        self.optimus: OptimusEncoder | None = None
        self.user_vision: UserVision | None = None
        if user_model is not None:
            self._adopt_user_vision()
        elif self.placement.encoder_plan:
            self._build_optimus_encoder()
        else:
            self.encoder = self.placement.encoder_in_llm(config, self.stage, encoder_layer_specs)
        self.schedules: IterationSchedules | None = None
        # this step's LLM microbatch -> the job's microbatch its forwards ran (``StepResult``)
        self._step_microbatches: dict[int, int] = {}
        if self.placement.encoder_plan and config.training.schedule_per_iteration:
            if self.image_count is None:
                raise OptimusError(
                    "training.schedule_per_iteration: needs a webdataset's varying images "
                    "(data.path); leave it false for fixed images or a model_provider's batches"
                )
            self.schedules = IterationSchedules(
                config, llm_plan, artifact, self._iteration_workload, self.llm_dp
            )
        if user_model is None:
            for stage in self.encoder_stages:
                init_plan_independent_(stage, config.training.seed)
        # megatron-core leaves some parts (torch norm, position embedding) on the CPU and in fp32:
        # every part in the training precision, on the training device (megatron-core's DDP then
        # keeps fp32 main copies)
        dtype = DTYPES[config.training.precision]
        for module in [*self.modules, *([self.encoder] if self.encoder is not None else [])]:
            module.to(self.device, dtype)
        self.communicator = (
            optimus_communicator(self.tconfig, llm_plan, self.rank)
            if self.placement.encoder_plan
            else None
        )
        self._wait_for_input = input_waiter(self.communicator, self.stage, llm_plan)
        self._build_training_stack()
        # NCCL's communicators made here, not at a first use inside the schedule (communicators)
        create_communicators(self._communicator_uses(), self.rank, self.device)

    def _build_training_stack(self) -> None:
        """megatron-core's DDP around every model part, one optimizer and the LR schedule over
        them."""
        self.models = [wrap_ddp(self.config, self.tconfig, module) for module in self.modules]
        self.encoder_ddp = None
        encoder_groups = (
            encoder_process_groups(self.groups) if self.placement.encoder_plan else None
        )
        if self.encoder is not None:
            # DDP takes each parameter's gradient-accumulation node when it is built, and autograd
            # runs that node, with DDP's hook into main_grad, on the stream current then. Under
            # Optimus the encoder's backward runs on the side stream: built there, its accumulation
            # neither runs on nor waits for the LLM's stream (and the LLM's for it)
            on_side_stream = encoder_groups is not None
            with self.stream.launch() if on_side_stream else contextlib.nullcontext():
                self.encoder_ddp = wrap_ddp(
                    self.config,
                    self.tconfig,
                    self.encoder,
                    encoder_groups,
                    replicas=self.plan.dp if on_side_stream else None,
                )
            if on_side_stream:
                self.stream.finish()  # the LLM's stream ordered after the buffers DDP made there
        self.optimizer = build_optimizer(
            self.config,
            self.models,
            self.encoder_ddp,
            encoder_groups,
            self.groups.dp_group_gloo if self.placement.encoder_plan else None,
        )
        self.opt_param_scheduler = build_opt_param_scheduler(self.config, self.optimizer)
        self.tconfig.grad_scale_func = self.optimizer.scale_loss

    @property
    def encoder_stages(self) -> list[EncoderStage]:
        """This rank's encoder layers: its encoder stage, or in the balanced baseline its virtual
        stages' parts."""
        return self.placement.encoder_stages(self.modules, self.encoder)

    @property
    def ddp_models(self) -> list[Any]:
        """Every megatron-core DDP wrapper on this rank: the LLM chunks', then the encoder
        stage's."""
        return [*self.models, *([self.encoder_ddp] if self.encoder_ddp is not None else [])]

    def _communicator_uses(self) -> list[FirstUse]:
        """Every group this rank's runtime communicates over, in the one order of all ranks."""
        uses = llm_uses(self.embedding_group)
        if self.communicator is not None:
            uses += pipeline_channel_uses(llm_pipelines(), self.rank, self.communicator.channels)
        if self.placement.encoder_plan:
            uses += encoder_uses(self.groups)
        return uses

    def _read_user_model(
        self, schedule_for: ScheduleFor
    ) -> tuple[OptimusConfig, ScheduleArtifact | None]:
        """With the flag: the job's config as the user's provider built its vision path
        (``with_user_model``, the reading Megatron-LM's seams make), and the schedule made for that
        job (None: run the model as built). Every rank takes part and refuses alike."""
        first = (
            self.modules[0] if parallel_state.is_pipeline_first_stage(ignore_virtual=True) else None
        )
        config = with_user_model(self.config, first)
        artifact = schedule_for(config)
        mode = "optimus" if artifact is not None else "baseline"
        _refuse_unrunnable(config, self.plan, mode, artifact, True)
        return config, artifact

    def _adopt_user_vision(self) -> None:
        """The user's vision model: left in the first stage for the baseline; with the flag, its
        weights moved into the encoder stage under the encoder plan and ``ImageEmbeddingsInput`` in
        its place. The first stage checks it and every rank hears the verdict, so all refuse or
        none does."""
        first = self.modules[0] if self.stage == 0 else None
        spec = user_vision_spec(self.config, first, check=self.placement.encoder_plan)
        if not self.placement.encoder_plan:
            return
        self.encoder_layer_specs = {self.config.encoders[0].name: spec}
        self._build_optimus_encoder()
        self.user_vision = take_user_vision(self.config, self.optimus, first, self.device)

    def _build_optimus_encoder(self) -> None:
        self.optimus = OptimusEncoder.build(
            self.config,
            self.plan,
            self.artifact,
            self.numbering,
            self.rank,
            self.device,
            self.encoder_layer_specs,
        )
        self.groups, self.encoder = self.optimus.groups, self.optimus.encoder

    def probe_user_vision(self, iteration: int) -> str:
        """The start-up probe (``vision_probe``) of a user's model under Optimus, on the first
        microbatch of ``iteration`` (every rank takes part): the line that says how the model's
        vision path and the encoder's compared, or ``OptimusError`` on every rank."""
        assert self.user_model is not None and self.placement.encoder_plan
        first = self.modules[0] if self.stage == 0 else None
        batch = images = forward = None
        if first is not None:
            batch = self.user_model.batch(iteration, self.numbering.global_index(0))
            images = batch[self.user_model.image_key].float().to(self.device)
            model, user = self.models[0], self.user_model

            def forward(_: Any, data: Any) -> torch.Tensor:
                return user.forward_step(data, model)[0]

        return probe_vision_path(
            self.config,
            first,
            lambda: user_vision_in_place(first, self.user_vision),
            forward,
            batch,
            images,
            self.encoder_layer_specs[self.config.encoders[0].name],
            self.device,
        )

    # ------------------------------------------------------------------------------------------

    def train_step(self, iteration: int) -> StepResult:
        schedule = None
        if self.schedules is not None:
            schedule = self.schedules.for_step(iteration)
            self._run_artifact(schedule.artifact)
        # on every rank before the step: a sample above data.max_images_per_sample fails here; in
        # the LLM's order of this step's schedule
        images_per_microbatch = self._images_per_microbatch(iteration)
        self._step_microbatches = {}
        encoder = None
        if self.optimus is not None:
            encoder = EncoderSide(
                self.optimus, iteration, self.images, self.stream, images_per_microbatch
            )
        hooked = HookedStep(
            LLMOrder(self.op_order, self.warmup, self.collectives),
            self.stage,
            self._wait_for_input,
            encoder,
        )
        driver, step = hooked.driver, hooked.optimus
        self.tconfig.timers = driver.timers(self.timers)
        for model in self.ddp_models:
            model.zero_grad_buffer()
        self.optimizer.zero_grad()
        forward = self._forward_step if self.user_model is None else self._user_forward_step
        iterators = self._data_iterators(iteration)
        outputs = hooked.run(
            get_forward_backward_func(),
            self.chunks,
            self.communicator,
            forward_step_func=partial(forward, driver, iteration, step),
            data_iterator=iterators if self.plan.vp > 1 else iterators[0],
            model=self.models if self.plan.vp > 1 else self.models[0],
            num_microbatches=self.num_microbatches,
            seq_length=self.placement.p2p_seq_length(self.config, self.plan, self.tconfig),
            micro_batch_size=self.config.training.micro_batch_size,
        )
        self._finalize_gradients()
        lr = self.optimizer.param_groups[0]["lr"]
        updated, grad_norm, _ = self.optimizer.step()
        if updated:
            self.opt_param_scheduler.step(increment=1)
        loss = mean_lm_loss(outputs) if outputs else None
        scaler = self.optimizer.loss_scaler
        return StepResult(
            loss,
            grad_norm if updated else None,
            lr,
            None if scaler is None else scaler.scale.item(),
            step.executor.record if step is not None else [],
            len(driver.unplanned),
            schedule,
            self._step_microbatches,
            step.fed_by if step is not None else {},
        )

    def _run_artifact(self, artifact: ScheduleArtifact) -> None:
        """This step under ``artifact``: the LLM's warm-up, op order and data order, the
        collectives its kernels plan, the encoder's hook plan and microbatch assignment."""
        self.numbering = MicrobatchNumbering.of_artifact(
            artifact, self.num_microbatches, self.llm_dp
        )
        self.warmup = list(artifact.warmup)
        self.op_order = artifact.llm_op_order[self.stage]
        self.collectives = planned_collectives(artifact, self.stage)
        self.optimus.run_artifact(artifact, self.numbering)

    def _iteration_workload(self, iteration: int) -> IterationWorkload:
        """This replica's encoder work in ``iteration``, in data order (the scheduler picks the
        LLM's order); every microbatch of the job checked against data.max_images_per_microbatch
        on every rank."""
        job = [EncoderWorkload.of_images(self.config, n) for n in self._job_images(iteration)]
        maximum = EncoderWorkload.of_images(self.config, max_images_per_microbatch(self.config))
        try:
            check_within(tuple(job), maximum, self.config)
        except OptimusError as exc:
            raise AgreedError(str(exc)) from None
        first = self.llm_dp * self.num_microbatches
        return tuple(job[first : first + self.num_microbatches])

    def _job_images(self, iteration: int) -> list[int]:
        """The images of every microbatch of the job in ``iteration``, by global index, counted
        on every rank so that every rank meets a bad sample alike."""
        try:
            return [
                self.image_count(iteration, g) for g in range(self.config.num_microbatches_total)
            ]
        except ConfigError as exc:
            raise AgreedError(str(exc)) from None

    def _images_per_microbatch(self, iteration: int) -> ImagesPerMicrobatch | None:
        """This replica's LLM microbatch -> its images in ``iteration``, where the count varies."""
        if self.image_count is None:
            return None
        job = self._job_images(iteration)
        counts = [job[self.numbering.global_index(i)] for i in range(self.num_microbatches)]
        return counts.__getitem__

    def _forward_step(
        self,
        driver: HookDriver,
        iteration: int,
        step: OptimusStep | None,
        data_iterator: Any,
        model: Any,
    ) -> tuple[torch.Tensor, Any]:
        """This project's model: the placement's forward of the LLM op starting now."""
        microbatch, chunk, global_microbatch, seed = self._microbatch_in_flight(driver, iteration)
        mb = _text_on(self.data(iteration, global_microbatch), self.device)

        def image_embeddings() -> torch.Tensor:
            if step is not None:
                return step.image_embeddings(microbatch)
            return self._baseline_image_embeddings(mb, seed)

        return self.placement.forward(
            ChunkInput(
                self.config, mb, model, self.modules[chunk], seed, self.device, image_embeddings
            )
        )

    def _microbatch_in_flight(
        self, driver: HookDriver, iteration: int
    ) -> tuple[int, int, int, int]:
        """(microbatch, chunk, global microbatch, seed) of the LLM op starting now; its LLM dropout
        seeded."""
        microbatch, chunk = driver.current.microbatch, driver.current.chunk
        global_microbatch = self.numbering.global_index(microbatch)
        self._step_microbatches[microbatch] = global_microbatch
        seed = microbatch_seed(self.config.training.seed, iteration, global_microbatch)
        seed_llm_dropout(seed, llm_chunk_index(chunk))
        return microbatch, chunk, global_microbatch, seed

    def _data_iterators(self, iteration: int) -> list[Any]:
        """Per virtual stage, what megatron-core's schedule hands the forward step: nothing for this
        project's model (the step reads its own source), for a user's model its batches in order."""
        if self.user_model is None:
            return [None] * self.plan.vp
        return [
            (
                self.user_model.batch(iteration, self.numbering.global_index(k))
                for k in range(self.num_microbatches)
            )
            for _ in range(self.plan.vp)
        ]

    def _user_forward_step(
        self,
        driver: HookDriver,
        iteration: int,
        step: OptimusStep | None,
        data_iterator: Any,
        model: Any,
    ) -> tuple[torch.Tensor, Any]:
        """The user's forward step; under Optimus with A_i handed to its model in its vision model's
        place."""
        microbatch, chunk, _, _ = self._microbatch_in_flight(driver, iteration)
        if self.user_vision is not None and chunk == 0:
            self.user_vision.stand_in.embeddings = step.image_embeddings(microbatch)
        return self.user_model.forward_step(data_iterator, model)

    def _baseline_image_embeddings(self, mb: Microbatch, seed: int) -> torch.Tensor:
        """A_i: [image tokens, images, hidden], from the encoders in the first stage's forward; no
        encoder work for a microbatch without images."""
        if mb.num_images == 0:
            dtype = DTYPES[self.config.training.precision]
            return torch.empty(embeddings_shape(self.config, 0), dtype=dtype, device=self.device)
        outputs = self.encoder(
            {
                e.name: to_device(image, self.device)
                for e, image in zip(self.config.encoders, mb.images)
            },
            seed,
        )
        return torch.cat([outputs[e.name] for e in self.config.encoders], dim=0)

    def _finalize_gradients(self) -> None:
        """megatron-core's gradient reductions, once every op of the step (encoder ops included)
        ran: no
        rank then waits in a collective for a peer that still has a P2P message to send it."""
        groups = None
        if self.embedding_group is not None:
            groups = ProcessGroupCollection.use_mpu_process_groups(
                ["tp", "pos_embd", "pp", "dp_cp"]
            )
            groups.embd = self.embedding_group
        finalize_model_grads(self.models, pg_collection=groups)
        if self.encoder_ddp is None:
            return
        self.encoder.reduce_sequence_parallel_grads()  # under either plan; DDP then reduces over DP
        self.encoder_ddp.finish_grad_sync()

    def gather_gradients(self) -> None:
        """After a step: every parameter's ``main_grad`` whole and reduced
        (``megatron_patches.ddp``)."""
        for model in self.ddp_models:
            gather_main_grads(model)

    def close(self) -> None:
        """Undo what this trainer set up; a job's own parallel state and patches stay."""
        if self.schedules is not None:
            self.schedules.close()
        if self._owns_parallel_state:
            parallel_state.destroy_model_parallel()
        if self._owns_patches:
            megatron_patches.remove()


def _refuse_unrunnable(
    config: OptimusConfig,
    llm_plan: ParallelPlan,
    mode: Mode,
    artifact: ScheduleArtifact | None,
    custom_layers: bool,
) -> None:
    """The plans the runtime does not train yet, refused before their groups are made."""
    refuse_untrained_tp_modes(
        llm_plan.tp_mode,
        artifact.encoder_plan.tp_mode if artifact is not None else config.parallel.encoder_tp_mode,
        config,
        mode,
        custom_layers,
    )
    if (
        artifact is not None
        and artifact.encoder_plan.tp_mode == "2d"
        and artifact.encoder_plan.pp > 1
    ):
        raise ConfigError(
            "parallel.encoder.pp",
            "a 2d encoder trains in one pipeline stage yet (stages would pass grid blocks); "
            "set pp: 1",
        )


def join_model_parallel(plan: ParallelPlan) -> bool:
    """megatron-core's ``parallel_state`` for the LLM plan: initialised here (True), or the job's
    own when
    ``initialize_megatron`` has already set it up for the same plan (False)."""
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=plan.tp,
            pipeline_model_parallel_size=plan.pp,
            virtual_pipeline_model_parallel_size=plan.vp if plan.vp > 1 else None,
        )
        return True
    have = ParallelPlan(
        parallel_state.get_data_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_world_size(),
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1,
    )
    if have != plan:
        raise OptimusError(
            f"megatron-core's parallel state is already initialised for LLM {have}, but this job's "
            f"LLM plan is {plan}; give Megatron the plan's --tensor-model-parallel-size, "
            "--pipeline-model-parallel-size and virtual stages, or re-run optimus-plan"
        )
    return False


def mean_lm_loss(outputs: list[dict[str, torch.Tensor]]) -> float:
    """The step's LM loss from the loss functions' reports: Megatron-LM's ``"lm loss"``, either a
    mean per
    microbatch or a ``[loss sum, tokens]`` pair (its per-token form)."""
    reports = torch.stack([o["lm loss"].float().reshape(-1) for o in outputs])
    if reports.shape[1] == 2:
        return float(reports[:, 0].sum() / reports[:, 1].sum())
    return float(reports.mean())


def _text_on(mb: Microbatch, device: torch.device) -> Microbatch:
    """The LLM's tensors of ``mb`` on ``device``; the images stay where the encoder takes them
    from."""
    if device.type == "cpu":
        return mb
    return replace(
        mb,
        tokens=to_device(mb.tokens, device),
        labels=to_device(mb.labels, device),
        loss_mask=to_device(mb.loss_mask, device),
        position_ids=to_device(mb.position_ids, device),
        image_mask=None if mb.image_mask is None else to_device(mb.image_mask, device),
        attention_mask=None if mb.attention_mask is None else to_device(mb.attention_mask, device),
    )
