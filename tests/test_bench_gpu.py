"""scripts/bench_gpu.py: importable anywhere; without a GPU one error line and exit status 2."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO

SCRIPT = REPO / "scripts" / "bench_gpu.py"


def test_imports_without_a_gpu():
    spec = importlib.util.spec_from_file_location("bench_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name in (
        "measure_kernel_level",
        "measure_overlap",
        "measure_bubble",
        "measure_training",
        "main",
    ):
        assert callable(getattr(module, name))
    assert module.build_parser().parse_args(["--json", "out.json"]).json == "out.json"


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="a CUDA GPU is visible: the script would measure"
)
def test_without_a_gpu_exits_2_with_one_line(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "bench_gpu.py: error: no CUDA GPU is visible;"
    ), proc.stderr
    assert not out.exists()
