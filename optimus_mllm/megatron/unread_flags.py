"""Megatron-LM's flags that do not shape the Optimus plan, so that ``optimus-plan -- FLAGS`` takes a
job's whole command line.

A ``pretrain_vlm.py`` command line carries, besides the model, parallelism and batch flags that
``optimus_mllm.megatron.arguments`` reads, flags for where the data and checkpoints are, which
tokenizer reads the text, what is logged and where, and which fused kernels run. None of them
changes the layers, the sequence, the batch or the parallel plan, so the planner may accept them
without reading them; ``add_unread_flags`` adds them to a parser, and the command names the ones a
command line gave (never silently). The names are listed here, not imported: the megatron-core
wheel has no ``megatron.training``. ``tests/unit/test_plan_megatron_flags.py`` checks each against
Megatron-LM's own parser (tag ``core_v0.16.1``, ``pretrain_vlm.py``'s extra flags included): the
flag exists there, takes as many values, and sets none of the names the look-alike parser reads.

A flag neither here nor in the look-alike parser stays refused, since it may shape the model: the
precision, recompute, sequence parallelism and sizes are read (``config_from_megatron_args``), and
so is anything that changes the vocabulary (``--make-vocab-size-divisible-by``,
``--vocab-extra-ids``), the kernels' numerics (``--cross-entropy-loss-fusion``,
``--attention-backend``), the gradients' reduction (``--overlap-grad-reduce``) or the model's
arguments (``--use-checkpoint-args``).
"""

from __future__ import annotations

import argparse
import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


class Takes(enum.Enum):
    """How many values a flag takes, as Megatron-LM's ``add_argument`` declares it (``nargs``)."""

    SWITCH = "no value (store_true / store_false)"
    ONE = "one value"
    ANY = "any number of values (nargs='*')"
    SOME = "one or more values (nargs='+')"

    @property
    def nargs(self) -> int | str | None:
        """argparse's ``nargs`` for it."""
        return {Takes.SWITCH: 0, Takes.ONE: None, Takes.ANY: "*", Takes.SOME: "+"}[self]


@dataclass(frozen=True)
class UnreadFlag:
    """A Megatron-LM flag the planner accepts and does not read."""

    flag: str
    takes: Takes


def _flags(takes: Takes, *names: str) -> tuple[UnreadFlag, ...]:
    return tuple(UnreadFlag(name, takes) for name in names)


SWITCH, ONE, ANY, SOME = Takes.SWITCH, Takes.ONE, Takes.ANY, Takes.SOME

