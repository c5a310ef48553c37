"""Shared fixtures, and the rule behind the ``distributed`` marker: a test that starts ranks of a
job (a process of ``multiprocessing``, as ``support.distributed_utils`` starts gloo ranks, or a
subprocess that is torchrun or one of its ranks) must carry the marker, so that ``pytest -m "not
distributed"`` runs every test that starts none. The rule is enforced, not trusted: an unmarked test
that starts a rank fails, naming itself.
"""

from __future__ import annotations

import copy
import subprocess
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import pytest
import yaml

from support.paths import CONFIGS


@pytest.fixture
def tiny_raw() -> dict[str, Any]:
    """The tiny config as a mutable mapping."""
    return copy.deepcopy(yaml.safe_load((CONFIGS / "tiny.yaml").read_text()))


@pytest.fixture
def write_config(tmp_path: Path):
    """Write a mapping as YAML next to a copy of the model zoo and return its path."""

    def write(raw: dict[str, Any], name: str = "config.yaml") -> Path:
        path = tmp_path / name
        path.write_text(yaml.safe_dump(raw, sort_keys=False))
        return path

    return write


_current: dict[str, pytest.Item | None] = {"item": None}


def _starts_ranks(args: Any, env: dict[str, str] | None) -> bool:
    command = " ".join(map(str, args)) if isinstance(args, (list, tuple)) else str(args)
    return "torch.distributed.run" in command or "torchrun" in command or "RANK" in (env or {})


def _refuse_unmarked(what: str) -> None:
    item = _current["item"]
    if item is not None and item.get_closest_marker("distributed") is None:
        raise RuntimeError(
            f"{item.nodeid} starts {what}: mark it @pytest.mark.distributed (tests/conftest.py)"
        )


def pytest_configure(config: pytest.Config) -> None:
    popen_init = subprocess.Popen.__init__
    process_start = BaseProcess.start

    def guarded_popen_init(self: subprocess.Popen, args: Any, *rest: Any, **kwargs: Any) -> None:
        if _starts_ranks(args, kwargs.get("env")):
            _refuse_unmarked(f"ranks ({args[:6] if isinstance(args, list) else args})")
        popen_init(self, args, *rest, **kwargs)

    def guarded_start(self: BaseProcess) -> None:
        _refuse_unmarked("a process of multiprocessing (a rank)")
        process_start(self)

    subprocess.Popen.__init__ = guarded_popen_init  # type: ignore[method-assign]
    BaseProcess.start = guarded_start  # type: ignore[method-assign]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """The test being run (its fixtures' set-up and tear-down included) for the rule above."""
    _current["item"] = item
    yield
    _current["item"] = None
