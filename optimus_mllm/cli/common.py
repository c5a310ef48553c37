"""What every optimus command does with user errors: one line on stderr, exit code 2, no
traceback."""

from __future__ import annotations

import argparse
import logging
import sys
import warnings
from collections.abc import Callable

from optimus_mllm.errors import OptimusError


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports a usage error in one line (argparse's own exit code, 2, is kept)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def add_config_arguments(
    parser: argparse.ArgumentParser, example: str, required: bool = True
) -> None:
    """--config and --override, the same on every command that reads a config (``required``:
    False where the command takes the job another way too)."""
    parser.add_argument("--config", required=required, help=f"YAML config, e.g. {example}")
    parser.add_argument(
        "--override",
        action="extend",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="override config fields, e.g. training.micro_batch_size=1 (one or more; repeatable)",
    )


def run(prog: str, body: Callable[[], int]) -> int:
    try:
        return body()
    except OptimusError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2


def quiet_library_warnings(cuda_available: bool) -> None:
    """Silence what torch and megatron-core print at import and set-up that a user can do nothing
    about,
    so that an error stays one line (an entry point calls this before importing them)."""
    # torch on a machine with a CUDA toolkit but no GPU: "No CUDA runtime is found, using
    # CUDA_HOME=..."
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    # the optional packages megatron-core falls back without (this project's README says they are
    # optional)
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
    warnings.filterwarnings("ignore", message="Apex is not installed")
    if not cuda_available:  # advice on a CUDA setting, given on the CPU too
        warnings.filterwarnings(
            "ignore", message="When using async grad allreduce it is recommended"
        )
