"""One flag on an existing Megatron job: ``--optimus-schedule auto`` (or a saved schedule).

A Megatron-LM vision-language script keeps its ``model_provider``, ``forward_step`` and datasets
provider and takes ``pretrain`` from here in place of Megatron's::

    from optimus_mllm.megatron import pretrain  # adds --optimus-schedule auto|PLAN_JSON

Where Megatron-LM's ``megatron.training`` is importable, this is Megatron-LM's own ``pretrain``
(``optimus_mllm.megatron.lm``), Optimus entering through its seams
(``optimus_mllm.megatron.seams``). Where it is not (the megatron-core wheel alone), a script written
against ``optimus_mllm.megatron.core_training`` trains in the project's own loop (``train_vlm``):
without the flag the vision model runs in the first pipeline stage's forward; with it, the encoder
gets the schedule's own plan, starting from the weights the user's provider made, and its kernels
run at the schedule's hook points inside megatron-core's schedule (``runtime.user_model``).
``scripts/pretrain_vlm_megatron.py`` is such a script. Either way the job's Megatron-LM flags make
the Optimus config (``optimus_mllm.megatron.flags``): each flag that shapes the model is honoured or
refused in one line. With the flag, the encoder and projector are then read off the model the
provider built (``runtime.optimus_encoder.with_user_model``, as the seams read it), the schedule is
made for that job, and a saved schedule made for another job is refused with the reason.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from optimus_mllm.cli.common import quiet_library_warnings
from optimus_mllm.errors import OptimusError
from optimus_mllm.megatron.arguments import (
    ExtraArgsProvider,
    add_optimus_args,
    parse_args,
    set_args,
    validate_args,
)
from optimus_mllm.megatron.flags import (
    config_from_megatron_args,
    optimus_profile_problem,
    schedule_for_flag,
)
from optimus_mllm.planner import plan


def pretrain(
    train_valid_test_dataset_provider: Callable[..., Any],
    model_provider: Callable[..., Any],
    model_type: Any,
    forward_step_func: Callable[..., Any],
    process_non_loss_data_func: Callable[..., Any] | None = None,
    extra_args_provider: Callable[[argparse.ArgumentParser], argparse.ArgumentParser] | None = None,
    args_defaults: dict[str, Any] | None = None,
    get_embedding_ranks: Callable[[list[int]], list[int]] | None = None,
    get_position_embedding_ranks: Callable[[list[int]], list[int]] | None = None,
    non_loss_data_func: Callable[..., Any] | None = None,
    store: Any = None,
    inprocess_call_wrapper: Any = None,
) -> int | None:
    """Megatron-LM's ``pretrain()`` with ``--optimus-schedule``: what a script imports in its place.

    Where Megatron-LM's ``megatron.training`` is importable, it is Megatron-LM's own ``pretrain``
    with the flag added (``optimus_mllm.megatron.lm``), same signature and arguments. Where it is
    not (the megatron-core wheel alone), a script written against this project's stand-in
    (``optimus_mllm.megatron.core_training``) trains in the project's loop (``train_vlm``);
    Megatron-LM's own arguments there (``args_defaults``, the embedding ranks, ...) say in one line
    that ``megatron.training`` cannot be imported.
    """
    from optimus_mllm.megatron import lm as megatron_lm

    if megatron_lm.megatron_training_importable():
        return megatron_lm.pretrain(
            train_valid_test_dataset_provider,
            model_provider,
            model_type,
            forward_step_func,
            process_non_loss_data_func=process_non_loss_data_func,
            extra_args_provider=extra_args_provider,
            args_defaults=args_defaults,
            get_embedding_ranks=get_embedding_ranks,
            get_position_embedding_ranks=get_position_embedding_ranks,
            non_loss_data_func=non_loss_data_func,
            store=store,
            inprocess_call_wrapper=inprocess_call_wrapper,
        )
    megatron_lm_only = (
        process_non_loss_data_func,
        args_defaults,
        get_embedding_ranks,
        get_position_embedding_ranks,
        non_loss_data_func,
        store,
        inprocess_call_wrapper,
    )
    if any(argument is not None for argument in megatron_lm_only):
        megatron_lm.exit_on_error(megatron_lm.not_importable_error())
    return train_vlm(
        train_valid_test_dataset_provider,
        model_provider,
        model_type,
        forward_step_func,
        extra_args_provider,
        optimus_flag=True,
    )


def train_vlm(
    train_valid_test_datasets_provider: Callable[[list[int]], tuple[Any, Any, Any]],
    model_provider: Callable[..., Any],
    model_type: Any,
    forward_step_func: Callable[..., Any],
    extra_args_provider: ExtraArgsProvider | None = None,
    argv: list[str] | None = None,
    *,
    optimus_flag: bool,
) -> int:
    """Megatron-LM's ``pretrain()`` on megatron-core, for a ViT + GPT job; with ``optimus_flag``,
    its ``--optimus-schedule`` runs Optimus.

    It takes the four things a Megatron-LM script passes: a datasets provider (its train dataset is
    read in Megatron-LM's pretraining-sampler order), a ``model_provider(pre_process, post_process,
    vp_stage)`` building megatron-core's LLaVA layout (``runtime.user_model``), the model type
    (``ModelType.encoder_or_decoder``) and ``forward_step(data_iterator, model)``. It parses
    Megatron-LM's flags (``optimus_mllm.megatron.arguments``) plus ``--optimus-schedule`` and the
    script's own, sets up ``torch.distributed`` and megatron-core's ``parallel_state``, and trains
    ``--train-iters`` steps with megatron-core's DDP, optimizer and pipeline schedule, logging
    Megatron-LM's ``lm loss`` and its ``forward-compute`` / ``backward-compute`` timers. Without the
    flag the encoder runs in the first pipeline stage, as built; with it, under the schedule's own
    plan, inside the LLM's bubbles. Not Megatron-LM's: evaluation, checkpoint flags, tokenizers and
    the logging backends. A bad flag or a schedule made for another job: one line on stderr from
    rank 0 and exit code 2.
    """
    import os
    import sys

    import torch

    # before megatron-core's imports, as megatron.training's import does: an error stays one line
    quiet_library_warnings(torch.cuda.is_available())
    import torch.distributed as dist
    from megatron.core.enums import ModelType
    from megatron.core.timers import Timers

    import megatron_patches

    def parser_hook(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        parser = add_optimus_args(parser) if optimus_flag else parser
        return extra_args_provider(parser) if extra_args_provider is not None else parser

    args = parse_args(parser_hook, argv)
    if not optimus_flag:
        args.optimus_schedule = None
    set_args(args)
    prog = os.path.basename(sys.argv[0]) or "pretrain"
    # the same decision on every rank, before any rank connects (one leaving mid-handshake breaks
    # it)
    try:
        if model_type != ModelType.encoder_or_decoder:
            raise OptimusError(
                f"model_type {model_type}: a ViT + GPT model is ModelType.encoder_or_decoder"
            )
        if args.bf16 or args.fp16:
            raise OptimusError(
                f"--{'bf16' if args.bf16 else 'fp16'}: this loop does not cast the "
                "model_provider's model and its inputs as Megatron-LM's Float16Module does; train "
                "in fp32 here, or with Megatron-LM's own pretrain (optimus_mllm.megatron.pretrain)"
            )
        problem = optimus_profile_problem(
            args.optimus_schedule,
            getattr(args, "optimus_profile", None),  # the flag's parser only
            "cuda" if torch.cuda.is_available() else "cpu",
        )
        if problem is not None:
            raise OptimusError(problem)
        world_size = int(os.environ["WORLD_SIZE"])
        config = config_from_megatron_args(
            args, world_size, int(os.environ.get("LOCAL_WORLD_SIZE", 8))
        )
        # the providers read the flags as Megatron-LM's initialize_megatron leaves them
        validate_args(args, world_size)
    except OptimusError as exc:
        if os.environ.get("RANK", "0") == "0":
            print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    # megatron-core's CUDA assumptions, patched for the CPU (nothing on a GPU)
    megatron_patches.apply()
    from megatron.core import parallel_state

    from optimus_mllm.runtime.trainer import Trainer, join_model_parallel
    from optimus_mllm.runtime.user_model import UserModel, pretraining_sampler_batches

    llm_plan = plan(config).llm_plan
    # Megatron-LM's initialize_megatron: the providers may read parallel_state
    join_model_parallel(llm_plan)
    train_ds, _, _ = train_valid_test_datasets_provider(
        [args.train_iters * args.global_batch_size, 0, 0]
    )
    batches = pretraining_sampler_batches(
        train_ds, args.micro_batch_size, llm_plan.dp, args.global_batch_size
    )
    # Megatron's; the runtime's hooks chain to them
    timers = Timers(args.timing_log_level, args.timing_log_option)
    flagged = args.optimus_schedule is not None
    try:
        # with the flag, scheduled for the model as built (the config read off it, as the seams do)
        trainer = Trainer(
            config,
            llm_plan,
            "optimus" if flagged else "baseline",
            schedule_for_flag(args.optimus_schedule) if flagged else None,
            timers=timers,
            user_model=UserModel(model_provider, forward_step_func, batches),
        )
        artifact = trainer.artifact
        if artifact is not None:  # before the first step: the model's vision path is the encoder's
            said = trainer.probe_user_vision(0)
            if dist.get_rank() == 0:
                print(said, flush=True)
    except OptimusError as exc:  # a model the encoder cannot run, a schedule made for another
        # job, or a vision path that is not the encoder's
        if dist.get_rank() == 0:
            print(f"{prog}: error: {exc}", file=sys.stderr)
        dist.destroy_process_group()
        return 2
    reports_loss = (
        parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        and parallel_state.get_tensor_model_parallel_rank() == 0
        and parallel_state.get_data_parallel_rank() == 0
    )
    label = "plain" if artifact is None else f"optimus, encoder plan {artifact.encoder_plan}"
    for iteration in range(args.train_iters):
        result = trainer.train_step(iteration)
        if reports_loss:
            print(
                f"iteration {iteration + 1}/{args.train_iters} | lm loss {result.loss:.4f} | "
                f"{label}",
                flush=True,
            )
    # Megatron-LM's training_log: the schedule's timers, min/max over ranks, printed by the last
    # rank
    report = timers.get_all_timers_string(
        ["forward-compute", "backward-compute"], normalizer=args.train_iters
    )
    if dist.get_rank() == dist.get_world_size() - 1 and report:
        print(report, flush=True)
    trainer.close()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return 0