UNREAD_FLAGS: tuple[UnreadFlag, ...] = (
    # data and dataloader: where the samples come from, not their shape (--seq-length,
    # --dataloader-seq-length and the image flags are read)
    *_flags(ANY, "--data-path", "--train-data-path", "--valid-data-path", "--test-data-path"),
    *_flags(ONE, "--split", "--data-args-path", "--per-split-data-args-path"),
    *_flags(ONE, "--per-dataset-sequences-path", "--data-cache-path", "--num-workers"),
    *_flags(ONE, "--num-dataset-builder-threads", "--object-storage-cache-path"),
    *_flags(ONE, "--mid-level-dataset-surplus", "--dataloader-type"),
    *_flags(SWITCH, "--mock-data", "--no-mmap-bin-files", "--dataloader-fast-cache-load"),
    *_flags(
        SWITCH, "--dataloader-defer-npy-index-mmap", "--no-create-attention-mask-in-dataloader"
    ),
    *_flags(SWITCH, "--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss"),
    # tokenizer: the planner's vocabulary is --vocab-size, which stays required
    *_flags(ONE, "--tokenizer-type", "--tokenizer-model", "--tokenizer-metadata"),
    *_flags(ONE, "--vocab-file", "--merge-file", "--tiktoken-pattern"),
    *_flags(SOME, "--tokenizer-special-tokens"),
    *_flags(SWITCH, "--legacy-tokenizer", "--tokenizer-sentencepiece-legacy"),
    *_flags(SWITCH, "--tokenizer-hf-use-fast", "--tokenizer-hf-include-special-tokens"),
    *_flags(SWITCH, "--trust-remote-code"),
    # evaluation
    *_flags(ONE, "--eval-iters", "--eval-interval"),
    # checkpointing: where and how often, in which format; not the model's arguments
    *_flags(ONE, "--save", "--load", "--save-interval", "--persistent-save-interval"),
    *_flags(ONE, "--save-retain-interval", "--non-persistent-save-interval"),
    *_flags(ONE, "--non-persistent-ckpt-type", "--non-persistent-global-ckpt-dir"),
    *_flags(ONE, "--non-persistent-local-ckpt-dir", "--non-persistent-local-ckpt-algo"),
    *_flags(ONE, "--pretrained-checkpoint", "--ckpt-step", "--ckpt-format"),
    *_flags(ONE, "--dist-ckpt-strictness"),
    *_flags(SWITCH, "--no-save-optim", "--no-save-rng", "--no-load-optim", "--no-load-rng"),
    *_flags(SWITCH, "--finetune", "--exit-on-missing-checkpoint", "--auto-detect-ckpt-format"),
    *_flags(SWITCH, "--async-save", "--use-persistent-ckpt-worker", "--ckpt-fully-parallel-load"),
    *_flags(SWITCH, "--no-ckpt-fully-parallel-save", "--ckpt-assume-constant-structure"),
    *_flags(SWITCH, "--disable-msc"),
    # when to stop and what to do on the way
    *_flags(ONE, "--exit-interval", "--exit-duration-in-mins", "--manual-gc-interval"),
    *_flags(ONE, "--adlr-autoresume-interval"),
    *_flags(SWITCH, "--exit-signal-handler", "--exit-signal-handler-for-dataloader", "--manual-gc"),
    *_flags(SWITCH, "--no-manual-gc-eval", "--adlr-autoresume"),
    # logging, timers and the logging backends
    *_flags(ONE, "--log-interval", "--tensorboard-dir", "--tensorboard-log-interval"),
    *_flags(ONE, "--tensorboard-queue-size", "--log-memory-interval", "--logging-level"),
    *_flags(ONE, "--wandb-project", "--wandb-exp-name", "--wandb-save-dir", "--wandb-entity"),
    *_flags(ONE, "--one-logger-project", "--one-logger-run-name", "--app-tag-run-name"),
    *_flags(ONE, "--app-tag-run-version", "--config-logger-dir"),
    *_flags(SWITCH, "--log-params-norm", "--log-throughput", "--log-progress", "--log-energy"),
    *_flags(SWITCH, "--log-timers-to-tensorboard", "--no-log-loss-scale-to-tensorboard"),
    *_flags(SWITCH, "--log-validation-ppl-to-tensorboard", "--log-memory-to-tensorboard"),
    *_flags(SWITCH, "--log-device-memory-used", "--log-num-zeros-in-grad"),
    *_flags(SWITCH, "--log-world-size-to-tensorboard", "--no-barrier-with-level-1-timing"),
    *_flags(SWITCH, "--no-one-logger", "--one-logger-async", "--log-straggler"),
    # profiling
    *_flags(ONE, "--profile-step-start", "--profile-step-end", "--memory-snapshot-path"),
    *_flags(SOME, "--profile-ranks"),
    *_flags(SWITCH, "--profile", "--use-pytorch-profiler", "--record-memory-history"),
    # fusions: each flag turns a fused kernel off, for the same numbers unfused
    *_flags(
        SWITCH, "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-swiglu-fusion"
    ),
    *_flags(SWITCH, "--no-bias-dropout-fusion", "--no-rope-fusion", "--no-persist-layer-norm"),
    *_flags(SWITCH, "--no-gradient-accumulation-fusion", "--disable-jit-fuser"),
    # where the weights are first drawn; the distributed backend and its time-outs
    *_flags(SWITCH, "--use-cpu-initialization"),
    *_flags(ONE, "--distributed-backend", "--distributed-timeout-minutes", "--local-rank"),
    # the rerun state machine and its checks of the loss and the gradients
    *_flags(ONE, "--rerun-mode", "--result-rejected-tracker-filename"),
    *_flags(SWITCH, "--check-for-spiky-loss", "--check-for-large-grads"),
    *_flags(SWITCH, "--no-check-for-nan-in-loss-and-grad"),
    # a no-op at this tag (megatron-core models are the default)
    *_flags(SWITCH, "--use-mcore-models"),
)

UNREAD_DEST = "megatron_flags_not_read"


class _NotRead(argparse.Action):
    """Accepts the flag with its values, and records only that it was given."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        given = getattr(namespace, UNREAD_DEST)
        if option_string not in given:
            setattr(namespace, UNREAD_DEST, [*given, option_string])


def add_unread_flags(
    parser: argparse.ArgumentParser, flags: Sequence[UnreadFlag] = UNREAD_FLAGS
) -> argparse.ArgumentParser:
    """Megatron's ``extra_args_provider`` contract: ``parser`` with ``flags`` accepted, each given
    one recorded, in the order given, in ``namespace.megatron_flags_not_read``.

    Args:
        parser: a parser of Megatron-LM's flags (``optimus_mllm.megatron.arguments.build_parser``).
        flags: the flags to accept without reading.

    Returns:
        ``parser``.
    """
    group = parser.add_argument_group(
        title="Megatron-LM flags that do not shape the plan (accepted, not read)"
    )
    for unread in flags:
        group.add_argument(
            unread.flag,
            nargs=unread.takes.nargs,
            action=_NotRead,
            dest=UNREAD_DEST,
            default=[],
            metavar="VALUE",
        )
    return parser
