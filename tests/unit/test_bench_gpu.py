"""benchmarks/bench_gpu.py: importable anywhere; without a GPU one error line and exit status 2;
the memory plan checked against the GPU's free memory (its training modes:
``tests/distributed/test_bench_gpu_modes.py``)."""

from __future__ import annotations

import importlib.util
from types import ModuleType

import pytest
import torch

from optimus_mllm.config import load_config
from optimus_mllm.costing.memory_model import GIB
from optimus_mllm.planner import plan

from support.paths import CONFIGS, REPO

SCRIPT = REPO / "benchmarks" / "bench_gpu.py"


def _bench_gpu() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_imports_without_a_gpu():
    module = _bench_gpu()
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
def test_without_a_gpu_exits_2_with_one_line(tmp_path, capsys):
    """In this process: ``main``'s status is the script's (the profiled step's test runs the
    script as ``__main__``)."""
    out = tmp_path / "bench.json"
    assert _bench_gpu().main(["--json", str(out)]) == 2
    printed = capsys.readouterr()
    assert printed.out == ""
    lines = printed.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "bench_gpu.py: error: no CUDA GPU is visible;"
    ), printed.err
    assert not out.exists()


@pytest.mark.parametrize(
    "argv", [["--trace", "t.json"], ["--train-mode", "optimus", "--trace", "t"]]
)
def test_a_trace_without_a_profiled_step_is_refused_in_one_line(
    argv, tmp_path, monkeypatch, capsys
):
    """In this process: the refusal comes before anything is built."""
    monkeypatch.chdir(tmp_path)
    assert _bench_gpu().main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--trace" in err
    assert not list(tmp_path.iterdir())


def test_memory_plan_is_checked_against_the_gpus_free_memory():
    module = _bench_gpu()
    config = load_config(CONFIGS / "gpu_single.yaml")
    planned = plan(config)
    assert module.memory_problem(config, planned, 78 * GIB) is None  # an H100's free memory
    problem = module.memory_problem(config, planned, 40 * GIB)
    assert problem.startswith(f"{config.source}: the memory model puts a training step at 58.")
    assert "40.0 GiB free" in problem and "\n" not in problem
