"""Optimus inside Megatron-LM's own ``pretrain``, entered only through Megatron's seams.

``OptimusInMegatron`` gives Megatron-LM's ``pretrain`` a wrapped ``model_provider`` and wraps four
names of ``megatron.training.training`` (``megatron_patches.training_seams``):

- **the model provider**: the user's provider builds each chunk as it always does. After this
  rank's last chunk, the job's Optimus config is read from Megatron's arguments
  (``config_from_megatron_args``), then its encoder and projector from the user's built vision
  model and projector (``with_user_model``, as the project's trainer reads it), the schedule is
  made (``auto``) or loaded (a saved artifact), the encoder stage is built under the schedule's
  encoder plan on every rank from the user's own vision weights, and the first stage's
  ``vision_model`` / ``vision_projection`` give way to ``ImageEmbeddingsInput`` / identity
  (``optimus_encoder``), before Megatron wraps the chunks in its DDP. The user's modules are kept
  for evaluation and checkpoints.
- **``get_megatron_optimizer``**: Megatron's optimizer over its chunks, chained with one over the
  encoder stage under megatron-core's DDP with the encoder plan's groups; one gradient norm and one
  loss scale span both (``runtime.optimizer.OneLossScaleOptimizer``).
- **``get_forward_backward_func``**: a training step reads the step's images from the data
  iterator megatron-core's schedule will read (the same batches, replayed to the user's
  ``forward_step``), broadcasts them over the LLM's TP group as Megatron's ``get_batch`` does, and
  runs megatron-core's schedule with the encoder ops at the hook points, the artifact's warm-up and
  LLM P2P, and megatron-core's gradient finalisation once every encoder op ran. A forward-only
  call (evaluation) runs the user's model as built, with the encoder's current weights.
- **``save_checkpoint`` / ``load_checkpoint``**: around Megatron's own, the user's vision modules
  stand in the model again, holding the encoder's weights, so a checkpoint has LLaVA's keys; and
  Megatron saves and loads the optimizer state through its own optimizer over those chunks, built
  for the save or load and filled from (or into) the chained one (``runtime.plain_optimizer``), so
  a checkpoint is laid out as one saved without the flag and resumes either way. The distributed
  optimizer's state (``--ckpt-format torch``: each rank's ``distrib_optim.pt``) goes the same way
  through the run without the flag's distributed optimizer, built over stand-ins of the chunks'
  parameters (``runtime.plain_distributed_optimizer``); other formats of it are refused at
  start-up (``refuse_distributed_optimizer_checkpoints``). Checkpoints that earlier versions saved
  in the chained layout are marked ``OPTIMIZER_MARK``.

Image counts. The schedule is planned for the most images a microbatch holds: what the job's flags
state (``optimus_mllm.megatron.flags.images_bound``: tiles, thumbnail and frames times the micro
batch), else the saved schedule's ``data.max_images_per_microbatch``, else one image a sample. Each
step every microbatch runs the images its batch holds, 0 up to that maximum, under the one static
schedule: a microbatch without images has no encoder op and no message, and the user's forward gets
that microbatch's image tokens where it calls ``vision_model`` (it does not call it without images,
as LLaVA does not). The counts of every microbatch of the job are agreed by every rank before the
step (one all-reduce), so that a microbatch above the maximum is the same one-line refusal on every
rank instead of a hang.

Without ``--optimus-schedule`` none of this is installed (``optimus_mllm.megatron.lm.pretrain``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel
from megatron.core.num_microbatches_calculator import get_num_microbatches
from megatron.core.optimizer import MegatronOptimizer
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.utils import get_model_config
from torch import nn

from megatron_patches.ddp import average_over
from megatron_patches.p2p import ChannelP2PCommunicator
from optimus_mllm.config import EncoderConfig, OptimusConfig
from optimus_mllm.costing.workload import max_images_per_microbatch
from optimus_mllm.errors import OptimusError
from optimus_mllm.megatron.flags import (
    ImagesBound,
    bound_line,
    bound_source,
    config_from_megatron_args,
    flag_schedule,
    images_bound,
    with_schedule_bound,
)
from optimus_mllm.planner import plan
from optimus_mllm.planner.plans import ParallelPlan
from optimus_mllm.runtime.batch_images import find_image_key
from optimus_mllm.runtime.communicators import (
    create_communicators,
    encoder_uses,
    llm_uses,
    pipeline_channel_uses,
)
from optimus_mllm.runtime.data import patchify
from optimus_mllm.runtime.dtypes import DTYPES
from optimus_mllm.runtime.hook_plan import POST, PRE, planned_collectives
from optimus_mllm.runtime.hooked_step import EncoderSide, HookedStep, LLMOrder
from optimus_mllm.runtime.llm import llm_pipelines, transformer_config
from optimus_mllm.runtime.microbatches import MicrobatchNumbering
from optimus_mllm.runtime.optimizer import chain_encoder_optimizer, encoder_process_groups
from optimus_mllm.runtime.optimus_encoder import (
    OptimusEncoder,
    UserVision,
    input_waiter,
    optimus_communicator,
    take_user_vision,
    user_vision_in_place,
    user_vision_spec,
    with_user_model,
)
from optimus_mllm.runtime.plain_distributed_optimizer import (
    CheckpointOptimizer,
    chained_into_plain_distributed,
    plain_distributed_into_chained,
    plain_distributed_optimizer,
)
from optimus_mllm.runtime.plain_optimizer import (
    chained_into_plain,
    plain_into_chained,
    plain_optimizer,
)
from optimus_mllm.runtime.sharded_state import copy_sharded_state, encoder_sharded_state_dict
from optimus_mllm.runtime.streams import EncoderStream, make_encoder_stream, training_device
from optimus_mllm.runtime.trainer import join_model_parallel
from optimus_mllm.runtime.user_model import (
    config_problem,
    language_model,
    vision_sharded_state_dict,
)
from optimus_mllm.runtime.vision_probe import probe_vision_path
from optimus_mllm.scheduler.artifact_format import ScheduleArtifact

# in a checkpoint folder that an earlier version saved with the flag and the distributed optimizer:
# its optimizer state is the chained optimizer's, which this version does not resume
OPTIMIZER_MARK = "optimus_optimizer_layout"


@dataclass
class _Job:
    """What the flag built on this rank, once its chunks exist."""

    config: OptimusConfig
    llm_plan: ParallelPlan
    artifact: ScheduleArtifact
    optimus: OptimusEncoder
    stream: EncoderStream
    stage: int
    collectives: dict[int, list[str]]
    communicator: ChannelP2PCommunicator | None
    first_chunk: nn.Module | None  # the first pipeline stage's first chunk, built by the user
    user_vision: UserVision | None  # its vision modules, set aside
    vision_spec: ModuleSpec  # the layer spec of the user's vision layers
    bound: ImagesBound  # the most images a microbatch holds, as the job's flags state it
    encoder_ddp: DistributedDataParallel | None = None
    # Megatron's own optimizer over the chunks, built anew on each call (checkpoints)
    plain_optimizer: Callable[[], MegatronOptimizer] | None = None


class OptimusInMegatron:
    """``--optimus-schedule SCHEDULE`` (``auto`` or an artifact's path) for one Megatron-LM job."""

    def __init__(self, schedule: str, get_args: Callable[[], argparse.Namespace]):
        """``get_args``: Megatron's parsed arguments once it parsed them (``megatron.training``'s
        ``get_args``)."""
        self.schedule, self.get_args = schedule, get_args
        self.chunks: list[nn.Module] = []
        self.job: _Job | None = None
        self.steps = 0
        self.image_key: str | None = None  # the batch entry the user's forward gives vision_model
        self.probed = False  # the start-up probe runs at the first step with images on every rank

    def model_provider(self, provider: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
        """The user's provider, followed on this rank's last chunk by the Optimus set-up."""

        def provide(*args: Any, **kwargs: Any) -> nn.Module:
            chunk = provider(*args, **kwargs)
            self.chunks.append(chunk)
            if len(self.chunks) == (
                parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1
            ):
                self.job = self._start()
            return chunk

        return provide

    def seams(self) -> dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]]:
        """The wrappers of ``megatron_patches.training_seams``."""
        return {
            "get_megatron_optimizer": self._optimizer,
            "get_forward_backward_func": self._forward_backward,
            "save_checkpoint": self._save_checkpoint,
            "load_checkpoint": self._load_checkpoint,
        }

    # -- start-up ---------------------------------------------------------------------------------

    def _start(self) -> _Job | None:
        args = self.get_args()
        refuse_distributed_optimizer_checkpoints(args)
        world_size = dist.get_world_size()
        config = config_from_megatron_args(
            args, world_size, int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        )
        stage = parallel_state.get_pipeline_model_parallel_rank()
        first = self.chunks[0] if stage == 0 else None
        flags_encoder = config.encoders[0]
        # the vision model and projector the user built, not the ones pretrain_vlm.py would build
        # from the flags (examples/multimodal builds its vision model from --vision-model-type)
        config = with_user_model(config, first)
        _say(vision_line(flags_encoder, config.encoders[0]))
        bound = images_bound(args)
        config = with_schedule_bound(config, self.schedule)
        planned = plan(config)
        llm_plan = planned.llm_plan
        join_model_parallel(llm_plan)  # refuses a Megatron parallel state of another plan
        problem = config_problem(
            "language model",
            "model.llm (from the Megatron-LM flags)",
            transformer_config(config, llm_plan),
            language_model(self.chunks[0]).config,
        )
        if problem:
            raise OptimusError(problem)
        artifact, said = flag_schedule(self.schedule, config, planned)
        _say(said)
        if artifact is None:
            return None
        _say(bound_line(config, bound))
        _say(dropout_line(config))
        rank = dist.get_rank()
        device = training_device()
        numbering = MicrobatchNumbering.of_artifact(
            artifact, get_num_microbatches(), parallel_state.get_data_parallel_rank()
        )
        spec = user_vision_spec(config, first, check=True)
        optimus = OptimusEncoder.build(
            config, llm_plan, artifact, numbering, rank, device, {config.encoders[0].name: spec}
        )
        optimus.encoder.to(device, DTYPES[config.training.precision])
        user_vision = take_user_vision(config, optimus, first, device)
        communicator = optimus_communicator(get_model_config(self.chunks[0]), llm_plan, rank)
        uses = llm_uses()
        if communicator is not None:
            uses += pipeline_channel_uses(llm_pipelines(), rank, communicator.channels)
        create_communicators([*uses, *encoder_uses(optimus.groups)], rank, device)
        return _Job(
            config,
            llm_plan,
            artifact,
            optimus,
            make_encoder_stream(device),
            stage,
            planned_collectives(artifact, stage),
            communicator,
            first,
            user_vision,
            spec,
            bound,
        )

    # -- the optimizer ----------------------------------------------------------------------------

    def _optimizer(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def get_megatron_optimizer(config: Any, model_chunks: list[Any], *args: Any, **kwargs: Any):
            llm = original(config, model_chunks, *args, **kwargs)
            job = self.job
            if job is None:
                return llm
            groups = encoder_process_groups(job.optimus.groups)
            # built on the encoder's stream: its gradient accumulation runs there (trainer)
            with job.stream.launch():
                job.encoder_ddp = DistributedDataParallel(
                    get_model_config(model_chunks[0]),
                    model_chunks[0].ddp_config,
                    job.optimus.encoder,
                    pg_collection=groups,
                )
                average_over(job.encoder_ddp, parallel_state.get_data_parallel_world_size())
            job.stream.finish()

            def over(chunks: list[Any]) -> MegatronOptimizer:
                return original(config, chunks, *args, **kwargs)

            distributed = self.get_args().use_distributed_optimizer
            job.plain_optimizer = partial(
                plain_distributed_optimizer if distributed else plain_optimizer,
                over,
                model_chunks,
            )
            return chain_encoder_optimizer(
                llm,
                job.encoder_ddp,
                config,
                groups,
                job.optimus.groups.dp_group_gloo,
                build=original,
                config_overrides=kwargs.get("config_overrides"),
            )

        return get_megatron_optimizer

    # -- a step -----------------------------------------------------------------------------------

    def _forward_backward(self, original: Callable[[], Callable[..., Any]]) -> Callable[[], Any]:
        def get_forward_backward_func() -> Callable[..., Any]:
            schedule = original()
            return schedule if self.job is None else partial(self._step, self.job, schedule)

        return get_forward_backward_func

    def _step(
        self,
        job: _Job,
        schedule: Callable[..., Any],
        *,
        forward_step_func: Callable[..., Any],
        data_iterator: Any,
        model: list[Any],
        num_microbatches: int,
        forward_only: bool = False,
        **kwargs: Any,
    ) -> Any:
        if forward_only:  # evaluation: the model as the user built it, with the encoder's weights
            with self._user_vision_restored(job):
                return schedule(
                    forward_step_func=forward_step_func,
                    data_iterator=data_iterator,
                    model=model,
                    num_microbatches=num_microbatches,
                    forward_only=True,
                    **kwargs,
                )
        data_iterator, batches = _read_ahead(job, data_iterator, num_microbatches)
        if self.image_key is None:  # before the first step computes anything
            self.image_key = find_image_key(
                job.first_chunk,
                lambda: user_vision_in_place(job.first_chunk, job.user_vision),
                None
                if job.first_chunk is None
                else partial(_forward_on, forward_step_func, model[0]),
                batches,
            )
        images, per_microbatch, everywhere = self._step_images(
            job, batches, self.image_key, num_microbatches
        )
        counts = [len(x) for x in per_microbatch]
        # the probe needs a microbatch with images on every data-parallel rank (it is collective)
        if not self.probed and all(any(replica) for replica in everywhere):
            with_images = next(i for i, n in enumerate(counts) if n)
            _say(
                self._probe(
                    job,
                    forward_step_func,
                    model[0],
                    batches[with_images],
                    per_microbatch[with_images],
                )
            )
            self.probed = True
        hooked = HookedStep(
            LLMOrder(job.artifact.llm_op_order[job.stage], job.artifact.warmup, job.collectives),
            job.stage,
            input_waiter(job.communicator, job.stage, job.llm_plan),
            EncoderSide(
                job.optimus,
                self.get_args().curr_iteration,
                images,
                job.stream,
                counts.__getitem__,
            ),
        )
        driver, step = hooked.driver, hooked.optimus

        def forward_step(data: Any, chunk_model: Any, *rest: Any) -> Any:
            if job.user_vision is not None and driver.current.chunk == 0:
                job.user_vision.stand_in.embeddings = step.image_embeddings(
                    driver.current.microbatch
                )
            return forward_step_func(data, chunk_model, *rest)

        config = get_model_config(model[0])
        timers, finalize = config.timers, config.finalize_model_grads_func
        deferred: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        config.timers = driver.timers(timers)
        # megatron-core reduces the gradients at the schedule's end; under Optimus, once every
        # encoder op (some run at ``post``) ran, so no rank waits in a collective for a peer that
        # still has a message to send it
        config.finalize_model_grads_func = lambda *a, **k: deferred.append((a, k))
        assert job.encoder_ddp is not None, "the optimizer seam builds the encoder's DDP"
        job.encoder_ddp.zero_grad_buffer()
        try:
            outputs = hooked.run(
                schedule,
                [language_model(m) for m in _unwrapped(model)],
                job.communicator,
                forward_step_func=forward_step,
                data_iterator=data_iterator,
                model=model,
                num_microbatches=num_microbatches,
                **kwargs,
            )
        finally:
            config.timers, config.finalize_model_grads_func = timers, finalize
        for args, kw in deferred:
            finalize(*args, **kw)
        job.optimus.encoder.reduce_sequence_parallel_grads()
        job.encoder_ddp.finish_grad_sync()
        self.steps += 1
        if self.steps == 1:
            record = step.executor.record
            counts = torch.tensor(
                [
                    len(record),
                    sum(op.ran_at not in (PRE, POST) for op in record),
                    sum(op.moved for op in record),
                ],
                device=job.stream.device,
            )
            dist.all_reduce(counts)
            ran, inside, moved = counts.tolist()
            _say(
                f"optimus: first step: {inside} of the {ran} encoder ops ran inside LLM ops, "
                f"{moved} moved from their hook (all ranks)"
            )
        return outputs

    def _probe(
        self, job: _Job, forward_step_func: Callable[..., Any], chunk: Any, batch: Any, images: Any
    ) -> str:
        first = job.first_chunk
        return probe_vision_path(
            job.config,
            first,
            lambda: user_vision_in_place(job.first_chunk, job.user_vision),
            None if first is None else lambda _, data: _forward_on(forward_step_func, chunk, data),
            batch,
            images,
            job.vision_spec,
            job.stream.device,
        )

    def _step_images(
        self, job: _Job, batches: list[Any], key: str, num_microbatches: int
    ) -> tuple[Callable[[int, int], tuple[torch.Tensor, ...]], list[torch.Tensor], list[list[int]]]:
        """The images of the step's batches (``batches[i][key]``, on TP rank 0) on every rank of
        this LLM stage's TP group: the encoder's image source over them, each microbatch's images
        ([n_i, channels, height, width], n_i from 0), and every data-parallel rank's counts.

        Raises:
            OptimusError: on every rank, where a microbatch of any data-parallel rank holds more
                images than the schedule was planned for.
        """
        per_microbatch = _broadcast_over_tp(
            None if batches[0] is None else [batch[key] for batch in batches],
            num_microbatches,
            job.stream.device,
        )
        everywhere = _counts_everywhere([len(x) for x in per_microbatch], job.stream.device)
        most = max_images_per_microbatch(job.config)
        for replica, counts in enumerate(everywhere):
            for i, count in enumerate(counts):
                if count > most:
                    raise OptimusError(
                        f"iteration {self.get_args().curr_iteration}, microbatch {i} of "
                        f"data-parallel rank {replica}: the batch holds {count} images under "
                        f"'{key}', above the {most} --optimus-schedule planned for "
                        f"({bound_source(job.config, job.bound)}); plan for more (a schedule "
                        "made by optimus-plan for a config with a larger "
                        "data.max_images_per_microbatch) or train this data without the flag"
                    )
        numbering = job.optimus.numbering
        patch = job.config.encoders[0].patch_size
        by_global = {numbering.global_index(i): x for i, x in enumerate(per_microbatch)}

        def source(iteration: int, global_microbatch: int) -> tuple[torch.Tensor, ...]:
            return (patchify(by_global[global_microbatch], patch),)

        return source, per_microbatch, everywhere

    # -- evaluation and checkpoints ---------------------------------------------------------------

    @contextlib.contextmanager
    def _user_vision_restored(self, job: _Job) -> Iterator[None]:
        """The user's vision modules in the model again, holding the encoder's weights (every rank
        takes part in the copy)."""
        with user_vision_in_place(job.first_chunk, job.user_vision):
            first = job.first_chunk
            copy_sharded_state(
                encoder_sharded_state_dict(
                    job.config, job.optimus.encoder, job.optimus.groups.dp_group
                ),
                {} if first is None else vision_sharded_state_dict(first),
                "the Optimus encoder -> the model's vision model",
            )
            yield

    def _vision_states(self, job: _Job) -> tuple[Callable[[], Any], Callable[[], Any]]:
        """The encoder stage's and the user's vision modules' sharded state dicts, built anew on
        each call (the vision modules in place)."""
        first = job.first_chunk
        return (
            lambda: encoder_sharded_state_dict(
                job.config, job.optimus.encoder, job.optimus.groups.dp_group
            ),
            lambda: {} if first is None else vision_sharded_state_dict(first),
        )

    def _save_checkpoint(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def save_checkpoint(
            iteration: int, model: Any, optimizer: Any, *rest: Any, **kwargs: Any
        ) -> Any:
            job = self.job
            if job is None:
                return original(iteration, model, optimizer, *rest, **kwargs)
            args = self.get_args()
            _encoder_params_gathered(job)
            with self._user_vision_restored(job):
                if optimizer is None or args.no_save_optim:
                    return original(iteration, model, optimizer, *rest, **kwargs)
                assert job.plain_optimizer is not None, "the optimizer seam sets it"
                plain = job.plain_optimizer()
                into_plain = (
                    chained_into_plain_distributed
                    if args.use_distributed_optimizer
                    else chained_into_plain
                )
                into_plain(optimizer, plain, *self._vision_states(job))
                return original(iteration, model, plain, *rest, **kwargs)

        return save_checkpoint

    def _load_checkpoint(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def load_checkpoint(model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            job = self.job
            if job is None:
                return original(model, optimizer, *args, **kwargs)
            _check_optimizer_layout(self.get_args(), kwargs.get("load_arg", "load"))
            encoder, vision = self._vision_states(job)
            with self._user_vision_restored(job):
                plain = None
                if optimizer is not None:
                    assert job.plain_optimizer is not None, "the optimizer seam sets it"
                    plain = job.plain_optimizer()
                loaded = original(model, optimizer if plain is None else plain, *args, **kwargs)
                copy_sharded_state(
                    vision(), encoder(), "the checkpoint's vision model -> the Optimus encoder"
                )
                if not isinstance(plain, CheckpointOptimizer):
                    if plain is not None:
                        # also where nothing was loaded: the plain optimizer's main parameters
                        # are then the weights just loaded (Megatron's reload_model_params)
                        plain_into_chained(plain, optimizer, vision, encoder)
                elif plain.loaded:
                    plain_distributed_into_chained(plain, optimizer, vision, encoder)
                else:
                    # no state loaded (--no-load-optim, --finetune, nothing saved yet): the main
                    # parameters (--bf16/--fp16) start from the weights, the encoder's just copied
                    optimizer.reload_model_params()
            return loaded

        return load_checkpoint


def _iteration_folder(checkpoints: str, iteration: str) -> Path:
    """Megatron-LM's folder of one checkpoint (``iter_0000002``, or ``release``)."""
    name = "release" if iteration == "release" else f"iter_{int(iteration):07d}"
    return Path(checkpoints, name)


def refuse_distributed_optimizer_checkpoints(args: argparse.Namespace) -> None:
    """Refuse, before the first step, a distributed optimizer's state that the flag would save or
    resume in a format other than ``--ckpt-format torch``: it writes and reads Megatron-LM's
    ``distrib_optim.pt`` through the run without the flag's optimizer over stand-ins of the chunks'
    parameters, which the other formats (sharded by the model's own parameters) cannot name.
    Non-persistent checkpoints are always of another format. The weights alone save and load
    either way (--no-save-optim, --no-load-optim)."""
    if not args.use_distributed_optimizer:
        return
    saves = not args.no_save_optim and (
        getattr(args, "save", None) or getattr(args, "non_persistent_save_interval", None)
    )
    loads = not args.no_load_optim and getattr(args, "load", None)
    ckpt_format = getattr(args, "ckpt_format", "torch")
    if getattr(args, "non_persistent_save_interval", None) and saves:
        ckpt_format = getattr(args, "non_persistent_ckpt_type", None) or "non-persistent"
    if (saves or loads) and ckpt_format != "torch":
        raise OptimusError(
            f"--optimus-schedule with --use-distributed-optimizer and --ckpt-format {ckpt_format}: "
            "the flag saves and resumes the distributed optimizer's state in Megatron-LM's "
            "--ckpt-format torch layout only; use --ckpt-format torch (no "
            "--non-persistent-save-interval), or add --no-save-optim / --no-load-optim to save "
            "and load the weights alone"
        )


def _check_optimizer_layout(args: argparse.Namespace, load_arg: str) -> None:
    """Refuse an optimizer state this job cannot resume: the chained layout that earlier versions
    saved (``OPTIMIZER_MARK``), and with the distributed optimizer a checkpoint missing a rank's
    ``distrib_optim.pt`` (saved with --no-save-optim, or a save that did not finish); the weights
    load with --no-load-optim."""
    load = getattr(args, load_arg, None)
    if not load or args.no_load_optim or getattr(args, "finetune", False):
        return
    tracker = Path(load, "latest_checkpointed_iteration.txt")  # Megatron-LM's tracker file
    step = getattr(args, "ckpt_step", None)
    if step is None and not tracker.is_file():
        return  # nothing to resume: Megatron-LM starts afresh
    iteration = str(step) if step is not None else tracker.read_text().strip()
    folder = _iteration_folder(load, iteration)
    if not folder.is_dir():
        return
    flag = f"--{load_arg.replace('_', '-')} {load}: the checkpoint at {folder.name}"
    if folder.joinpath(OPTIMIZER_MARK).is_file():
        raise OptimusError(
            f"{flag} was saved by an earlier version with --optimus-schedule and "
            "--use-distributed-optimizer, in a layout of its own that this version does not "
            "resume; add --no-load-optim to start the optimizer afresh from its weights"
        )
    if not args.use_distributed_optimizer:
        return
    # Megatron-LM's torch format: each model-parallel rank's folder holds model_optim_rng.pt and,
    # with the optimizer's state, distrib_optim.pt
    for model_file in sorted(folder.glob("mp_rank_*/model_optim_rng.pt")):
        state_file = model_file.with_name("distrib_optim.pt")
        if not state_file.is_file():
            raise OptimusError(
                f"{flag} has no distributed optimizer's state {state_file} (saved with "
                "--no-save-optim, or its save did not finish); add --no-load-optim to start the "
                "optimizer afresh from its weights, or resume from another checkpoint (--ckpt-step)"
            )


def _encoder_params_gathered(job: _Job) -> None:
    """The encoder stage's weights all-gathered from its distributed optimizer's update now, as
    Megatron-LM gathers the chunks' before it saves: under --overlap-param-gather they are gathered
    only at the next forward."""
    ddp = job.encoder_ddp
    if ddp is not None and ddp.use_forward_hook:
        ddp.start_param_sync(force_sync=True)


def _read_ahead(job: _Job, data_iterator: Any, num_microbatches: int) -> tuple[Any, list[Any]]:
    """The step's batches read ahead from the first chunk's data iterator, and the iterator(s)
    that replay them to megatron-core's schedule (Nones where this rank reads no data)."""
    iterators = data_iterator if isinstance(data_iterator, list) else [data_iterator]
    if iterators[0] is None:
        if parallel_state.get_tensor_model_parallel_rank() == 0:
            raise OptimusError(
                f"pipeline stage {job.stage} has no data iterator, but the Optimus encoder needs "
                "the images there; give every pipeline stage the data, as pretrain_vlm.py does"
            )
        return data_iterator, [None] * num_microbatches
    batches = [next(iterators[0]) for _ in range(num_microbatches)]
    replayed = [iter(batches), *iterators[1:]]
    return (replayed if isinstance(data_iterator, list) else replayed[0]), batches


def _forward_on(
    forward_step_func: Callable[..., Any], chunk: Any, data: Iterator[Any]
) -> torch.Tensor:
    """The user's forward step of one microbatch on ``chunk``: its output tensor."""
    return forward_step_func(data, chunk)[0]


def _broadcast_over_tp(
    images: list[torch.Tensor] | None, num_microbatches: int, device: torch.device
) -> list[torch.Tensor]:
    """Each microbatch's images ([n_i, channels, height, width]) of the LLM's TP rank 0 on every
    rank of its TP group, as Megatron's ``get_batch`` hands its ranks the batch; the counts n_i
    travel with the shape, so that every rank splits them alike. An entry that is not 4-D holds no
    image (a text-only microbatch: an empty tensor, or examples/multimodal's [1, 1] placeholder)."""
    group = parallel_state.get_tensor_model_parallel_group()
    if images is not None:
        images = _as_image_batches(images)
    if group.size() == 1:
        assert images is not None
        return [x.float().to(device) for x in images]
    src = parallel_state.get_tensor_model_parallel_src_rank()
    header = [0] * (3 + num_microbatches)  # channels, height, width, then n_i
    if images is not None:
        header = [*images[0].shape[1:], *(x.shape[0] for x in images)]
    shape = torch.tensor(header, dtype=torch.long, device=device)
    dist.broadcast(shape, src, group)
    channels, height, width, *counts = shape.tolist()
    out = (
        torch.cat(images).float().to(device)
        if images is not None
        else torch.empty(sum(counts), channels, height, width, dtype=torch.float32, device=device)
    )
    dist.broadcast(out, src, group)
    return list(out.split(counts))


def _as_image_batches(images: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each microbatch's entry as [n_i, channels, height, width], the microbatches without an
    image as n_i = 0 of the others' image shape."""
    shaped = [x for x in images if x.dim() == 4 and x.shape[0] > 0]
    image_shape = tuple(shaped[0].shape[1:]) if shaped else (0, 0, 0)
    return [
        x if x.dim() == 4 and x.shape[0] > 0 else x.new_zeros((0, *image_shape)) for x in images
    ]


def _counts_everywhere(counts: list[int], device: torch.device) -> list[list[int]]:
    """Every data-parallel rank's images per microbatch (``counts`` is this rank's), on every rank
    (one all-reduce over the world: the ranks of one data-parallel rank count alike)."""
    dp = parallel_state.get_data_parallel_world_size()
    every = torch.zeros(dp, len(counts), dtype=torch.long, device=device)
    every[parallel_state.get_data_parallel_rank()] = torch.tensor(counts, dtype=torch.long)
    dist.all_reduce(every, op=dist.ReduceOp.MAX)
    return every.tolist()


def _unwrapped(model: list[Any]) -> list[nn.Module]:
    """The user's chunks inside Megatron's DDP and Float16Module wrappers."""
    chunks = []
    for chunk in model:
        while hasattr(chunk, "module"):
            chunk = chunk.module
        chunks.append(chunk)
    return chunks


def dropout_line(config: OptimusConfig) -> str:
    """What the flag does to the job's dropout, in one line (empty without dropout).

    The encoder draws its masks from generators seeded per (iteration, microbatch, layer)
    (``runtime.dropout``), because it runs a microbatch's layers on other ranks and at other times
    than the first stage would. Megatron-LM's own run draws the vision model's masks from the first
    stage's generators between the LLM's; matching them draw for draw would mean replaying those
    generators ahead of the schedule on every rank. So with dropout the flagged job trains with
    other masks than the job without it (the same distribution), and says so."""
    encoder = config.encoders[0]
    if encoder.hidden_dropout == 0 and encoder.attention_dropout == 0:
        return ""
    return (
        f"optimus: with dropout (hidden {encoder.hidden_dropout:g}, attention "
        f"{encoder.attention_dropout:g}) this job draws other masks than without the flag (the "
        "vision model's come from the Optimus encoder's generators, seeded by iteration, "
        "microbatch and layer): its losses match a run without the flag only with "
        "--hidden-dropout 0 --attention-dropout 0"
    )


def _say(line: str) -> None:
    if line and dist.get_rank() == 0:
        print(line, flush=True)


def vision_line(flags: EncoderConfig, built: EncoderConfig) -> str:
    """The start-up line saying that the encoder is the vision model the provider built, where it
    differs from the one the flags describe (empty where it does not)."""
    differ = [
        f"{f.name} {getattr(built, f.name)} (flags: {getattr(flags, f.name)})"
        for f in fields(EncoderConfig)
        if f.name != "projector" and getattr(built, f.name) != getattr(flags, f.name)
    ]
    if not differ:
        return ""
    return (
        "optimus: the encoder is read from the vision model the provider built, not from the "
        f"Megatron-LM flags (read as pretrain_vlm.py builds it): {', '.join(differ)}"
    )
