"""Megatron-LM's own ``megatron.training.pretrain`` with ``--optimus-schedule`` added.

A Megatron-LM script (``pretrain_vlm.py``) opts in with one line after its imports::

    from optimus_mllm.megatron import pretrain

and keeps every argument of its ``pretrain(...)`` call. This ``pretrain`` is Megatron-LM's, called
with the same arguments; the only difference is that the script's ``extra_args_provider`` is chained
after one that adds ``--optimus-schedule`` (``optimus_mllm.megatron.arguments.add_optimus_args``),
so Megatron's argument parsing, ``initialize_megatron``, ``get_model``, optimizer, train and eval
loops, ``--save``/``--load`` and logging are the job's own. Without the flag nothing else changes.

With ``--optimus-schedule auto`` (or a saved artifact's path) Optimus enters through Megatron's
seams only (``optimus_mllm.megatron.seams``): the ``model_provider`` it is given, its optimizer,
its pipeline schedule and its checkpoint calls. ``--optimus-profile P`` beside it prices the job
with this machine's kernel profile. A problem with the job found at start-up is one line and exit
code 2 on every rank.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from optimus_mllm.errors import OptimusError
from optimus_mllm.megatron.arguments import add_optimus_args

ExtraArgsProvider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]

MEGATRON_LM_TAG = "core_v0.16.1"  # the Megatron-LM tag that goes with megatron-core 0.16.1


def megatron_training_importable() -> bool:
    """Whether Megatron-LM's ``megatron.training`` (a checkout, not the megatron-core wheel) is on
    the path."""
    if "megatron.training" in sys.modules:
        return True
    try:
        return importlib.util.find_spec("megatron.training") is not None
    except ModuleNotFoundError:  # no megatron package at all
        return False


def not_importable_error() -> OptimusError:
    """The one line for a Megatron-LM script run where ``megatron.training`` cannot be imported."""
    return OptimusError(
        "megatron.training cannot be imported: it is Megatron-LM's (a checkout at tag "
        f"{MEGATRON_LM_TAG} for this megatron-core), not in the megatron-core wheel; run the "
        "script from the checkout or with it on PYTHONPATH, on a host without CUDA through "
        "python -m optimus_mllm.megatron.cpu SCRIPT ARGS; without Megatron-LM, optimus-train "
        "trains from a YAML config"
    )


def _optimus_args_given(argv: list[str]) -> argparse.Namespace:
    """``--optimus-schedule`` and ``--optimus-profile`` in the command line, read the way
    Megatron's parser reads them (no abbreviations), before Megatron parses it: the decisions are
    made before any rank connects."""
    parser = add_optimus_args(argparse.ArgumentParser(allow_abbrev=False, add_help=False))
    known, _ = parser.parse_known_args(argv)
    return known


def _with_optimus_args(extra_args_provider: ExtraArgsProvider | None) -> ExtraArgsProvider:
    def provide(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        parser = add_optimus_args(parser)
        return extra_args_provider(parser) if extra_args_provider is not None else parser

    return provide


def pretrain(
    train_valid_test_dataset_provider: Callable[..., Any],
    model_provider: Callable[..., Any],
    model_type: Any,
    forward_step_func: Callable[..., Any],
    process_non_loss_data_func: Callable[..., Any] | None = None,
    extra_args_provider: ExtraArgsProvider | None = None,
    args_defaults: dict[str, Any] | None = None,
    get_embedding_ranks: Callable[[list[int]], list[int]] | None = None,
    get_position_embedding_ranks: Callable[[list[int]], list[int]] | None = None,
    non_loss_data_func: Callable[..., Any] | None = None,
    store: Any = None,
    inprocess_call_wrapper: Any = None,
) -> None:
    """``megatron.training.pretrain`` (Megatron-LM ``core_v0.16.1``'s signature) with
    ``--optimus-schedule`` among its flags.

    Args and behaviour are Megatron-LM's; see the module docstring. Where ``megatron.training``
    cannot be imported: one line and exit 2.
    """
    if not megatron_training_importable():
        exit_on_error(not_importable_error())
    import torch
    from megatron.training import get_args, training

    from megatron_patches.training_seams import training_seams
    from optimus_mllm.megatron.flags import optimus_profile_problem
    from optimus_mllm.megatron.seams import OptimusInMegatron
    from optimus_mllm.scheduler.artifact import load_artifact

    given = _optimus_args_given(sys.argv[1:])
    schedule = given.optimus_schedule
    device_kind = "cuda" if torch.cuda.is_available() else "cpu"
    problem = optimus_profile_problem(schedule, given.optimus_profile, device_kind)
    if problem is not None:
        exit_on_error(OptimusError(problem))
    if schedule not in (None, "auto"):
        # a schedule that cannot be read is one line on every rank before any rank connects; that
        # it fits the job is checked once Megatron has parsed the job's flags
        try:
            load_artifact(schedule)
        except OptimusError as error:
            exit_on_error(error)
    optimus = None if schedule is None else OptimusInMegatron(schedule, get_args)
    seams = contextlib.nullcontext() if optimus is None else training_seams(optimus.seams())
    try:
        with seams:
            training.pretrain(
                train_valid_test_dataset_provider,
                model_provider if optimus is None else optimus.model_provider(model_provider),
                model_type,
                forward_step_func,
                process_non_loss_data_func=process_non_loss_data_func,
                extra_args_provider=_with_optimus_args(extra_args_provider),
                args_defaults={} if args_defaults is None else args_defaults,
                get_embedding_ranks=get_embedding_ranks,
                get_position_embedding_ranks=get_position_embedding_ranks,
                non_loss_data_func=non_loss_data_func,
                store=store,
                inprocess_call_wrapper=inprocess_call_wrapper,
            )
    except OptimusError as error:  # decided alike on every rank: each leaves with the same line
        exit_on_error(error)


def exit_on_error(error: OptimusError) -> NoReturn:
    """One line from rank 0 (every rank decides alike, before any connects) and exit code 2."""
    if os.environ.get("RANK", "0") == "0":
        prog = os.path.basename(sys.argv[0]) or "pretrain"
        print(f"{prog}: error: {error}", file=sys.stderr)
    raise SystemExit(2)
