"""A stand-in of the Megatron-LM calls that ``optimus_mllm.megatron.seams`` wraps, for tests that
run without a Megatron-LM checkout.

``standin_pretrain`` does what ``megatron.training.pretrain`` does with a user's script, in the
order it does it, through megatron-core's public API: its ``get_model`` (the provider per virtual
stage, ``model_type``, megatron-core's DDP), ``get_megatron_optimizer``, its ``train_step`` (grad
buffers zeroed, ``get_forward_backward_func()(...)`` with its keyword arguments,
``optimizer.step()``), its ``evaluate`` (a forward-only call under ``torch.no_grad``), with
``config.finalize_model_grads_func`` and ``config.timers`` set as its ``train`` sets them, and its
torch-format ``save_checkpoint`` / ``load_checkpoint`` (each rank's chunks'
``state_dict_for_save_checkpoint`` and ``optimizer.state_dict()``, and with the distributed
optimizer its ``save_parameter_state`` / ``load_parameter_state`` file, serialised). With a
schedule, the calls go through ``OptimusInMegatron``'s seams exactly as
``megatron_patches.training_seams`` installs them. The user's script is
``scripts/pretrain_vlm_megatron.py`` (its provider, forward step and mock data), its flags parsed by
``optimus_mllm.megatron.arguments`` and read back through its ``get_args``.
"""

from __future__ import annotations

