"""scripts/gpu_truth.sh --preflight, here without a GPU: the device run's wheels, imports, time
limits, returned files and carried size checked, and the device call printed."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from support.paths import REPO

SCRIPT = REPO / "scripts" / "gpu_truth.sh"


def _preflight() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "gpu_preflight", REPO / "scripts" / "gpu_preflight.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # for its dataclasses
    spec.loader.exec_module(module)
    return module


def _wheels_or_skip() -> None:
    """The wheels the device run carries, fetched with pip if missing; a skip where pip cannot."""
    preflight = _preflight()
    if all(name in preflight.wheel_files() for name in preflight.wanted_wheels()):
        return
    fetch = subprocess.run(
        ["bash", str(REPO / "scripts" / "fetch_gpu_wheels.sh")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if fetch.returncode != 0:
        last = (fetch.stderr.strip().splitlines() or ["no output"])[-1]
        pytest.skip(f"pip could not download the GPU host's wheels (no network here?): {last}")


def test_preflight_passes_and_prints_the_device_call():
    _wheels_or_skip()
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--preflight"], capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    call = re.fullmatch(
        r'run\(command="bash scripts/gpu_truth.sh", carry=\["\.whl"\], timeout_s=(\d+)\)', lines[-1]
    )
    assert call and int(call[1]) <= 600, lines[-1]
    assert any(line.startswith("carried megatron-core 0.16.1: ") for line in lines), lines
    assert any(line.startswith("longest run: ") for line in lines), lines


def test_a_program_that_does_not_import_names_its_step(tmp_path):
    """The programs are probed in one interpreter, yet each as its own: a module one script
    imported from its folder is not there for a script in another folder."""
    _wheels_or_skip()
    preflight = _preflight()
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "main.py").write_text(
            "import argparse, helper\nargparse.ArgumentParser().parse_args()\n"
        )
    (tmp_path / "a" / "helper.py").write_text("")
    wheel = preflight.wheel_files()["pytest_timeout"][0]
    steps = preflight.read_steps(
        _table(
            tmp_path,
            [
                ("first", "10", ["python3", str(tmp_path / "a" / "main.py")]),
                ("second", "10", ["python3", str(tmp_path / "b" / "main.py"), "--json", "x"]),
            ],
        )
    )
    assert preflight.check_programs(steps[:1], wheel) == ["first"]
    with pytest.raises(
        preflight.PreflightError,
        match=r"^step second: python3 \S+/b/main.py --help: ModuleNotFoundError: .*'helper'",
    ):
        preflight.check_programs(steps, wheel)


def _table(tmp_path: Path, rows: list[tuple[str, str, list[str]]]) -> Path:
    path = tmp_path / "steps"
    path.write_text("".join(f"{n}\t{limit}\t{chr(31).join(argv)}\n" for n, limit, argv in rows))
    return path


def test_a_step_without_a_time_limit_is_refused(tmp_path):
    preflight = _preflight()
    with pytest.raises(preflight.PreflightError, match="step b has no time limit"):
        preflight.read_steps(_table(tmp_path, [("a", "30", ["true"]), ("b", "", ["true"])]))


def test_limits_over_one_device_command_are_refused(tmp_path):
    preflight = _preflight()
    steps = preflight.read_steps(_table(tmp_path, [("a", "300", ["true"]), ("b", "200", ["x"])]))
    assert preflight.check_time(steps, 45, 5, 600) == 555
    with pytest.raises(preflight.PreflightError, match="add up to 615 s"):
        preflight.check_time(steps, 45, 5 + 30, 600)


def test_more_files_than_come_back_are_refused(tmp_path):
    preflight = _preflight()
    rows = [(f"s{i}", "10", ["python3", "x.py", "--json", f"OUT/{i}.json"]) for i in range(8)]
    steps = preflight.read_steps(_table(tmp_path, rows))
    with pytest.raises(preflight.PreflightError, match="leaves 9 files in OUT"):
        preflight.check_outputs(steps, "OUT")
    assert len(preflight.check_outputs(steps[:7], "OUT")) == 8  # the log too
