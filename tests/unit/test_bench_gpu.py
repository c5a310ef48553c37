"""benchmarks/bench_gpu.py: importable anywhere; without a GPU one error line and exit status 2;
each training mode in a process of its own; the memory plan checked against the GPU's free
memory."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
import yaml

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
    """In this process: ``main``'s status is the script's (the profiled step's
    test runs the script in an interpreter)."""
    out = tmp_path / "bench.json"
    assert _bench_gpu().main(["--json", str(out)]) == 2
    printed = capsys.readouterr()
    assert printed.out == ""
    lines = printed.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "bench_gpu.py: error: no CUDA GPU is visible;"
    ), printed.err
    assert not out.exists()


def _tiny_on_one_rank(tmp_path: Path) -> Path:
    raw = yaml.safe_load((CONFIGS / "tiny.yaml").read_text())
    raw["cluster"]["num_gpus"] = 1
    raw["training"]["global_batch_size"] = 8
    raw["parallel"]["llm"] = {"dp": 1, "pp": 1, "tp": 1, "vp": 1}
    path = tmp_path / "tiny_one_rank.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_each_training_mode_runs_in_a_process_of_its_own(tmp_path):
    """A closed trainer keeps tensors alive (issue 40): on a GPU the baseline's memory would still
    be held while the Optimus trainer is built. Here on the CPU, with a tiny config."""
    module = _bench_gpu()
    config = load_config(_tiny_on_one_rank(tmp_path))
    result = module.measure_training(config, peak_tflops=1.0, steps=1, warmup=1)
    processes = [result[mode]["process"] for mode in module.MODES]
    assert len(set(processes)) == 2 and os.getpid() not in processes
    assert len(result["optimus"]["losses"]) == 2
    assert result["optimus"]["losses"] == pytest.approx(result["baseline"]["losses"], rel=1e-4)


def test_train_mode_prints_a_profiled_step(tmp_path):
    """What scripts/gpu_truth.sh's profile-train step reads: where a mode's step time goes."""
    out = tmp_path / "optimus.json"
    trace = tmp_path / "optimus.trace.json.gz"
    proc = subprocess.run(
        [
            *(sys.executable, str(SCRIPT), "--config", str(_tiny_on_one_rank(tmp_path))),
            *("--train-mode", "optimus", "--steps", "1", "--warmup", "1"),
            *("--json", str(out), "--profile-rows", "5", "--trace", str(trace)),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "optimus: one training step under torch.profiler" in proc.stdout
    assert "Self CPU" in proc.stdout
    assert len(json.loads(out.read_text())["losses"]) == 2  # the profiled step is not counted
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    assert any(event.get("name") == "aten::mm" for event in events)  # the step's own ops


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