import io
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, fields
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.enums import ModelType
from megatron.core.num_microbatches_calculator import (
    destroy_num_microbatches_calculator,
    init_num_microbatches_calculator,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.timers import Timers
from megatron.core.transformer.module import Float16Module
from megatron.core.utils import get_model_config

import megatron_patches
from megatron_patches.optimizer import dp_zero_load_patches
from optimus_mllm.megatron import arguments as megatron_arguments
from optimus_mllm.megatron.seams import OptimusInMegatron
from optimus_mllm.runtime.user_model import pretraining_sampler_batches

from .paths import load_script

script = load_script("pretrain_vlm_megatron")


_CHECKPOINT_ARGS = {
    "save": None,
    "load": None,
    "no_save_optim": False,
    "no_load_optim": False,
    "finetune": False,
}


@dataclass(frozen=True)
class StandinRun:
    losses: list[float | None]  # per iteration, on the last pipeline stage
    grad_norms: list[float]
    validation_loss: float | None  # one forward-only pass after training, last stage
    saved: bytes | None = None  # this rank's checkpoint, where one was saved


def standin_pretrain(
    argv: list[str],
    schedule: str | None,
    model_class: type | None = None,
    renamed: dict[str, str] | None = None,
    forward_step: Callable[..., Any] | None = None,
    edit: Callable[[Any], None] | None = None,
    edit_batch: Callable[[int, int, dict[str, Any]], dict[str, Any]] | None = None,
    load: bytes | None = None,
    save_at: int | None = None,
    script_args: dict[str, Any] | None = None,
) -> StandinRun:
    """Train ``--train-iters`` iterations of the script under the flags ``argv`` on the world's
    ranks; with ``schedule``, as ``--optimus-schedule schedule`` would. ``model_class``: a subclass
    of the script's model that the provider's models become (a user's own forward). ``renamed``:
    batch keys the data iterator gives under other names. ``forward_step``: the user's, in place of
    the script's. ``edit``: called on each model the provider built, before it is returned (a
    user's own provider, e.g. another projector). ``edit_batch``: ``(iteration, global microbatch,
    batch) -> batch`` on every batch the data iterator gives (a user's data unlike the script's).
    ``load``: a checkpoint of this rank (``StandinRun.saved``) to resume from; ``save_at``: save one
    after that many iterations. ``script_args``: arguments the script's own ``extra_args_provider``
    adds to Megatron's, by name (e.g. examples/multimodal's ``max_num_tiles``)."""
    args = megatron_arguments.validate_args(
        megatron_arguments.parse_args(None, argv), dist.get_world_size()
    )
    # Megatron-LM's checkpoint flags, which the project's parser does not read: no folders (the
    # stand-in's checkpoints are bytes), the optimizer saved and loaded
    for name, value in _CHECKPOINT_ARGS.items():
        vars(args).setdefault(name, value)
    vars(args).update(script_args or {})
    megatron_arguments.set_args(args)
    megatron_patches.apply()
    # the fix of the distributed optimizer's torch-format load that Megatron-LM's CPU route installs
    dp_zero_load = dp_zero_load_patches()
    replaced = [getattr(patch.owner, patch.name) for patch in dp_zero_load]
    for patch in dp_zero_load:
        setattr(patch.owner, patch.name, patch.replacement)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
    )
    dp = parallel_state.get_data_parallel_world_size()
    init_num_microbatches_calculator(
        dist.get_rank(), None, args.global_batch_size, args.micro_batch_size, dp
    )
    torch.manual_seed(args.seed)
    model_parallel_cuda_manual_seed(args.seed)
    optimus = None if schedule is None else OptimusInMegatron(schedule, megatron_arguments.get_args)
    seams = {} if optimus is None else optimus.seams()
    try:
        provider = script.model_provider
        if model_class is not None:
            provider = partial(_as_class, provider, model_class)
        if edit is not None:
            provider = partial(_edited, provider, edit)
        model = _get_model(provider if optimus is None else optimus.model_provider(provider), args)
        build_optimizer = seams.get("get_megatron_optimizer", lambda f: f)(get_megatron_optimizer)
        optimizer = build_optimizer(_optimizer_config(args), model)
        config = get_model_config(model[0])
        config.finalize_model_grads_func = finalize_model_grads
        config.timers = Timers(0, "minmax")
        config.grad_scale_func = optimizer.scale_loss
        start = 0
        if load is not None:
            load_checkpoint = partial(_load_checkpoint, saved=load)
            start = seams.get("load_checkpoint", lambda f: f)(load_checkpoint)(
                model, optimizer, None
            )
        schedule_func = seams.get("get_forward_backward_func", lambda f: f)(
            get_forward_backward_func
        )()
        train_ds, _, _ = script.train_valid_test_datasets_provider(
            [(args.train_iters + 1) * args.global_batch_size, 0, 0]
        )
        batches = pretraining_sampler_batches(
            train_ds, args.micro_batch_size, dp, args.global_batch_size
        )
        if renamed:
            batches = partial(_renamed, batches, renamed)
        if edit_batch is not None:
            batches = partial(_batch_edited, batches, edit_batch)
        num_microbatches = args.global_batch_size // (args.micro_batch_size * dp)
        step = {} if forward_step is None else {"forward_step_func": forward_step}
        losses, norms, saved = [], [], None
        for iteration in range(start, args.train_iters):
            args.curr_iteration = iteration
            for chunk in model:
                chunk.zero_grad_buffer()
            optimizer.zero_grad()
            reports = schedule_func(
                **{
                    **_schedule_kwargs(
                        args, model, batches, iteration, num_microbatches, dp, forward_only=False
                    ),
                    **step,
                }
            )
            _, grad_norm, _ = optimizer.step()
            losses.append(_mean_loss(reports))
            norms.append(grad_norm)
            if iteration + 1 == save_at:
                saved = seams.get("save_checkpoint", lambda f: f)(_save_checkpoint)(
                    save_at, model, optimizer, None, 0
                )
        evaluate = seams.get("get_forward_backward_func", lambda f: f)(get_forward_backward_func)()
        for chunk in model:
            chunk.eval()
        with torch.no_grad():
            reports = evaluate(
                **{
                    **_schedule_kwargs(
                        args,
                        model,
                        batches,
                        args.train_iters,
                        num_microbatches,
                        dp,
                        forward_only=True,
                    ),
                    **step,
                }
            )
        return StandinRun(losses, norms, _mean_loss(reports), saved)
    finally:
        parallel_state.destroy_model_parallel()
        destroy_num_microbatches_calculator()
        megatron_patches.remove()
        for patch, original in zip(dp_zero_load, replaced):
            setattr(patch.owner, patch.name, original)


# in a stand-in checkpoint: this rank's distrib_optim.pt (Megatron-LM's separate file), as bytes
DISTRIB_OPTIM = "distrib_optim.pt"


def _save_checkpoint(iteration: int, model: list[Any], optimizer: Any, *_: Any) -> bytes:
    """Megatron-LM's torch-format checkpoint of this rank (``generate_state_dict``, and with the
    distributed optimizer ``save_parameter_state``'s file: data-parallel rank 0's), serialised."""
    state: dict[str, Any] = {"iteration": iteration, "optimizer": optimizer.state_dict()}
    for key, chunk in zip(_model_keys(model), model):
        state[key] = chunk.state_dict_for_save_checkpoint()
    if megatron_arguments.get_args().use_distributed_optimizer:
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder, DISTRIB_OPTIM)
            optimizer.save_parameter_state(str(path))
            state[DISTRIB_OPTIM] = path.read_bytes() if path.is_file() else None
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def _load_checkpoint(model: list[Any], optimizer: Any, *_: Any, saved: bytes) -> int:
    """Megatron-LM's ``load_checkpoint`` of a torch-format checkpoint: the chunks' weights and the
    optimizer's state (``load_state_dict``, then with the distributed optimizer
    ``load_parameter_state`` of its file); the iteration to resume at."""
    state = torch.load(io.BytesIO(saved), weights_only=False)
    for key, chunk in zip(_model_keys(model), model):
        chunk.load_state_dict(state[key], strict=True)
    optimizer.load_state_dict(state["optimizer"])
    if megatron_arguments.get_args().use_distributed_optimizer:
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder, DISTRIB_OPTIM)
            if state.get(DISTRIB_OPTIM) is not None:  # data-parallel rank 0's, which it reads
                path.write_bytes(state[DISTRIB_OPTIM])
            optimizer.load_parameter_state(str(path))
    return state["iteration"]


