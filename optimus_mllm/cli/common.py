"""What every optimus command does with user errors: one line on stderr, exit code 2, no traceback."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from optimus_mllm.errors import OptimusError


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports a usage error in one line (argparse's own exit code, 2, is kept)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def add_config_arguments(parser: argparse.ArgumentParser, example: str) -> None:
    """--config and --override, the same on every command that reads a config."""
    parser.add_argument("--config", required=True, help=f"YAML config, e.g. {example}")
    parser.add_argument("--override", action="extend", nargs="+", default=[], metavar="KEY=VALUE",
                        help="override config fields, e.g. training.micro_batch_size=1 (one or more; repeatable)")


def run(prog: str, body: Callable[[], int]) -> int:
    try:
        return body()
    except OptimusError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