def _model_keys(model: list[Any]) -> list[str]:
    return ["model"] if len(model) == 1 else [f"model{i}" for i in range(len(model))]


def _renamed(batches: Any, renamed: dict[str, str], *args: Any) -> dict[str, Any]:
    return {renamed.get(key, key): value for key, value in batches(*args).items()}


def _batch_edited(
    batches: Any,
    edit: Callable[[int, int, dict[str, Any]], dict[str, Any]],
    iteration: int,
    global_microbatch: int,
) -> dict[str, Any]:
    return edit(iteration, global_microbatch, batches(iteration, global_microbatch))


def _edited(provider: Any, edit: Callable[[Any], None], *args: Any, **kwargs: Any) -> Any:
    model = provider(*args, **kwargs)
    edit(model)
    return model


def _as_class(provider: Any, model_class: type, *args: Any, **kwargs: Any) -> Any:
    model = provider(*args, **kwargs)
    model.__class__ = model_class
    return model


def _get_model(provider: Any, args: Any) -> list[DistributedDataParallel]:
    """Megatron-LM's ``get_model``: the provider per virtual stage, ``model_type`` set, cast by
    ``Float16Module`` under --bf16/--fp16, DDP."""
    vp = args.virtual_pipeline_model_parallel_size or 1
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    pp = args.pipeline_model_parallel_size
    chunks = []
    for v in range(vp):
        pre = pp_rank == 0 and v == 0
        post = pp_rank == pp - 1 and v == vp - 1
        chunk = provider(pre_process=pre, post_process=post, **({"vp_stage": v} if vp > 1 else {}))
        chunk.model_type = ModelType.encoder_or_decoder
        if args.bf16 or args.fp16:
            chunk = Float16Module(get_model_config(chunk), chunk)
        chunks.append(chunk)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=False,
        overlap_grad_reduce=False,
        use_distributed_optimizer=args.use_distributed_optimizer,
    )
    return [
        DistributedDataParallel(get_model_config(chunk), ddp_config, chunk, disable_bucketing=v > 0)
        for v, chunk in enumerate(chunks)
    ]


def _optimizer_config(args: Any) -> OptimizerConfig:
    names = {f.name for f in fields(OptimizerConfig)}
    return OptimizerConfig(
        **{name: getattr(args, name) for name in names if hasattr(args, name)},
        params_dtype=torch.float32,
    )


def _schedule_kwargs(
    args: Any,
    model: list[Any],
    batches: Any,
    iteration: int,
    num_microbatches: int,
    dp: int,
    *,
    forward_only: bool,
) -> dict[str, Any]:
    """``train_step``'s (``evaluate``'s) call of the schedule: one data iterator per virtual stage,
    each reading this replica's microbatches of the iteration in order."""
    replica = parallel_state.get_data_parallel_rank()
    iterators = [
        iter([batches(iteration, replica * num_microbatches + k) for k in range(num_microbatches)])
        for _ in model
    ]
    # the LLM's sequence: the text and the image tokens (pretrain_vlm.py's decoder_seq_length)
    image_tokens = (args.img_h // args.patch_dim) * (args.img_w // args.patch_dim)
    decoder_seq_length = (args.dataloader_seq_length or args.seq_length) + image_tokens
    return {
        "forward_step_func": script.forward_step,
        "data_iterator": iterators if len(model) > 1 else iterators[0],
        "model": model,
        "num_microbatches": num_microbatches,
        "seq_length": decoder_seq_length,
        "micro_batch_size": args.micro_batch_size,
        "decoder_seq_length": decoder_seq_length,
        "forward_only": forward_only,
    }


def _mean_loss(reports: list[dict[str, torch.Tensor]]) -> float | None:
    if not reports:
        return None
    return float(torch.stack([r["lm loss"].float() for r in reports]).mean())
